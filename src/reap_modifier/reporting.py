"""What every written report shares (the analysis reports, ``reap eval``'s, the main job's):
values made JSON-safe, and figures written as PNG files atomically."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from .fileio import atomic_path

__all__ = ["jsonable", "save_png"]


def jsonable(obj):
    """Recursively convert numpy scalars/arrays and non-finite floats (-> None) for JSON."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        x = float(obj)
        return x if math.isfinite(x) else None
    return obj


def save_png(fig, path: str | os.PathLike) -> Path:
    """Write ``fig`` to ``path`` (atomically, parent folders created) at the reports'
    resolution, close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110, format=path.suffix.lstrip(".") or "png")
    finally:
        plt.close(fig)
    return path
