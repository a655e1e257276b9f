"""Deciding what to keep: the scores file (per-expert statistics), calibration-free
baselines, the keep-count rule, the pruning plan, and how far two score sets differ.

``from reap_modifier.scores import ExpertScores`` is the scores file's public name. The
names are imported on first use (PEP 562): the format's names and errors need no torch.
"""

from __future__ import annotations

from ..lazy_names import lazy_names
from . import names

#: public name -> the module that defines it, imported on first use
_LAZY = {
    **dict.fromkeys(names.__all__, "names"),
    "ExpertScores": "scores_file",
    "ScoresError": "errors",
    "saliency_from_stats": "scores_file",
    "scores_difference": "difference",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_names(__name__, _LAZY, __all__)
