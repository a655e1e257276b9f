"""Workarounds for upstream gaps, all in one place (each says why).

Applied once, idempotently, by :func:`install` (called when the modifier module is
imported). Two of them fix llm-compressor for every ``oneshot`` in the process, not only
REAP's: data-parallel partitioning of a dataset every rank passed, and the sequential
pipeline's attention mask. The rest change nothing for models this package does not
prune.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import sys
from collections.abc import Mapping

from loguru import logger
from torch.utils.data import Sampler

from .models.config_keys import COUNT_KEYS
from .fileio import write_json_atomic

__all__ = [
    "RankShareSampler",
    "add_calibration_batch_listener",
    "decompress_loaded_model",
    "fix_saved_expert_counts",
    "pause_decompress_hook",
    "install",
    "load_packed_model",
    "rebuild_traced_config",
    "recipe_keeps_experts_packed",
    "register_kimi_auto_classes",
    "remove_calibration_batch_listener",
    "repack_linearized_experts",
]

_INSTALLED = False


def fix_saved_expert_counts(config, save_dir: str) -> None:
    """Make ``save_dir/config.json`` carry the model's current expert count.

    Why: llm-compressor 0.14.0.1 ``resave_config`` rewrites config.json from the
    *original* checkpoint's config and patches only ``num_experts``,
    ``num_local_experts`` and ``moe_num_experts``; DeepSeek-V3 / GLM4-MoE keep the old
    ``n_routed_experts`` and the pruned checkpoint cannot load. We patch every count
    key that is present (top level and nested ``text_config``) from the live config.
    """
    path = os.path.join(save_dir, "config.json")
    if not os.path.exists(path):
        return
    with open(path) as f:
        saved = json.load(f)
    live = config.to_dict()
    changed = False
    for section_saved, section_live in (
        (saved, live),
        (saved.get("text_config"), live.get("text_config")),
    ):
        if not isinstance(section_saved, dict) or not isinstance(section_live, dict):
            continue
        for key in COUNT_KEYS:
            if key in section_saved and key in section_live:
                if section_saved[key] != section_live[key]:
                    section_saved[key] = section_live[key]
                    changed = True
    if changed:
        write_json_atomic(path, saved, indent=2, sort_keys=True)
        logger.info(f"REAP: patched expert counts in {path} (upstream resave_config gap)")


def _patch_resave_config() -> None:
    from llmcompressor.transformers.compression import compressed_tensors_utils as ctu

    original = ctu.resave_config
    if getattr(original, "_reap_patched", False):
        return

    def resave_config(config, save_dir):
        original(config, save_dir)
        fix_saved_expert_counts(config, save_dir)

    resave_config._reap_patched = True
    ctu.resave_config = resave_config


def _drop_broken_lazy_aliases(resolve: bool = False) -> None:
    """Why: with transformers 5.17 and no torchvision, walking ``sys.modules`` (as
    llm-compressor's ``load_context`` / ``load_quantizable_moe`` do) touches lazy
    alias modules whose import fails. Dropping the unimportable ones avoids the crash.

    :param resolve: also ``dir()`` every alias module (transformers' legacy-path
        aliases resolve their target on ``dir``), as transformers' ``apply_patches``
        does when ``load_quantizable_moe`` registers a class patch; costs the imports
        that walk would make anyway
    """
    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers") or module is None:
            continue
        try:
            getattr(module, "__dict__")
            if resolve and "__dir__" in module.__dict__:
                dir(module)
        except Exception:  # noqa: BLE001 - any failure means unusable alias
            sys.modules.pop(name, None)


def register_kimi_auto_classes() -> None:
    """Why: ``oneshot`` re-reads the config through ``AutoConfig``; Kimi K3's
    ``kimi_k3`` model type is not registered with transformers (and transformers' own
    ``kimi_linear`` is a different architecture), so register llm-compressor's classes.
    """
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from llmcompressor.modeling.kimi_k3.configuration_kimi_k3 import KimiK3Config
    from llmcompressor.modeling.kimi_k3.modeling_kimi_k3 import (
        KimiK3ForConditionalGeneration,
    )

    for auto in (AutoConfig,):
        try:
            auto.register("kimi_k3", KimiK3Config, exist_ok=True)
        except TypeError:  # older signature
            auto.register("kimi_k3", KimiK3Config)
    for auto in (AutoModel, AutoModelForCausalLM):
        try:
            auto.register(KimiK3Config, KimiK3ForConditionalGeneration, exist_ok=True)
        except ValueError:
            pass


def repack_linearized_experts(model) -> int:
    """Pack experts that llm-compressor linearized *after loading* back into the
    model's native fused experts module; returns how many were repacked.

    Why: ``oneshot`` linearizes fused MoE experts post-load (``LinearExperts2D``) and
    saves them under ``experts.{e}.gate_proj/up_proj/down_proj`` names. That happens
    to be the checkpoint format of Qwen3-MoE / OLMoE / DeepSeek-V3 / GLM4-MoE, but not
    of Mixtral (``w1/w2/w3``) or GPT-OSS (fused): transformers then loads those
    experts as random weights. Repacking lets transformers' own save conversion
    write each family's native names. Quantized experts are left alone: their
    compressed-tensors format is per-expert 2-D by design.
    """
    from llmcompressor.modeling.moe.linearize import get_linearized_moes

    repacked = 0
    for name, experts in get_linearized_moes(model):
        if getattr(experts, "_source_experts_cls", None) is None:
            continue  # loaded linearized through conversion mappings: saves correctly
        if any(hasattr(m, "quantization_scheme") for m in experts.modules()):
            continue
        model.set_submodule(name, experts.to_experts_module())
        repacked += 1
    if repacked:
        logger.info(f"REAP: repacked {repacked} linearized experts modules for saving")
    return repacked


def _patch_gpt_oss_repack() -> None:
    """Why: llm-compressor 0.14.0.1 ``GptOssExpertMLP`` de-interleaves GPT-OSS's fused
    ``gate_up_proj`` (gate = even columns, up = odd) on linearization but inherits the
    generic *halves* layout for the inverse, so a repacked GPT-OSS model computes
    garbage. Install the matching inverse.
    """
    from llmcompressor.modeling.moe.gpt_oss import GptOssExpertMLP

    if getattr(GptOssExpertMLP.copy_to_experts_module, "_reap_patched", False):
        return

    def copy_to_experts_module(self, experts, index: int) -> None:
        experts.gate_up_proj[index, :, 0::2].copy_(self.gate_proj.weight.T)
        experts.gate_up_proj[index, :, 1::2].copy_(self.up_proj.weight.T)
        experts.down_proj[index].copy_(self.down_proj.weight.T)
        experts.gate_up_proj_bias[index, 0::2].copy_(self.gate_proj.bias)
        experts.gate_up_proj_bias[index, 1::2].copy_(self.up_proj.bias)
        experts.down_proj_bias[index].copy_(self.down_proj.bias)

    copy_to_experts_module._reap_patched = True
    GptOssExpertMLP.copy_to_experts_module = copy_to_experts_module


def decompress_loaded_model(model) -> bool:
    """Decompress a model that ``from_pretrained`` left compressed; returns whether it did.

    Why: compressed-tensors decompresses on the *model's* first forward (a pre-hook on
    the top module), but llm-compressor's sequential pipeline calls decoder-layer
    subgraphs directly, so the hook never fires and calibration meets packed weights
    (``'Linear' object has no attribute 'weight'``). Run that same hook now.
    """
    handle = getattr(model, "ct_decompress_hook", None)
    hook = model._forward_pre_hooks.get(handle.id) if handle is not None else None
    if hook is None:
        return False
    logger.info("REAP: decompressing the compressed-tensors model before calibration")
    hook(model, ())
    return True


# -- data-parallel calibration: every rank passes the same dataset ----------------------


class RankShareSampler(Sampler[int]):
    """This rank's share of the samples one process would calibrate on, as indices
    into the *full* dataset (the calibration DataLoader is built over the full one).

    The selection is the one llm-compressor makes in a single process with the same
    arguments, ``n = min(num_calibration_samples, len(dataset))`` samples:

    - ``shuffle_calibration_samples=False``: ``LengthAwareSampler``'s choice and order
      (the ``n`` longest samples, longest first);
    - ``shuffle_calibration_samples=True``: ``RandomSampler``'s draw, made on rank 0
      from rank 0's torch RNG at iteration time (as a single process draws it) and
      broadcast, so every rank splits the same permutation.

    Rank ``r`` of ``W`` takes positions ``r, r + W, r + 2W, ...`` of that list: shares
    are disjoint, cover the selection, differ in size by at most one sample and keep
    the longest-first order (so batches pad little and token loads balance).
    """

    def __init__(self, dataset, num_samples: int | None, shuffle: bool, batch_size: int,
                 rank: int, world_size: int):
        from llmcompressor.datasets.utils import LengthAwareSampler

        self.dataset_len = len(dataset)
        self.num_selected = min(num_samples or self.dataset_len, self.dataset_len)
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        if self.num_selected < world_size:
            raise ValueError(
                f"data-parallel calibration over {world_size} ranks needs at least one "
                f"sample per rank, but only {self.num_selected} calibration samples were "
                "selected; raise num_calibration_samples (or use fewer ranks)"
            )
        self._fixed = (
            None
            if shuffle
            else list(LengthAwareSampler(dataset, num_samples=self.num_selected,
                                         batch_size=batch_size))
        )

    def selection(self) -> list[int]:
        """The selection over all ranks (collective when shuffling)."""
        if self._fixed is not None:
            return self._fixed
        import torch.distributed as dist
        from torch.utils.data import RandomSampler

        drawn = [
            list(RandomSampler(range(self.dataset_len), num_samples=self.num_selected))
            if self.rank == 0
            else None
        ]
        dist.broadcast_object_list(drawn, src=0)
        return drawn[0]

    def __iter__(self):
        return iter(self.selection()[self.rank :: self.world_size])

    def __len__(self) -> int:
        return len(range(self.rank, self.num_selected, self.world_size))


def _patch_rank_partition() -> None:
    """Why: llm-compressor 0.14.0.1 partitions a dataset that every rank passed
    identically in ``datasets/utils.py::_make_sampler`` by slicing it
    (``dataset = dataset.select(range(start, end))``) and returning a sampler over the
    *slice*, while ``format_calibration_data`` builds the DataLoader over the *full*
    dataset. The sampler's slice-relative indices ``0..len(slice)-1`` therefore read
    the first samples of the full dataset on every rank: with 2 ranks and 12 samples
    both ranks calibrate on samples 0-5, samples 6-11 are never seen, and decisions
    differ from a single process although token totals agree. The slice is also cut
    from ``num_calibration_samples`` before it is clamped to the dataset length, so the
    default (512) with a smaller dataset raises ``IndexError``.

    We keep upstream's detection (``_is_dist_and_same_ds``, a collective every rank
    runs) and upstream's sampler for every other case, and replace the partitioning
    branch by :class:`RankShareSampler`, whose indices address the full dataset.
    """
    from llmcompressor.datasets import utils as ds_utils

    original = ds_utils._make_sampler
    if getattr(original, "_reap_patched", False):
        return

    def _make_sampler(args, dataset):
        if not ds_utils._is_dist_and_same_ds(dataset):
            return original(args, dataset)
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        sampler = RankShareSampler(
            dataset,
            args.num_calibration_samples,
            args.shuffle_calibration_samples,
            args.batch_size,
            rank,
            world,
        )
        logger.info(
            f"REAP: the same dataset on all {world} ranks: rank {rank} calibrates on "
            f"{len(sampler)} of the {sampler.num_selected} samples a single process "
            f"would use ({'shuffled' if sampler.shuffle else 'longest first'})"
        )
        return sampler

    _make_sampler._reap_patched = True
    ds_utils._make_sampler = _make_sampler


# -- padding: the sequential pipeline's batches ------------------------------------------

_BATCH_LISTENERS: list = []


def add_calibration_batch_listener(listener) -> None:
    """Call ``listener(batches: list[dict])`` whenever the sequential pipeline caches
    the calibration batches (in the order ``state.current_batch_idx`` indexes)."""
    if listener not in _BATCH_LISTENERS:
        _BATCH_LISTENERS.append(listener)


def remove_calibration_batch_listener(listener) -> None:
    if listener in _BATCH_LISTENERS:
        _BATCH_LISTENERS.remove(listener)


class _RecordingLoader:
    """Iterates a DataLoader and keeps each batch's ``input_ids`` / ``attention_mask``."""

    def __init__(self, loader):
        self.loader = loader
        self.batches: list[dict] = []

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            if isinstance(batch, Mapping):  # dict, or transformers' BatchEncoding
                self.batches.append(
                    {k: batch.get(k) for k in ("input_ids", "attention_mask")}
                )
            else:
                self.batches.append({})
            yield batch


def _patch_calibration_cache() -> None:
    """Why: llm-compressor 0.14.0.1's sequential pipeline never calls the model: it
    runs decoder-layer subgraphs on batches it caches with
    ``IntermediatesCache.from_dataloader``, and the 2-D attention mask reaches only the
    first subgraph (later ones get the 4-D causal mask, whose form depends on the
    attention implementation). Modifiers get ``state.current_batch_idx`` but not the
    batch (only AWQ's ``loss_mask`` is exposed, via ``use_loss_mask``), so without
    help an observer cannot tell padded positions from tokens. We hand the cached
    batches' ``input_ids`` / ``attention_mask`` to registered listeners; nothing
    else changes.
    """
    from llmcompressor.pipelines.cache import IntermediatesCache

    original = IntermediatesCache.from_dataloader.__func__
    if getattr(original, "_reap_patched", False):
        return

    def from_dataloader(cls, dataloader, *args, **kwargs):
        if not _BATCH_LISTENERS:
            return original(cls, dataloader, *args, **kwargs)
        recording = _RecordingLoader(dataloader)
        cache = original(cls, recording, *args, **kwargs)
        for listener in list(_BATCH_LISTENERS):
            listener(recording.batches)
        return cache

    from_dataloader._reap_patched = True
    IntermediatesCache.from_dataloader = classmethod(from_dataloader)


# -- the sequential pipeline's attention mask --------------------------------------------


def rebuild_traced_config(config_class: str, attn_implementation: str | None, **kwargs):
    """Rebuild a config inside a traced subgraph, keeping its attention implementation."""
    import importlib

    module, _, name = config_class.rpartition(".")
    config = getattr(importlib.import_module(module), name)(**kwargs)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    return config


def _patch_traced_config_attention() -> None:
    """Why: llm-compressor 0.14.0.1's ``SequentialTracer.create_arg``
    (``pipelines/sequential/helpers.py``) bakes a model config into the traced
    subgraph as ``ConfigClass(**config.to_dict())``. With transformers 5.17,
    ``to_dict()`` leaves out the private ``_attn_implementation``, so the rebuilt
    config has ``None`` there, and ``create_causal_mask`` (``masking_utils.py``,
    ``_preprocess_mask_arguments``: an implementation not in the mask registry needs
    "no mask") returns ``None``. Every decoder layer of a transformers-native model
    (Qwen3-MoE, DeepSeek-V3, OLMoE, Mixtral, GLM4-MoE, GPT-OSS) then runs eager
    attention with **no mask at all** in the sequential pipeline: tokens attend to
    later tokens, and real tokens attend to padding, so calibration statistics come
    from a different (non-causal) model than the one deployed. Rebuild the config
    with the traced model's ``_attn_implementation`` (eager, forced by
    ``calibration_forward_context`` while tracing), so the mask is created as in the
    model's own forward.

    Also: torch.fx writes nested dict values of those kwargs with ``repr``. A model
    loaded packed keeps its compressed-tensors ``quantization_config``, whose
    ``QuantizationStatus.COMPRESSED`` repr is not Python (tracing Qwen3-MoE failed with a
    SyntaxError); enums are passed as their values.
    """
    from transformers.configuration_utils import PretrainedConfig

    from llmcompressor.pipelines.sequential.helpers import SequentialTracer

    original = SequentialTracer.create_arg
    if getattr(original, "_reap_patched", False):
        return

    def create_arg(self, a):
        if isinstance(a, PretrainedConfig):
            cls = type(a)
            kwargs = {k: self.create_arg(_plain(v)) for k, v in a.to_dict().items()}
            return self.create_node(
                "call_function",
                rebuild_traced_config,
                (f"{cls.__module__}.{cls.__qualname__}", getattr(a, "_attn_implementation", None)),
                kwargs,
            )
        return original(self, a)

    create_arg._reap_patched = True
    SequentialTracer.create_arg = create_arg


def pause_decompress_hook(model):
    """Stop compressed-tensors' decompress-on-first-forward hook of ``model`` from firing;
    returns a function that puts it back (a no-op when the model has none).

    Why: ``from_pretrained`` of a compressed checkpoint registers a pre-hook on the top
    module that decompresses *every* compressed module on the model's first forward
    (``ModelCompressor.add_decompress_hook``). Calibration on packed experts must keep
    them packed whichever pipeline runs (the basic pipeline calls the model itself);
    after calibration the hook is restored so later use of the model behaves as loaded.
    """
    handle = getattr(model, "ct_decompress_hook", None)
    if handle is None or handle.id not in model._forward_pre_hooks:
        return lambda: None
    hook = model._forward_pre_hooks.pop(handle.id)

    def resume() -> None:
        model._forward_pre_hooks[handle.id] = hook

    return resume


#: set while ``Oneshot.__init__`` runs a recipe that calibrates on packed experts
_PACKED_LOAD: contextvars.ContextVar[bool] = contextvars.ContextVar("reap_packed_load", default=False)


def recipe_keeps_experts_packed(recipe) -> bool:
    """Whether ``recipe`` (anything ``oneshot`` accepts) holds only REAP modifiers and
    none of them asks for ``dequantize: model``: then nothing but REAP reads the
    weights and the model can stay packed. Unparseable recipes answer False (upstream
    reports their errors)."""
    from .modifier import REAPPruningModifier

    if recipe is None:
        return False
    try:
        if isinstance(recipe, REAPPruningModifier):
            modifiers = [recipe]
        elif isinstance(recipe, list) and all(isinstance(m, REAPPruningModifier) for m in recipe):
            modifiers = recipe
        else:
            from llmcompressor.recipe import Recipe

            modifiers = Recipe.create_instance(recipe).modifiers
    except Exception:  # noqa: BLE001 - upstream parses (and reports) it again
        return False
    return bool(modifiers) and all(
        isinstance(m, REAPPruningModifier) and m.dequantize != "model" for m in modifiers
    )


@contextlib.contextmanager
def _restore_conversion_mappings():
    """Why: llm-compressor's ``load_quantizable_moe`` registers its linearized (2-D)
    conversion mapping for the model type *globally* and leaves it there, so every later
    ``from_pretrained`` of that model type in the process would load a fused-expert
    checkpoint with the wrong mapping. Put the registry back after our load (the loaded
    model keeps its own save mapping in ``_weight_conversions``)."""
    from transformers import conversion_mapping as cm

    cm.get_checkpoint_conversion_mapping("llama")  # builds the cache if needed
    saved = dict(cm._checkpoint_conversion_mapping_cache)
    user = set(cm.USER_REGISTERED_MAPPINGS)
    try:
        yield
    finally:
        cm._checkpoint_conversion_mapping_cache.clear()
        cm._checkpoint_conversion_mapping_cache.update(saved)
        cm.USER_REGISTERED_MAPPINGS.clear()
        cm.USER_REGISTERED_MAPPINGS.update(user)


def load_packed_model(model_args, original_load):
    """Run llm-compressor's ``initialize_model_from_path`` keeping compressed modules
    packed: no ``dequantize=True``, and per-expert (2-D) checkpoints loaded linearized
    through ``load_quantizable_moe`` so their experts stay per-expert ``Linear`` modules
    (transformers would otherwise dequantize them while fusing them into 3-D experts).
    """
    from compressed_tensors.utils import patch_attr
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from llmcompressor.entrypoints import utils as entry_utils
    from llmcompressor.modeling.moe.linearize import load_quantizable_moe

    from .calibration.packed import check_checkpoint_formats

    path = str(model_args.model)
    config_file = os.path.join(path, "config.json")
    if os.path.isfile(config_file):
        with open(config_file) as f:
            check_checkpoint_formats(json.load(f))

    def keep_packed(**kwargs):
        kwargs["dequantize"] = False
        return CompressedTensorsConfig(**kwargs)

    _drop_broken_lazy_aliases(resolve=True)
    logger.info(
        f"REAP: loading {path} with its compressed modules packed (the recipe only runs "
        "REAP, which dequantizes one MoE layer at a time)"
    )
    with (
        _restore_conversion_mappings(),
        patch_attr(entry_utils, "CompressedTensorsConfig", keep_packed),
        load_quantizable_moe(AutoModelForCausalLM),
    ):
        return original_load(model_args)


def _patch_oneshot_packed_load() -> None:
    """Why: ``oneshot(model=<path>)`` loads every compressed-tensors checkpoint with
    ``CompressedTensorsConfig(dequantize=True)`` (``initialize_model_from_path``), i.e.
    fully dense, before any modifier exists. When the recipe only runs REAP, load it
    packed instead; any other recipe gets upstream's load unchanged."""
    import importlib

    from llmcompressor.entrypoints import utils as entry_utils
    from llmcompressor.transformers.utils.helpers import is_model_ct_quantized_from_path

    # the package re-exports the *function* ``oneshot`` under the submodule's name
    cls = importlib.import_module("llmcompressor.entrypoints.oneshot").Oneshot
    if getattr(cls.__init__, "_reap_patched", False):
        return
    original_init = cls.__init__
    original_load = entry_utils.initialize_model_from_path

    def __init__(self, log_dir=None, **kwargs):
        token = _PACKED_LOAD.set(recipe_keeps_experts_packed(kwargs.get("recipe")))
        try:
            original_init(self, log_dir=log_dir, **kwargs)
        finally:
            _PACKED_LOAD.reset(token)

    def initialize_model_from_path(model_args):
        if _PACKED_LOAD.get() and is_model_ct_quantized_from_path(model_args.model):
            return load_packed_model(model_args, original_load)
        return original_load(model_args)

    __init__._reap_patched = True
    cls.__init__ = __init__
    entry_utils.initialize_model_from_path = initialize_model_from_path


def _plain(value):
    """``value`` with every Enum replaced by its value (recursively in dicts / lists)."""
    import enum

    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    _patch_resave_config()
    _patch_gpt_oss_repack()
    _patch_rank_partition()
    _patch_calibration_cache()
    _patch_traced_config_attention()
    _patch_oneshot_packed_load()
    _drop_broken_lazy_aliases()
    try:
        register_kimi_auto_classes()
    except Exception as exc:  # noqa: BLE001 - K3 support is optional at import
        logger.debug(f"REAP: Kimi K3 auto-class registration skipped: {exc}")
    _INSTALLED = True
