"""Resumable calibration: each layer's statistics and the next layer's inputs on disk.

The sequential pipeline calibrates one subgraph (decoder layer) at a time. When subgraph
``k`` is about to start, the first ``k`` are complete: every rank writes its float64
sums of the MoE layers observed so far and the pipeline's activations cache (the inputs
of subgraph ``k``, all that the later subgraphs need) to ``rank{r}-layer{k}.pt``; then
rank 0 commits ``state.json`` (``done: k``) and every rank removes its previous file.
After the last subgraph only the statistics are written (``done: N``). Files are written
to a temp name and renamed (:func:`~reap_modifier.fileio.atomic_path`), and only
``state.json`` says which files count, so a run killed at any point leaves the last
committed layer intact.

A rerun with the same model, recipe, data and world size reads ``state.json``, restores
the sums, puts the saved activations into the cache and lets the first ``k`` subgraphs
do nothing: it resumes after layer ``k`` with no forward of the earlier layers. Anything
else is refused before any forward, naming what differs.

The data is matched batch by batch, by content: ``state.json`` records a sha256 per batch
(:func:`batch_digest`), per rank, in the order the first run calibrated, and the rank
files hold those batches' ``input_ids`` / ``attention_mask``. A rerun whose data loader
yields the same batches in another order (``oneshot`` shuffles with torch's global
generator, which most scripts never seed) resumes in the recorded order: the saved
activations are in it, and the batches handed to the calibration-batch listeners (the
observer's padding, the progress count) are the recorded ones, so the sums are added in
the uninterrupted run's order, bit for bit. Under data parallel the batches are matched
over all ranks together (a shuffled draw split across ranks may deal a batch to another
rank on the rerun); each rank replays its own recorded batches from its file.

Disk: one boundary of activations per rank (two while a new one is written): calibration
tokens x hidden size x bytes per element, plus whatever else the pipeline caches
(position embeddings, masks) and the batches' token ids and masks (two int64 per token).
Statistics are small (MoE layers x experts x 6 x 8 bytes).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from loguru import logger

from ..fileio import atomic_path, write_json_atomic
from ..models import MoEArchitecture
from ..pause_points import pause_point
from .accumulator import LayerAccumulator
from .distributed import is_distributed, world_size

__all__ = [
    "CalibrationCheckpoint",
    "CheckpointMismatch",
    "batch_digest",
    "calibration_identity",
    "unmatched_batches",
]

FORMAT = 2  # 2: per-batch digests, and the batches in the rank files
STATE = "state.json"


class CheckpointMismatch(ValueError):
    """``checkpoint_dir`` holds the calibration of another model, recipe, data or
    world size."""


def calibration_identity(
    model: torch.nn.Module, arch: MoEArchitecture, fingerprint: str, recipe: dict, world: int
) -> dict:
    """What a checkpoint must share with the run that resumes it: the model (router
    fingerprint, config), the recipe fields that change statistics, the world size."""
    config = getattr(model, "config", None)
    items = config.to_dict() if config is not None else {}
    items = {k: v for k, v in items.items() if k not in ("_name_or_path", "transformers_version")}
    text = json.dumps(items, sort_keys=True, default=str)
    return {
        "model": {
            "model_fingerprint": fingerprint,
            "config_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "model_class": arch.model_class,
        },
        "recipe": dict(recipe, moe_layers=len(arch.layers), num_experts=arch.num_experts),
        "world_size": world,
    }


def batch_digest(batch: dict) -> str:
    """sha256 of one calibration batch's token ids and attention mask (with their shapes):
    the batch's identity wherever the data loader puts it."""
    h = hashlib.sha256()
    for key in ("input_ids", "attention_mask"):
        value = batch.get(key)
        if isinstance(value, torch.Tensor):
            t = value.detach().to("cpu", torch.int64).contiguous()
            h.update(f"{key}{tuple(t.shape)}".encode())
            h.update(t.numpy().tobytes())
    return h.hexdigest()


def unmatched_batches(
    recorded: list[list[str]], current: list[list[str]]
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The batches that differ between a checkpoint and this run, matched by content over
    all ranks, whatever their order and rank (a batch that occurs n times must occur n
    times in both).

    :param recorded: per rank, the checkpoint's batch digests in the order calibrated
    :param current: per rank, this run's batch digests in its data loader's order
    :returns: ``(new, missing)``: ``(rank, index)`` of this run's batches the checkpoint
        does not hold, and of the checkpoint's batches this run lacks
    """
    pool = Counter(d for digests in recorded for d in digests)
    new = []
    for rank, digests in enumerate(current):
        for index, digest in enumerate(digests):
            if pool[digest] > 0:
                pool[digest] -= 1
            else:
                new.append((rank, index))
    missing = []
    for rank, digests in enumerate(recorded):
        for index, digest in enumerate(digests):
            if pool[digest] > 0:
                pool[digest] -= 1
                missing.append((rank, index))
    return new, missing


def _where(batches: list[tuple[int, int]], ranks: int, order: str) -> str:
    """``rank 0's batch 3, ..., numbered in <order>`` (``batch 3`` for one process), the
    first four; ``none`` for no batch."""
    if not batches:
        return "none"
    named = [f"rank {r}'s batch {i}" if ranks > 1 else f"batch {i}" for r, i in batches[:4]]
    more = f" and {len(batches) - 4} more" if len(batches) > 4 else ""
    return f"{', '.join(named)}{more}, numbered in {order}"


def _differences(theirs, ours, prefix: str = "") -> list[str]:
    if isinstance(theirs, dict) and isinstance(ours, dict):
        found = []
        for key in sorted(set(theirs) | set(ours)):
            found += _differences(theirs.get(key), ours.get(key), f"{prefix}{key}.")
        return found
    if theirs != ours:
        label = prefix.rstrip(".")
        return [f"{label + ' ' if label else ''}{theirs!r} there, {ours!r} now"]
    return []


class CalibrationCheckpoint:
    """One run's resumable calibration in ``directory`` (the registry's
    ``SequentialCheckpoint``).

    :param directory: ``checkpoint_dir``
    :param identity: :func:`calibration_identity` of this run
    :param accumulators: the observer's, by MoE layer name (restored in place)
    :param group: the gloo group of the data-parallel ranks (``None`` alone)
    :raises CheckpointMismatch: ``directory`` holds another model's, recipe's or world
        size's calibration
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        identity: dict,
        accumulators: dict[str, LayerAccumulator],
        group=None,
    ):
        self.dir = Path(directory)
        self.identity = identity
        self._accs = accumulators
        self._group = group
        self.rank = dist.get_rank() if is_distributed() else 0
        self.world = world_size()
        self._state = self._read_state()
        if self._state is not None:
            for what in ("model", "recipe", "world_size"):
                self._check(what, self._state["identity"].get(what), identity[what])
        self.count: int | None = None  # subgraphs the pipeline traced
        #: subgraphs an earlier run completed (this run skips them)
        self.resumed = 0
        self._committed = 0
        self._cache = None
        #: per rank, the batch digests in the order calibrated (``state.json``'s ``batches``)
        self._digests: list[list[str]] | None = None
        #: this rank's batches (``input_ids`` / ``attention_mask``) in the order calibrated
        self._batches: list[dict] = []
        #: called once the pipeline's cache is restored, with the MoE layers whose
        #: statistics came from disk (empty on a fresh start): e.g. the post-cut capture
        #: taking those layers' rows from the files an earlier run spilled
        self.on_restore: list = []

    # -- checks -------------------------------------------------------------------------

    def _read_state(self) -> dict | None:
        path = self.dir / STATE
        if not path.is_file():
            return None
        state = json.loads(path.read_text())
        if state.get("format") != FORMAT:
            raise CheckpointMismatch(
                f"checkpoint_dir {self.dir} was written in format {state.get('format')!r}, "
                f"this version reads {FORMAT}: {self._remedy()}"
            )
        return state

    def _remedy(self) -> str:
        return f"pass another checkpoint_dir, or delete {self.dir} to start over"

    def _check_batches(self, recorded: list[list[str]], current: list[list[str]]) -> None:
        """Refuse data that is not the recorded batches (in any order, on any rank)."""
        new, missing = unmatched_batches(recorded, current)
        if not new and not missing:
            return
        now, then = sum(map(len, current)), sum(map(len, recorded))
        ours = _where(new, len(current), "this run's order")
        theirs = _where(missing, len(current), "the order calibrated")
        raise CheckpointMismatch(
            f"checkpoint_dir {self.dir} holds a calibration on other data: {len(new)} of "
            f"this run's {now} calibration batches are not among the {then} it calibrated "
            f"({ours}) and {len(missing)} of those are missing from this run ({theirs}). "
            "Batches are matched by token ids and attention mask in any order, "
            "so a shuffled rerun resumes when it draws the same samples into the same "
            "batches; it does not when num_calibration_samples is below the dataset's size "
            "or batch_size is above 1 (there seed torch with the same torch.manual_seed "
            f"before oneshot, or set shuffle_calibration_samples=False): {self._remedy()}"
        )

    def _check(self, what: str, theirs, ours) -> None:
        found = _differences(theirs, ours)
        if found:
            label = {
                "world_size": "world size",
                "subgraphs": "sequential trace (subgraph count; were sequential_targets changed?)",
            }.get(what, what)
            raise CheckpointMismatch(
                f"checkpoint_dir {self.dir} holds a calibration with another {label} "
                f"({'; '.join(found[:3])}): {self._remedy()}"
            )

    # -- the pipeline's calls (registries.SequentialCheckpoint) --------------------------

    def traced(self, count: int) -> None:
        self.count = count
        if self._state is not None:
            self._check("subgraphs", self._state["subgraphs"], count)

    def restore(self, cache, batches: list[dict]) -> list[dict]:
        self._cache = cache
        digests = [batch_digest(b) for b in batches]
        if is_distributed():
            current: list = [None] * self.world
            dist.all_gather_object(current, digests, group=self._group)
        else:
            current = [digests]
        if self._state is None:
            self._digests, self._batches = current, batches
            self._remove_leftovers(keep=None)
            for listener in self.on_restore:
                listener(set())
            return batches
        recorded = self._state["batches"]
        self._check_batches(recorded, current)  # the same on every rank
        self._remove_leftovers(keep=self._state["done"])
        done = int(self._state["done"])
        path = self._rank_file(done)
        if not path.is_file():
            raise CheckpointMismatch(
                f"checkpoint_dir {self.dir} lacks {path.name} (rank {self.rank}): every rank "
                f"must see the same checkpoint_dir (a shared filesystem); {self._remedy()}"
            )
        saved = torch.load(path, weights_only=False)  # written by this module
        restored = self._restore_accumulators(saved["accumulators"])
        for listener in self.on_restore:
            listener(set(saved["accumulators"]))
        if saved["intermediates"] is not None:
            cache.batch_intermediates = saved["intermediates"]
        # the recorded order: the saved activations' (and every listener's, through compat)
        self._digests, self._batches = recorded, saved["batches"]
        self.resumed = self._committed = done
        if self.rank == 0:
            tokens = self._state.get("tokens", 0)
            order = (
                "; this run's data loader gave the same batches in another order, so they "
                "are calibrated in the recorded one"
                if current != recorded
                else ""
            )
            logger.info(
                f"REAP: resuming after layer {done} of {self.count} from {self.dir} "
                f"({done} layers skipped: no forward or observation runs for them; "
                f"{restored} MoE layers' statistics restored, {tokens} tokens per layer on "
                f"rank 0{order})"
            )
        return self._batches

    def skips(self, index: int) -> bool:
        return index < self.resumed

    def starting(self, index: int) -> None:
        if index > self._committed:
            self._save(index, intermediates=True)
            pause_point("between-layers", index)

    def forwarded(self, index: int, calls: int) -> None:
        if calls == 1:
            pause_point("layer-calibrating", index + 1)

    # -- the modifier's call --------------------------------------------------------------

    def complete(self) -> None:
        """Calibration ended: commit the last layer's statistics (no activations)."""
        if self.count is None:
            logger.warning(
                f"REAP: checkpoint_dir {self.dir}: this pipeline calibrated the whole model "
                'in one pass, so there is nothing to resume; use pipeline="sequential"'
            )
            return
        if self._committed < self.count:
            self._save(self.count, intermediates=False)

    # -- files ------------------------------------------------------------------------

    def _rank_file(self, done: int) -> Path:
        return self.dir / f"rank{self.rank}-layer{done}.pt"

    def _remove_leftovers(self, keep: int | None) -> None:
        """This rank's files of uncommitted or superseded layers (a killed run's)."""
        if not self.dir.is_dir():
            return
        keep_name = self._rank_file(keep).name if keep is not None else None
        mine = (f"rank{self.rank}-layer",) + ((f".{STATE}.",) if self.rank == 0 else ())
        for path in self.dir.iterdir():  # the files, and temp files (".<name>.<random>.tmp")
            name = path.name
            if name.lstrip(".").startswith(mine) or name.startswith(mine):
                if name != keep_name:
                    path.unlink(missing_ok=True)

    def _save(self, done: int, intermediates: bool) -> None:
        start = time.monotonic()
        self.dir.mkdir(parents=True, exist_ok=True)
        payload = {
            "format": FORMAT,
            "done": done,
            "accumulators": self._export_accumulators(),
            "intermediates": self._cache.batch_intermediates if intermediates else None,
            "batches": self._batches,
        }
        path = self._rank_file(done)
        with atomic_path(path) as tmp:
            torch.save(payload, tmp)
        size = path.stat().st_size
        pause_point("layer-saving", done)
        self._barrier()  # every rank's file is whole before the commit
        if self.rank == 0:
            state = {
                "format": FORMAT,
                "identity": self.identity,
                "batches": self._digests,
                "subgraphs": self.count,
                "done": done,
                "tokens": max((a.tokens for a in self._accs.values()), default=0),
            }
            write_json_atomic(self.dir / STATE, state)
        self._barrier()  # committed: the previous files are superseded
        self._remove_leftovers(keep=done)
        self._committed = done
        if self.rank == 0:
            logger.info(
                f"REAP: checkpoint: layer {done} of {self.count} saved to {self.dir} "
                f"({size / 1e6:.3g} MB on rank 0, {time.monotonic() - start:.1f} s)"
            )

    def _barrier(self) -> None:
        if is_distributed():
            dist.barrier(group=self._group)

    def _export_accumulators(self) -> dict:
        return {
            name: {
                "stats": {s: t.detach().to("cpu").clone() for s, t in acc.stats.items()},
                "tokens": acc.tokens,
                "positions": acc.positions,
                "samples": acc.samples,
            }
            for name, acc in self._accs.items()
            if acc.stats
        }

    def _restore_accumulators(self, saved: dict) -> int:
        for name, record in saved.items():
            acc = self._accs[name]
            acc.stats = dict(record["stats"])
            acc.device = torch.device("cpu")
            acc.tokens, acc.positions = record["tokens"], record["positions"]
            acc.samples = record["samples"]
        return len(saved)
