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

Rows are kept per calibration sample, keyed by the sample's *position*: its index in the
order one process calibrates in (``position(local index)``; under data parallel the
modifier maps each rank's samples to those positions), so that the rows of every rank,
gathered and sorted by position, are the rows one process records. With
``holdout_every = k`` every sample of every k-th batch of that order (batch ``position //
batch_size``) is held out: its rows are never recorded, and its model inputs
(``input_ids``, ``attention_mask``) are kept so that :mod:`reap_modifier.post_cut` can judge
each fitted component end to end on text no fit has seen. The inputs come from the model's
own call (basic pipeline) or the sequential pipeline's batch cache
(:mod:`reap_modifier.registries`).

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
from ..fileio import atomic_path
from ..models import MoEArchitecture
from .tokens import BatchTokenTracker, call_arguments

__all__ = ["BlockIOCapture", "join_chunks"]

_MODEL_INPUTS = ("input_ids", "attention_mask")


class BlockIOCapture:
    """Records, per MoE block, the first ``max_tokens`` (input, output) rows it computes,
    per sample, keyed by the sample's position.

    :param arch: the located MoE architecture (unpruned)
    :param register_hook: ``HooksMixin.register_hook`` of the owning modifier
    :param max_tokens: rows kept per block
    :param model: the top module, whose calls carry the attention mask
    :param holdout_every: hold out every k-th calibration batch (``None``: none)
    :param spill_dir: write the rows there as they are recorded instead of holding them
    :param position: local sample index -> position in one process's order (identity)
    :param batch_size: samples per batch of one process's order
    :param label_of: ``(input_ids [T], attention_mask [T] | None) -> group`` of a sample
        (:class:`~reap_modifier.calibration.sample_groups.SampleGroups`); every sample's
        group is then kept by position in :attr:`labels`
    """

    def __init__(
        self,
        arch: MoEArchitecture,
        register_hook: Callable[..., Any],
        max_tokens: int,
        model: torch.nn.Module | None = None,
        holdout_every: int | None = None,
        spill_dir: str | Path | None = None,
        position: Callable[[int], int] | None = None,
        batch_size: int = 1,
        label_of: Callable[..., str] | None = None,
        keep_files: bool = False,
    ):
        self.arch = arch
        self.max_tokens = int(max_tokens)
        self.holdout_every = holdout_every
        self.spill_dir = Path(spill_dir) if spill_dir is not None else None
        self.position = position or (lambda i: i)
        self.batch_size = max(int(batch_size), 1)
        self._register = register_hook
        self._model = model
        #: per block: ``(position, x, y)`` or ``(position, spilled file, rows)`` per sample
        self._chunks: dict[str, list[tuple]] = {n: [] for n in arch.layer_names}
        self._count: dict[str, int] = dict.fromkeys(arch.layer_names, 0)
        self._samples: dict[str, int] = dict.fromkeys(arch.layer_names, 0)
        self._model_samples = 0
        self._held: dict[int, dict[str, torch.Tensor]] = {}
        self._batches = BatchTokenTracker()
        self._label_of = label_of
        #: spilled files stay after they are read (a resumable run reads them again)
        self.keep_files = keep_files
        #: each calibrated sample's group by position (with ``label_of``)
        self.labels: dict[int, str] = {}
        #: with ``label_of``, every sample's model inputs by position (token ids: small), so
        #: a sample can be held out after the fact (:meth:`hold_out`)
        self._inputs: dict[int, dict[str, torch.Tensor]] = {}

    def attach(self) -> None:
        self._batches.attach(self._model, self._register)
        registries.add_calibration_batch_listener(self._on_cached_batches)
        if self._model is not None and (self.holdout_every or self._label_of is not None):
            self._attach_model(self._model)
        for layer in self.arch.layers:
            self._register(layer.block, partial(self._record, layer.name), "forward")

    def detach(self) -> None:
        """Stop listening to the pipeline (hooks are removed by their owner)."""
        self._batches.detach()
        registries.remove_calibration_batch_listener(self._on_cached_batches)

    def held_out(self, position: int) -> bool:
        """Whether the sample at ``position`` (one process's order) is held out."""
        k = self.holdout_every
        return bool(k) and (position // self.batch_size) % k == k - 1

    def hold_out(self, positions: set[int]) -> None:
        """Hold out, after calibration, the samples at ``positions`` that this capture
        calibrated (with ``label_of``): their inputs join the validation samples and their
        rows leave every block's fitting rows."""
        mine = {p for p in positions if p in self._inputs}
        for pos in mine:
            self._held[pos] = self._inputs[pos]
        for name, chunks in self._chunks.items():
            for chunk in chunks:
                if chunk[0] in mine and isinstance(chunk[1], Path):
                    chunk[1].unlink(missing_ok=True)
            self._chunks[name] = [c for c in chunks if c[0] not in mine]

    def resume(self, done: set[str]) -> None:
        """A resumed calibration (``checkpoint_dir``) skips the layers ``done``: their rows
        come back from the files an earlier run spilled (kept: ``keep_files``); every other
        layer's files are removed (a layer the earlier run did not complete records again).
        """
        if self.spill_dir is None:
            return
        for name in self.arch.layer_names:
            folder = self.spill_dir / name
            for path in folder.glob(".*.tmp") if folder.is_dir() else []:
                path.unlink()  # a file a killed run was writing
            files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
            if name not in done:
                for path in files:
                    path.unlink()
                continue
            chunks = []
            for path in files:
                pos, rows = (int(v) for v in path.stem.split("-"))
                chunks.append((pos, path, rows))
            self._chunks[name] = chunks
            self._count[name] = sum(c[2] for c in chunks)

    def validation_samples(self) -> list[tuple[int, dict[str, torch.Tensor]]]:
        """The held-out samples' ``(position, model inputs)`` (CPU, ``[1, T]``)."""
        return sorted(self._held.items(), key=lambda item: item[0])

    def chunk_rows(self, name: str) -> list[tuple[int, int]]:
        """Block ``name``'s recorded ``(position, rows)`` per sample (nothing read)."""
        return [
            (c[0], c[2] if isinstance(c[1], Path) else c[1].shape[0])
            for c in self._chunks.get(name, [])
        ]

    def chunks(self, name: str) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Block ``name``'s recorded ``(position, inputs, outputs)`` per sample, released."""
        out = []
        for chunk in self._chunks.pop(name, []):
            if isinstance(chunk[1], Path):
                from safetensors.torch import load_file

                loaded = load_file(str(chunk[1]))
                if not self.keep_files:
                    chunk[1].unlink()
                chunk = (chunk[0], loaded["x"], loaded["y"])
            out.append(chunk)
        return out

    # -- hooks ------------------------------------------------------------------------

    def _attach_model(self, model: torch.nn.Module) -> None:
        arguments = call_arguments(model)

        def pre(module, args, kwargs):
            self._model_samples = self._keep_inputs(self._model_samples, arguments(args, kwargs))

        self._register(model, pre, "forward_pre", with_kwargs=True)

    def _keep_inputs(self, first: int, batch: dict) -> int:
        """Keep the held-out samples of a batch whose first sample has local index
        ``first`` (and every sample's group); returns the next batch's first local index."""
        ids = batch.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            return first
        mask = batch.get("attention_mask")
        for j in range(ids.shape[0]):
            pos = self.position(first + j)
            if self._label_of is None and not self.held_out(pos):
                continue
            kept = {"input_ids": ids[j : j + 1].detach().to("cpu", copy=True)}
            if isinstance(mask, torch.Tensor) and mask.dim() == 2:
                kept["attention_mask"] = mask[j : j + 1].detach().to("cpu", copy=True)
            if self._label_of is not None:
                row_mask = kept["attention_mask"][0] if "attention_mask" in kept else None
                self.labels[pos] = self._label_of(kept["input_ids"][0], row_mask)
                self._inputs[pos] = kept
            if self.held_out(pos):
                self._held[pos] = kept
        return first + ids.shape[0]

    def _on_cached_batches(self, batches: list[dict]) -> None:
        first = 0
        for batch in batches:
            first = self._keep_inputs(first, batch)

    def _valid_rows(self, rows: int) -> torch.Tensor | None:
        tokens = self._batches.current()
        if tokens is None or tokens.valid is None or tokens.valid.numel() != rows:
            return None
        return tokens.valid

    def _record(self, name: str, module, args: tuple, output: Any) -> None:
        if not args or not isinstance(args[0], torch.Tensor):
            return
        hidden = args[0]
        samples = hidden.shape[0] if hidden.dim() == 3 else 1
        first, self._samples[name] = self._samples[name], self._samples[name] + samples
        if self._count[name] >= self.max_tokens:
            return
        out = output[0] if isinstance(output, tuple) else output
        x = hidden.detach().reshape(-1, hidden.shape[-1])
        y = out.detach().reshape(-1, hidden.shape[-1])
        valid = self._valid_rows(x.shape[0])
        per = x.shape[0] // samples
        for j in range(samples):
            pos = self.position(first + j)
            room = self.max_tokens - self._count[name]
            if self.held_out(pos) or room <= 0:
                continue
            rows = slice(j * per, (j + 1) * per)
            xs, ys = x[rows], y[rows]
            if valid is not None:
                keep = valid[rows].to(x.device)
                xs, ys = xs[keep], ys[keep]
            xs, ys = xs[:room].to("cpu", copy=True), ys[:room].to("cpu", copy=True)
            self._count[name] += xs.shape[0]
            self._store(name, pos, xs, ys)

    def _store(self, name: str, pos: int, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.spill_dir is None:
            self._chunks[name].append((pos, x, y))
            return
        from safetensors.torch import save_file

        folder = self.spill_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{pos:09d}-{x.shape[0]}.safetensors"
        with atomic_path(path) as tmp:
            save_file({"x": x.contiguous(), "y": y.contiguous()}, str(tmp))
        self._chunks[name].append((pos, path, x.shape[0]))


def join_chunks(chunks: list[tuple], max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, outputs)`` of ``(position, x, y)`` chunks in position order, the first
    ``max_tokens`` rows (empty tensors for no chunk)."""
    if not chunks:
        return torch.empty(0), torch.empty(0)
    chunks = sorted(chunks, key=lambda c: c[0])
    x = torch.cat([c[1] for c in chunks])[:max_tokens]
    y = torch.cat([c[2] for c in chunks])[:max_tokens]
    return x, y
