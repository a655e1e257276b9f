"""The post-cut step's own resume (with ``checkpoint_dir``): each layer's result of each
stage (the selection's kept experts and record, a component's fitted tensors and record)
is written as it finishes, and a rerun takes it from there instead of computing it again.

What a rerun needs besides: the captured rows, which the capture spills under
``checkpoint_dir`` and keeps (the resumed calibration skips the layers that recorded them),
and the calibration checkpoint's identity, which includes every post-cut setting and the
keep count, so that a rerun with other settings is refused instead of reusing results that
are not its own. The decisions (the selection end to end, each component kept or dropped)
are measured again: they are a few forwards on the held-out samples.

Disk, per rank: the captured rows of its calibration (``2 x router_fit_tokens x hidden x
dtype bytes`` per MoE layer) and the fitted tensors of the layers it owns. The files stay
after a successful run, like the calibration's: delete ``checkpoint_dir`` when done.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ..fileio import atomic_path
from ..pause_points import pause_point

__all__ = ["StageLog"]


class StageLog:
    """Per-layer stage results on disk (``folder=None``: nothing is kept or read)."""

    def __init__(self, folder: str | Path | None):
        self.dir = Path(folder) / "stages" if folder is not None else None

    def _path(self, stage: str, layer: str) -> Path:
        return self.dir / stage / f"{layer}.pt"

    def load(self, stage: str, layer: str):
        """``layer``'s result of ``stage`` from an earlier run, or ``None``."""
        if self.dir is None:
            return None
        path = self._path(stage, layer)
        return torch.load(path, weights_only=False) if path.is_file() else None

    def clear(self) -> None:
        """Forget every result (a fresh calibration: nothing earlier is this run's)."""
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)

    def save(self, stage: str, layer: str, index: int, result) -> None:
        """Keep ``layer``'s (the ``index``-th MoE layer's) result of ``stage``."""
        if self.dir is None:
            return
        with atomic_path(self._path(stage, layer)) as tmp:
            torch.save(result, tmp)
        pause_point(f"post-cut-{stage}", index + 1)
