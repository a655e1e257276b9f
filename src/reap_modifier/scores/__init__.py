"""Deciding what to keep: the scores file (per-expert statistics), calibration-free
baselines, the keep-count rule, the pruning plan, and how far two score sets differ.

``from reap_modifier.scores import ExpertScores`` is the scores file's public name.
"""

from .difference import scores_difference
from .scores_file import (
    BASELINE_METHODS,
    KIND_CALIBRATION,
    KIND_WEIGHTS,
    SALIENCY_FROM_STATS,
    SALIENCY_NAMES,
    SCORES_FORMAT,
    SCORES_VERSION,
    SOURCE_PREFIX,
    STAT_NAMES,
    ExpertScores,
    ScoresError,
    saliency_from_stats,
)

__all__ = [
    "BASELINE_METHODS",
    "KIND_CALIBRATION",
    "KIND_WEIGHTS",
    "SALIENCY_FROM_STATS",
    "SALIENCY_NAMES",
    "SCORES_FORMAT",
    "SCORES_VERSION",
    "SOURCE_PREFIX",
    "STAT_NAMES",
    "ExpertScores",
    "ScoresError",
    "saliency_from_stats",
    "scores_difference",
]
