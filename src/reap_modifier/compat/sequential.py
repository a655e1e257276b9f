"""The sequential pipeline: the calibration batches handed to the observer (so padding
can be left out), the traced config that keeps the attention mask, and a calibration
that resumes after the last completed subgraph."""

from __future__ import annotations

from collections.abc import Mapping

from ..registries import (
    calibration_batch_listeners,
    sequential_checkpoint,
    traced_subgraphs_listeners,
)

__all__ = [
    "patch_calibration_cache",
    "patch_traced_config_attention",
    "rebuild_traced_config",
]


#: the checkpoint of the pipeline run between its trace and its cache (at most one)
_ACTIVE: list = []


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
    """Why: modifiers get ``state.current_batch_idx`` but not the batch in llm-compressor
    0.14.0.1's sequential pipeline, so an observer cannot tell padding from tokens (details:
    ``docs/upstream-gaps.md``). The batches ``IntermediatesCache.from_dataloader`` caches are
    handed, ``input_ids`` / ``attention_mask`` only, to the registered sequential checkpoint,
    which may replace the cache's contents with a resumed run's saved activations and
    returns the batches in the order the cache then holds them (a resumed run's recorded
    order, whatever order the data loader gave), and then to the listeners registered in
    :mod:`reap_modifier.registries`, so that ``state.current_batch_idx`` indexes the same
    batch for both; nothing else changes.
    """
    from llmcompressor.pipelines.cache import IntermediatesCache

    original = IntermediatesCache.from_dataloader.__func__
    if getattr(original, "_reap_patched", False):
        return

    def from_dataloader(cls, dataloader, *args, **kwargs):
        listeners = calibration_batch_listeners()
        checkpoint = _ACTIVE.pop() if _ACTIVE else None  # this pipeline run's
        if not listeners and checkpoint is None:
            return original(cls, dataloader, *args, **kwargs)
        recording = _RecordingLoader(dataloader)
        cache = original(cls, recording, *args, **kwargs)
        batches = recording.batches
        if checkpoint is not None:
            batches = checkpoint.restore(cache, batches)
        for listener in listeners:
            listener(batches)
        return cache

    from_dataloader._reap_patched = True
    IntermediatesCache.from_dataloader = classmethod(from_dataloader)


def patch_traced_subgraphs() -> None:
    """Why: llm-compressor 0.14.0.1's sequential pipeline only warns ("Expected N
    subgraphs, but only traced 1") when a model's forward calls its sequential targets
    from code the tracer wraps (Qwen3-Omni's thinker), and then runs calibration with
    those blocks outside every subgraph, so a modifier finds out only after calibration
    that it saw nothing; and a model it cannot trace at all (MiniMax-M3-VL) fails with
    the tracer's generated code as the message. The traced subgraphs (or the error) (the modules each one runs) are handed to
    the listeners in :mod:`reap_modifier.registries` before the first calibration batch.

    Why (resume): the pipeline keeps its progress only in memory, so a crash at layer 80
    of 92 loses every layer. When a sequential checkpoint is registered, each subgraph
    is wrapped in a :class:`ResumableSubgraph`; otherwise nothing else changes.
    """
    from llmcompressor.pipelines.sequential import pipeline

    original = pipeline.trace_subgraphs
    if getattr(original, "_reap_patched", False):
        return

    def trace_subgraphs(model, *args, **kwargs):
        listeners = traced_subgraphs_listeners()
        try:
            subgraphs = original(model, *args, **kwargs)
        except Exception as exc:  # a listener may raise a clearer error first
            for listener in listeners:
                listener(model, None, exc)
            raise
        if listeners:
            modules = [{id(m) for m in subgraph.submodules(model)} for subgraph in subgraphs]
            for listener in listeners:
                listener(model, modules, None)
        checkpoint = sequential_checkpoint(model)
        _ACTIVE[:] = [checkpoint] if checkpoint is not None else []
        if checkpoint is not None:
            checkpoint.traced(len(subgraphs))
            subgraphs = [
                ResumableSubgraph(subgraph, index, checkpoint)
                for index, subgraph in enumerate(subgraphs)
            ]
        return subgraphs

    trace_subgraphs._reap_patched = True
    pipeline.trace_subgraphs = trace_subgraphs


class ResumableSubgraph:
    """A traced subgraph that tells the registered checkpoint when it starts and after
    each forward, and does nothing (no inputs, no outputs, nothing consumed) when the
    checkpoint says an earlier run completed it. Everything else is the subgraph's."""

    def __init__(self, subgraph, index: int, checkpoint):
        self._subgraph = subgraph
        self._index = index
        self._checkpoint = checkpoint
        self._calls = 0

    def __getattr__(self, name: str):
        return getattr(self._subgraph, name)

    @property
    def input_names(self):
        return set() if self._checkpoint.skips(self._index) else self._subgraph.input_names

    @property
    def consumed_names(self):
        return set() if self._checkpoint.skips(self._index) else self._subgraph.consumed_names

    def forward(self, *args, **kwargs):
        if self._checkpoint.skips(self._index):
            return {}
        if self._calls == 0:
            self._checkpoint.starting(self._index)
        outputs = self._subgraph.forward(*args, **kwargs)
        self._calls += 1
        self._checkpoint.forwarded(self._index, self._calls)
        return outputs

    def submodules(self, *args, **kwargs):
        return self._subgraph.submodules(*args, **kwargs)


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
    """Why: ``SequentialTracer.create_arg`` rebuilds the config without
    ``_attn_implementation``, so decoder layers traced by llm-compressor 0.14.0.1 run with no
    attention mask, and writes a packed model's ``QuantizationStatus`` as invalid Python
    (details: ``docs/upstream-gaps.md``). The config is rebuilt with the traced model's
    ``_attn_implementation`` (eager, forced by ``calibration_forward_context`` while tracing),
    so the mask is created as in the model's own forward; enums are passed as their values.
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
