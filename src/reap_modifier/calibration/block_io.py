"""What the post-cut fits fit to: each MoE block's inputs and outputs, before the cut,
and the held-out calibration batches they are validated on.

:class:`BlockIOCapture` registers one forward hook per MoE block (through the owning
modifier's ``register_hook``, so the sequential pipeline's ``disable_hooks`` applies:
in llm-compressor's sequential pipeline a decoder layer runs once per batch with hooks
on, the calibration pass, and once with hooks off, the propagation pass, so each batch
is recorded once and a block's n-th recorded call is batch n) and keeps, per block, the
first ``max_tokens`` non-padding rows of its input ``[N, H]`` and of its output, copied
to CPU in the model's dtype. Memory: ``2 x max_tokens x hidden x dtype bytes`` per MoE
layer (Kimi K3, 4,096 tokens in bf16: 117 MB a layer, 10.8 GB for 92 layers); with
``spill_dir`` the rows go to disk as they are recorded and are read back one layer at a
time (the fit then holds one layer's rows).

With ``holdout_every = k`` every k-th calibration batch (index ``k-1``, ``2k-1``, ...) is
held out: its rows are never recorded, and its model inputs (``input_ids``,
``attention_mask``) are kept so that :mod:`reap_modifier.post_cut` can judge each fitted
component end to end on text no fit has seen. The inputs come from the model's own call
(basic pipeline) or the sequential pipeline's batch cache (:mod:`reap_modifier.registries`).

Padding rows are told apart as the saliency observer does: by the attention mask of
the model call, or of the pipeline's cached batch
(:class:`~reap_modifier.calibration.tokens.BatchTokenTracker`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from .. import registries
from ..models import MoEArchitecture
from .tokens import BatchTokenTracker, call_arguments

__all__ = ["BlockIOCapture"]

_MODEL_INPUTS = ("input_ids", "attention_mask")


class BlockIOCapture:
    """Records, per MoE block, the first ``max_tokens`` (input, output) rows it computes.

    :param arch: the located MoE architecture (unpruned)
    :param register_hook: ``HooksMixin.register_hook`` of the owning modifier
    :param max_tokens: rows kept per block
    :param model: the top module, whose calls carry the attention mask
    :param holdout_every: hold out every k-th calibration batch (``None``: none)
    :param spill_dir: write the rows there as they are recorded instead of holding them
    """

    def __init__(
        self,
        arch: MoEArchitecture,
        register_hook: Callable[..., Any],
        max_tokens: int,
        model: torch.nn.Module | None = None,
        holdout_every: int | None = None,
        spill_dir: str | Path | None = None,
    ):
        self.arch = arch
        self.max_tokens = int(max_tokens)
        self.holdout_every = holdout_every
        self.spill_dir = Path(spill_dir) if spill_dir is not None else None
        self._register = register_hook
        self._model = model
        self._inputs: dict[str, list] = {n: [] for n in arch.layer_names}
        self._outputs: dict[str, list] = {n: [] for n in arch.layer_names}
        self._count: dict[str, int] = dict.fromkeys(arch.layer_names, 0)
        self._calls: dict[str, int] = dict.fromkeys(arch.layer_names, 0)
        self._model_calls = 0
        self._held: dict[int, dict[str, torch.Tensor]] = {}
        self._batches = BatchTokenTracker()

    def attach(self) -> None:
        self._batches.attach(self._model, self._register)
        registries.add_calibration_batch_listener(self._on_cached_batches)
        if self._model is not None and self.holdout_every:
            self._attach_model(self._model)
        for layer in self.arch.layers:
            self._register(layer.block, partial(self._record, layer.name), "forward")

    def detach(self) -> None:
        """Stop listening to the pipeline (hooks are removed by their owner)."""
        self._batches.detach()
        registries.remove_calibration_batch_listener(self._on_cached_batches)

    def tokens(self, name: str) -> int:
        return self._count[name]

    def held_out(self, index: int) -> bool:
        """Whether calibration batch ``index`` is held out from the fits."""
        k = self.holdout_every
        return bool(k) and index % k == k - 1

    def validation_batches(self) -> list[dict[str, torch.Tensor]]:
        """The held-out batches' model inputs (CPU), in batch order."""
        return [self._held[i] for i in sorted(self._held)]

    def take(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The recorded ``(inputs, outputs)`` of block ``name`` (``[N, H]`` each), released."""
        xs, ys = self._inputs.pop(name, []), self._outputs.pop(name, [])
        if not xs:
            return torch.empty(0), torch.empty(0)
        if self.spill_dir is not None:
            from safetensors.torch import load_file

            chunks = [load_file(path) for path in xs]
            for path in xs:
                Path(path).unlink()
            xs, ys = [c["x"] for c in chunks], [c["y"] for c in chunks]
        return torch.cat(xs), torch.cat(ys)

    # -- hooks ------------------------------------------------------------------------

    def _attach_model(self, model: torch.nn.Module) -> None:
        arguments = call_arguments(model)

        def pre(module, args, kwargs):
            index, self._model_calls = self._model_calls, self._model_calls + 1
            if self.held_out(index):
                self._keep_inputs(index, arguments(args, kwargs))

        self._register(model, pre, "forward_pre", with_kwargs=True)

    def _keep_inputs(self, index: int, batch: dict) -> None:
        kept = {
            k: batch[k].detach().to("cpu", copy=True)
            for k in _MODEL_INPUTS
            if isinstance(batch.get(k), torch.Tensor)
        }
        if "input_ids" in kept:
            self._held[index] = kept

    def _on_cached_batches(self, batches: list[dict]) -> None:
        for index, batch in enumerate(batches):
            if self.held_out(index):
                self._keep_inputs(index, batch)

    def _valid_rows(self, rows: int) -> torch.Tensor | None:
        tokens = self._batches.current()
        if tokens is None or tokens.valid is None or tokens.valid.numel() != rows:
            return None
        return tokens.valid

    def _record(self, name: str, module, args: tuple, output: Any) -> None:
        index, self._calls[name] = self._calls[name], self._calls[name] + 1
        room = self.max_tokens - self._count[name]
        if self.held_out(index) or room <= 0 or not args or not isinstance(args[0], torch.Tensor):
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
        self._count[name] += x.shape[0]
        if self.spill_dir is not None:
            from safetensors.torch import save_file

            folder = self.spill_dir / name
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{len(self._inputs[name]):06d}.safetensors"
            save_file({"x": x.contiguous(), "y": y.contiguous()}, str(path))
            self._inputs[name].append(path)
            self._outputs[name].append(path)
            return
        self._inputs[name].append(x)
        self._outputs[name].append(y)
