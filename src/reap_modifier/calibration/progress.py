"""Per-layer progress of a sequential calibration: tokens/s and an ETA, in the log and as
one machine-parseable line per layer on stderr (rank 0 only)::

    REAP-PROGRESS layer=5/92 resumed=0 tokens=1048576 seconds=41.2 tok_s=25451 elapsed_s=206 eta_s=3585

``layer``: layers (sequential subgraphs) complete / traced; ``resumed``: layers an earlier
run completed (restored from ``checkpoint_dir``, not run again); ``tokens``: calibration
tokens every layer processes, over all data-parallel ranks (padding excluded);
``seconds``: this layer's wall time (its calibration pass and the previous layer's
propagation); ``tok_s``: ``tokens / seconds``; ``elapsed_s``: since calibration started
in this run; ``eta_s``: remaining layers x the mean seconds per layer run so far.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from loguru import logger

from .. import registries
from .checkpointing import CalibrationCheckpoint
from .distributed import is_distributed, is_source_process

__all__ = ["LayerProgress", "progress_line"]


def progress_line(
    layer: int, total: int, resumed: int, tokens: int, seconds: float, elapsed: float, eta: float
) -> str:
    """The ``REAP-PROGRESS`` line (documented in this module)."""
    tok_s = tokens / seconds if seconds > 0 else 0.0
    return (
        f"REAP-PROGRESS layer={layer}/{total} resumed={resumed} tokens={tokens} "
        f"seconds={seconds:.3f} tok_s={tok_s:.0f} elapsed_s={elapsed:.0f} eta_s={eta:.0f}"
    )


class LayerProgress:
    """Counts sequential epochs and reports each one that ran.

    :param group: the gloo group of the data-parallel ranks (tokens are summed once)
    :param checkpoint: the run's resumable calibration, if any (its skipped layers are
        not reported)
    """

    def __init__(self, group=None, checkpoint: CalibrationCheckpoint | None = None):
        self._group = group
        self._checkpoint = checkpoint
        self.total: int | None = None
        self._done = 0
        self._local_tokens = 0
        self._tokens: int | None = None
        self._start: float | None = None
        self._last: float | None = None
        self._seconds: list[float] = []
        registries.add_calibration_batch_listener(self._on_batches)

    def close(self) -> None:
        registries.remove_calibration_batch_listener(self._on_batches)

    def _on_batches(self, batches: list[dict]) -> None:
        total = 0
        for batch in batches:
            mask, ids = batch.get("attention_mask"), batch.get("input_ids")
            if isinstance(mask, torch.Tensor):
                total += int(mask.sum())
            elif isinstance(ids, torch.Tensor):
                total += ids.numel()
        self._local_tokens = total
        self._start = self._last = time.monotonic()

    def layer_done(self) -> None:
        """A sequential epoch ended (every rank calls it: the first sums the tokens)."""
        now = time.monotonic()
        if self._start is None:
            self._start = self._last = now
        self._done += 1
        seconds, self._last = now - self._last, now
        resumed = self._checkpoint.resumed if self._checkpoint is not None else 0
        if self._done <= resumed or self.total is None:
            return  # restored from the checkpoint, or not the sequential pipeline
        if self._tokens is None:
            self._tokens = self._global_tokens()
        self._seconds.append(seconds)
        eta = (self.total - self._done) * sum(self._seconds) / len(self._seconds)
        elapsed = now - self._start
        if not is_source_process():
            return
        tok_s = self._tokens / seconds if seconds > 0 else 0.0
        logger.info(
            f"REAP: layer {self._done}/{self.total} calibrated in {seconds:.1f} s "
            f"({tok_s:,.0f} tokens/s); about {eta:.0f} s left"
        )
        line = progress_line(self._done, self.total, resumed, self._tokens, seconds, elapsed, eta)
        print(line, file=sys.stderr, flush=True)

    def _global_tokens(self) -> int:
        if not is_distributed():
            return self._local_tokens
        t = torch.tensor([self._local_tokens], dtype=torch.int64)
        dist.all_reduce(t, group=self._group)
        return int(t)
