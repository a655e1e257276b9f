"""The sequential pipeline: the calibration batches handed to the observer (so padding
can be left out), and the traced config that keeps the attention mask."""

from __future__ import annotations

from collections.abc import Mapping

from ..registries import calibration_batch_listeners

__all__ = [
    "patch_calibration_cache",
    "patch_traced_config_attention",
    "rebuild_traced_config",
]


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
                self.batches.append({k: batch.get(k) for k in ("input_ids", "attention_mask")})
            else:
                self.batches.append({})
            yield batch


def patch_calibration_cache() -> None:
    """Why: llm-compressor 0.14.0.1's sequential pipeline never calls the model: it
    runs decoder-layer subgraphs on batches it caches with
    ``IntermediatesCache.from_dataloader``, and the 2-D attention mask reaches only the
    first subgraph (later ones get the 4-D causal mask, whose form depends on the
    attention implementation). Modifiers get ``state.current_batch_idx`` but not the
    batch (only AWQ's ``loss_mask`` is exposed, via ``use_loss_mask``), so without
    help an observer cannot tell padded positions from tokens. We hand the cached
    batches' ``input_ids`` / ``attention_mask`` to the listeners registered in
    :mod:`reap_modifier.registries`; nothing else changes.
    """
    from llmcompressor.pipelines.cache import IntermediatesCache

    original = IntermediatesCache.from_dataloader.__func__
    if getattr(original, "_reap_patched", False):
        return

    def from_dataloader(cls, dataloader, *args, **kwargs):
        listeners = calibration_batch_listeners()
        if not listeners:
            return original(cls, dataloader, *args, **kwargs)
        recording = _RecordingLoader(dataloader)
        cache = original(cls, recording, *args, **kwargs)
        for listener in listeners:
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


def patch_traced_config_attention() -> None:
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
    from llmcompressor.pipelines.sequential.helpers import SequentialTracer
    from transformers.configuration_utils import PretrainedConfig

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
