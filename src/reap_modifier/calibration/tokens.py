"""Which positions of a calibration batch are tokens and which are padding.

A batch's 2-D ``attention_mask`` (``[B, T]``, 0 = padding) flattened row-major gives
the validity of row ``b*T + t`` of the ``[B*T, H]`` hidden states a MoE block routes.

:class:`BatchTokenTracker` knows the current batch's :class:`BatchTokens` from:

- the model's own call (a forward pre-hook on the top module: the basic pipeline,
  or any ``model(input_ids, attention_mask=...)``), or
- the sequential pipeline's batch cache (llm-compressor calls decoder-layer subgraphs
  and never the model; ``compat`` hands each cached batch over through
  :mod:`reap_modifier.registries`) indexed by ``state.current_batch_idx``, the index
  llm-compressor sets before every calibration forward (as it does for AWQ's loss masks).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import registries

__all__ = ["BatchTokenTracker", "BatchTokens", "batch_tokens", "call_arguments"]


@dataclass
class BatchTokens:
    """Which positions of one calibration batch are tokens (not padding).

    :param samples: sequences in the batch
    :param positions: ``B * T`` positions the model sees
    :param valid: flat bool ``[B*T]`` (row ``b*T + t``), ``None`` when every
        position is a token
    """

    samples: int
    positions: int
    valid: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return self.positions if self.valid is None else int(self.valid.sum())


def batch_tokens(input_ids: Any = None, attention_mask: Any = None) -> BatchTokens | None:
    """:class:`BatchTokens` of a batch from its ``input_ids`` / 2-D ``attention_mask``
    (``None`` when neither tells the shape)."""
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        valid = attention_mask.detach().to("cpu") != 0
        samples, positions = valid.shape[0], valid.numel()
        return BatchTokens(samples, positions, None if bool(valid.all()) else valid.reshape(-1))
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2:
        return BatchTokens(input_ids.shape[0], input_ids.numel())
    return None


def call_arguments(model: torch.nn.Module) -> Callable[[tuple, dict], dict]:
    """``(args, kwargs) -> {name: value}`` of a call of ``model`` (positional arguments
    named by its ``forward``'s signature where it can be read)."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        signature = None

    def bind(args: tuple, kwargs: dict) -> dict:
        if args and signature is not None:
            try:
                return dict(signature.bind_partial(*args, **kwargs).arguments)
            except TypeError:
                pass
        return dict(kwargs)

    return bind


class BatchTokenTracker:
    """The current calibration batch's :class:`BatchTokens`, from the model call or
    the pipeline's cached batch.

    :param on_input_ids: called with the ``input_ids`` of every model call and of the
        first cached batch of the pipeline (``None`` when absent)
    """

    def __init__(self, on_input_ids: Callable[[Any], None] | None = None):
        self._on_input_ids = on_input_ids
        #: the current model call's tokens (``None`` outside a call)
        self.call: BatchTokens | None = None
        #: the sequential pipeline's cached batches, in batch-index order
        self.cached: list[BatchTokens | None] = []
        #: the most batches the pipeline cached at once (kept after ``detach``)
        self.pipeline_batches = 0

    def attach(self, model: torch.nn.Module | None, register_hook: Callable[..., Any]) -> None:
        """Listen to the pipeline's cached batches and, with ``model``, to its calls
        (hooks go through the owner's ``register_hook``, which removes them)."""
        self.cached = []
        registries.add_calibration_batch_listener(self._on_cached_batches)
        if model is not None:
            self._attach_model(model, register_hook)

    def detach(self) -> None:
        """Stop listening to the pipeline (hooks are removed by their owner)."""
        registries.remove_calibration_batch_listener(self._on_cached_batches)
        self.cached = []
        self.call = None

    def current(self, strict: bool = False) -> BatchTokens | None:
        """The current batch's tokens: the model call's, else the cached batch at
        ``state.current_batch_idx`` (``None`` when neither is known).

        :param strict: raise when the batch index is outside the cached batches
            (otherwise ``None``)
        """
        if self.call is not None:
            return self.call
        if not self.cached:
            return None
        from llmcompressor.core import active_session

        index = active_session().state.current_batch_idx
        if 0 <= index < len(self.cached):
            return self.cached[index]
        if strict:
            raise RuntimeError(
                f"REAP observer: calibration batch index {index} is outside the "
                f"{len(self.cached)} cached batches; cannot tell padding apart"
            )
        return None

    def _attach_model(self, model: torch.nn.Module, register_hook: Callable[..., Any]) -> None:
        arguments = call_arguments(model)

        def pre(module, args, kwargs):
            bound = arguments(args, kwargs)
            self.call = batch_tokens(bound.get("input_ids"), bound.get("attention_mask"))
            if self._on_input_ids is not None:
                self._on_input_ids(bound.get("input_ids"))

        def post(module, args, output):
            self.call = None

        register_hook(model, pre, "forward_pre", with_kwargs=True)
        register_hook(model, post, "forward")

    def _on_cached_batches(self, batches: list[dict]) -> None:
        if batches and self._on_input_ids is not None:
            self._on_input_ids(batches[0].get("input_ids"))
        self.pipeline_batches = max(self.pipeline_batches, len(batches))
        self.cached = [batch_tokens(b.get("input_ids"), b.get("attention_mask")) for b in batches]
