"""The scores file's names: its format and version, the statistics it holds, the saliency
criteria a plan can be cut by, and its kinds. No torch: the ``reap`` CLI declares its
options with them."""

from __future__ import annotations

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
]

SCORES_FORMAT = "reap-scores"
SCORES_VERSION = 1

#: statistics accumulated per expert (all float64, shape ``[num_experts]``)
#: - count: routed (token, expert) pairs; sum_weight: sum of gate weights g;
#: - sum_norm: sum of ||f||; sum_reap: sum of g * ||f||; max_norm: max of ||f||
STAT_NAMES = ("count", "sum_weight", "sum_norm", "sum_reap", "max_norm")
#: prefix of per-source routed counts (``count@en``); they add on merge
SOURCE_PREFIX = "count@"

#: saliency criteria derivable from the statistics alone
SALIENCY_FROM_STATS = (
    "reap",
    "frequency",
    "weighted_frequency",
    "ean",
    "ean_mean",
    "max_norm",
)

#: calibration-free criteria computed from router weights alone (see ``baselines``);
#: a *weights* scores file (``metadata["kind"] == "weights"``) holds one of them as
#: its single per-layer statistic, named after the method
BASELINE_METHODS = ("router_l1", "router_signed_sum", "random")

#: every saliency name accepted by ``reap cut`` / the modifier
SALIENCY_NAMES = SALIENCY_FROM_STATS + BASELINE_METHODS

#: ``metadata["kind"]`` of calibration files (the default) and of baseline files
KIND_CALIBRATION = "calibration"
KIND_WEIGHTS = "weights"
