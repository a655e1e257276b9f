"""The errors of this package: a malformed scores file (:class:`ScoresError`, re-exported
by :mod:`.scores_file`) and an invalid keep count or plan (:class:`PlanError`, re-exported by
:mod:`.plan` and :mod:`.keep_count`). No torch: the CLI catches them before any work."""

from __future__ import annotations

__all__ = ["PlanError", "ScoresError"]


class ScoresError(ValueError):
    """A scores file is malformed or incompatible with the requested operation."""


class PlanError(ValueError):
    """The requested keep count or plan is invalid for this model."""
