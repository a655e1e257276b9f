"""The captured rows a rank fits on: each MoE layer's block inputs and the unpruned block's
outputs, for the layers it owns (:func:`~.ranks.owner`), held in memory or, with
``fit_spill_dir``, on disk and read back one layer at a time (every stage reads one layer,
fits it, and lets it go). :meth:`RowStore.close` removes the files, when the step ends or
fails.

Memory: without a spill folder, ``2 x router_fit_tokens x hidden x dtype bytes`` per owned
layer (Kimi K3, 4,096 tokens in bf16: 112 MiB a layer); with one, a layer's rows at a time,
and the same on disk. The rows are exactly what the block computed, in the model's compute
dtype: a float32 computation of a bf16 checkpoint computes float32 values that bf16 does not
hold, and the fits run the block on them (narrower rows would change every fit).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

__all__ = ["RowStore"]


class RowStore:
    """Captured ``(inputs, outputs)`` rows by layer name.

    :param spill_dir: a folder of this rank's (``None``: hold the rows in memory)
    """

    def __init__(self, spill_dir: str | Path | None = None):
        self.dir = Path(spill_dir) / "rows" if spill_dir is not None else None
        self._memory: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._files: dict[str, Path] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._memory or name in self._files

    def put(self, name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.dir is None:
            self._memory[name] = (x, y)
            return
        from safetensors.torch import save_file

        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{len(self._files):05d}.safetensors"
        save_file({"x": x.contiguous(), "y": y.contiguous()}, str(path))
        self._files[name] = path

    def rows(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``name``'s rows (read from disk when spilled; the file stays until
        :meth:`close`)."""
        if name in self._memory:
            return self._memory[name]
        from safetensors.torch import load_file

        loaded = load_file(str(self._files[name]))
        return loaded["x"], loaded["y"]

    def close(self) -> None:
        """Release the rows and remove the spilled files."""
        self._memory.clear()
        self._files.clear()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
