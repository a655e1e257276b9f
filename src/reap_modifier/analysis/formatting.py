"""Formatting shared by the analysis reports and the main job: percentages, token
counts, and values made JSON-safe."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["jsonable", "pct", "tokens"]


def pct(x: float | None, d: int = 1) -> str:
    """``0.1234 -> '12.3%'``; ``None -> 'n/a'``."""
    return "n/a" if x is None else f"{100 * x:.{d}f}%"


def tokens(n: int) -> str:
    """A token count: ``'1.23 M'`` from 100k up, else with thousands separators."""
    return f"{n / 1e6:.2f} M" if abs(n) >= 100_000 else f"{n:,}"


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
