"""What router calibration fits to: each MoE block's inputs and outputs, before the cut.

:class:`BlockIOCapture` registers one forward hook per MoE block (through the owning
modifier's ``register_hook``, so the sequential pipeline's ``disable_hooks`` applies:
in llm-compressor's sequential pipeline a decoder layer runs once per batch with hooks
on, the calibration pass, and once with hooks off, the propagation pass, so each batch
is recorded once) and keeps, per block, the first ``max_tokens`` non-padding rows of
its input ``[N, H]`` and of its output, copied to CPU in the model's dtype. Memory:
``2 x max_tokens x hidden x dtype bytes`` per MoE layer (the fit then moves one layer's
rows to the execution device at a time).

Padding rows are told apart as the saliency observer does: by the attention mask of
the model call, or of the pipeline's cached batch
(:class:`~reap_modifier.calibration.tokens.BatchTokenTracker`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ..models import MoEArchitecture
from .tokens import BatchTokenTracker

__all__ = ["BlockIOCapture"]


class BlockIOCapture:
    """Records, per MoE block, the first ``max_tokens`` (input, output) rows it computes.

    :param arch: the located MoE architecture (unpruned)
    :param register_hook: ``HooksMixin.register_hook`` of the owning modifier
    :param max_tokens: rows kept per block
    :param model: the top module, whose calls carry the attention mask
    """

    def __init__(
        self,
        arch: MoEArchitecture,
        register_hook: Callable[..., Any],
        max_tokens: int,
        model: torch.nn.Module | None = None,
    ):
        self.arch = arch
        self.max_tokens = int(max_tokens)
        self._register = register_hook
        self._model = model
        self._inputs: dict[str, list[torch.Tensor]] = {n: [] for n in arch.layer_names}
        self._outputs: dict[str, list[torch.Tensor]] = {n: [] for n in arch.layer_names}
        self._count: dict[str, int] = dict.fromkeys(arch.layer_names, 0)
        self._batches = BatchTokenTracker()

    def attach(self) -> None:
        self._batches.attach(self._model, self._register)
        for layer in self.arch.layers:
            self._register(layer.block, partial(self._record, layer.name), "forward")

    def detach(self) -> None:
        """Stop listening to the pipeline (hooks are removed by their owner)."""
        self._batches.detach()

    def tokens(self, name: str) -> int:
        return self._count[name]

    def take(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The recorded ``(inputs, outputs)`` of block ``name`` (``[N, H]`` each), released."""
        xs, ys = self._inputs.pop(name, []), self._outputs.pop(name, [])
        if not xs:
            return torch.empty(0), torch.empty(0)
        return torch.cat(xs), torch.cat(ys)

    # -- hooks ------------------------------------------------------------------------

    def _valid_rows(self, rows: int) -> torch.Tensor | None:
        tokens = self._batches.current()
        if tokens is None or tokens.valid is None or tokens.valid.numel() != rows:
            return None
        return tokens.valid

    def _record(self, name: str, module, args: tuple, output: Any) -> None:
        room = self.max_tokens - self._count[name]
        if room <= 0 or not args or not isinstance(args[0], torch.Tensor):
            return
        hidden = args[0]
        out = output[0] if isinstance(output, tuple) else output
        x = hidden.detach().reshape(-1, hidden.shape[-1])
        y = out.detach().reshape(-1, hidden.shape[-1])
        valid = self._valid_rows(x.shape[0])
        if valid is not None:
            keep = valid.to(x.device)
            x, y = x[keep], y[keep]
        x, y = x[:room].to("cpu", copy=True), y[:room].to("cpu", copy=True)
        self._inputs[name].append(x)
        self._outputs[name].append(y)
        self._count[name] += x.shape[0]
