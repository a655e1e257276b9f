"""Test hook: stop a rewrite at a named point (:mod:`reap_modifier.pause_points`, shared
with resumable calibration)."""

from __future__ import annotations

from ..pause_points import POINTS, pause_point

__all__ = ["POINTS", "pause_point"]
