"""Loading workarounds: Kimi K3's auto classes, transformers' broken lazy aliases, a
compressed model's decompress-on-first-forward hook, and ``oneshot(model=<path>)``
loading a REAP-only recipe's model with its experts packed."""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import sys
from pathlib import Path

from loguru import logger

__all__ = [
    "decompress_loaded_model",
    "drop_broken_lazy_aliases",
    "load_checkpoint_model",
    "load_packed_model",
    "patch_oneshot_packed_load",
    "pause_decompress_hook",
    "recipe_keeps_experts_packed",
    "register_kimi_auto_classes",
]


def drop_broken_lazy_aliases(resolve: bool = False) -> None:
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
            _ = module.__dict__  # a lazy alias module raises here when unusable
            if resolve and "__dir__" in module.__dict__:
                dir(module)
        except Exception:  # noqa: BLE001 - any failure means unusable alias
            sys.modules.pop(name, None)


def register_kimi_auto_classes() -> None:
    """Why: ``oneshot`` re-reads the config through ``AutoConfig``; Kimi K3's
    ``kimi_k3`` model type is not registered with transformers (and transformers' own
    ``kimi_linear`` is a different architecture), so register llm-compressor's classes.
    """
    from llmcompressor.modeling.kimi_k3.configuration_kimi_k3 import KimiK3Config
    from llmcompressor.modeling.kimi_k3.modeling_kimi_k3 import (
        KimiK3ForConditionalGeneration,
    )
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

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


def load_checkpoint_model(path: str | os.PathLike, *, dtype: str = "auto", packed: bool = False):
    """A checkpoint directory through transformers' ``AutoModelForCausalLM`` (Kimi K3 via
    llm-compressor's class), eval mode, floating weights in ``dtype`` (``"auto"``: the
    config's). compressed-tensors checkpoints are decompressed on load, or with ``packed``
    keep ``weight_packed`` / ``weight_scale`` as stored.

    Why: compressed-tensors 0.19 dequantizes to bf16 whatever ``from_pretrained``'s dtype,
    so a float32 load leaves bf16 experts in a float32 model, whose first forward fails.
    A compressed checkpoint is therefore loaded in bf16 and then cast; ``Module.to(dtype)``
    casts floating tensors only, so packed uint8 stays as stored.
    """
    import torch
    from transformers import AutoModelForCausalLM

    cfg = json.loads((Path(path) / "config.json").read_text())
    if cfg.get("model_type") == "kimi_k3":
        register_kimi_auto_classes()
    target = "auto" if dtype == "auto" else getattr(torch, dtype)
    if (cfg.get("quantization_config") or {}).get("quant_method") != "compressed-tensors":
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=target).eval()
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(path),
        dtype=torch.bfloat16,
        quantization_config=CompressedTensorsConfig(dequantize=not packed),
    ).eval()
    if target == "auto":
        target = getattr(torch, cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
    return model.to(target)


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
_PACKED_LOAD: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "reap_packed_load", default=False
)


def recipe_keeps_experts_packed(recipe) -> bool:
    """Whether ``recipe`` (anything ``oneshot`` accepts) holds only REAP modifiers and
    none of them asks for ``dequantize: model``: then nothing but REAP reads the
    weights and the model can stay packed. Unparseable recipes answer False (upstream
    reports their errors)."""
    from ..modifier import REAPPruningModifier

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
    from llmcompressor.entrypoints import utils as entry_utils
    from llmcompressor.modeling.moe.linearize import load_quantizable_moe
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from ..calibration.packed import check_checkpoint_formats

    path = str(model_args.model)
    config_file = os.path.join(path, "config.json")
    if os.path.isfile(config_file):
        with open(config_file) as f:
            check_checkpoint_formats(json.load(f))

    def keep_packed(**kwargs):
        kwargs["dequantize"] = False
        return CompressedTensorsConfig(**kwargs)

    drop_broken_lazy_aliases(resolve=True)
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


def patch_oneshot_packed_load() -> None:
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
