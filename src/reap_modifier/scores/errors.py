"""The error of a keep count or a plan, beside the plan (:mod:`.plan`) and the keep-count
rule (:mod:`.keep_count`), which both raise it and re-export it."""

from __future__ import annotations

__all__ = ["PlanError"]


class PlanError(ValueError):
    """The requested keep count or plan is invalid for this model."""
