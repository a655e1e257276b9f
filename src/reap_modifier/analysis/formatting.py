"""Formatting shared by the analysis reports and the main job: percentages and token
counts (values made JSON-safe: :func:`reap_modifier.reporting.jsonable`)."""

from __future__ import annotations

__all__ = ["pct", "tokens"]


def pct(x: float | None, d: int = 1) -> str:
    """``0.1234 -> '12.3%'``; ``None -> 'n/a'``."""
    return "n/a" if x is None else f"{100 * x:.{d}f}%"


def tokens(n: int) -> str:
    """A token count: ``'1.23 M'`` from 100k up, else with thousands separators."""
    return f"{n / 1e6:.2f} M" if abs(n) >= 100_000 else f"{n:,}"
