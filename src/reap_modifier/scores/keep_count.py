"""The keep-count rule: how many experts every MoE layer keeps.

Keep-count rule (the same for the modifier, ``reap cut`` and ``reap prune``):

1. ``keep = E - round(sparsity * E)`` (round half to even is *not* used: halves
   round up the number dropped), or ``keep = num_experts_to_keep``;
2. rounded down to a multiple of ``divisible_by``;
3. for group-limited routers (``n_group > 1`` and ``topk_group < n_group``), rounded
   down to an equal count per group;
4. refused when the result is zero, below ``top_k``, or below what group-limited
   routing can reach (``topk_group * keep_per_group < top_k``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from loguru import logger

from ..models.config_keys import group_limit

__all__ = [
    "KeepCount",
    "PlanError",
    "compute_keep_count",
    "group_args",
    "keep_count_for_scores",
    "sparsity_to_keep",
]


class PlanError(ValueError):
    """The requested keep count or plan is invalid for this model."""


@dataclass(frozen=True)
class KeepCount:
    """Outcome of the keep-count rule."""

    num_experts: int
    keep: int
    requested: int
    per_group: int | None = None
    adjustments: tuple[str, ...] = ()


def _round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def sparsity_to_keep(num_experts: int, sparsity: float) -> int:
    """Step 1 of the rule for a sparsity: ``E - round_half_up(sparsity * E)``."""
    return num_experts - _round_half_up(sparsity * num_experts)


def compute_keep_count(
    num_experts: int,
    top_k: int,
    *,
    sparsity: float | None = None,
    num_experts_to_keep: int | None = None,
    divisible_by: int | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    log: bool = True,
) -> KeepCount:
    """Apply the keep-count rule; raise :class:`PlanError` saying what to change.

    :param n_group: expert groups of the router (with ``topk_group``: see
        :func:`~reap_modifier.models.config_keys.group_limit`)
    :param log: log each adjustment (callers that already logged this count pass False)
    """
    if (sparsity is None) == (num_experts_to_keep is None):
        raise PlanError("give exactly one of sparsity or num_experts_to_keep")
    if sparsity is not None:
        if not 0.0 < sparsity < 1.0:
            raise PlanError(f"sparsity must be in (0, 1), got {sparsity}")
        requested = num_experts - _round_half_up(sparsity * num_experts)
        what = f"sparsity={sparsity} of {num_experts} experts"
    else:
        requested = int(num_experts_to_keep)
        what = f"num_experts_to_keep={requested}"
        if not 0 < requested <= num_experts:
            raise PlanError(f"num_experts_to_keep must be in [1, {num_experts}], got {requested}")
    keep = requested
    notes: list[str] = []
    if divisible_by is not None:
        if divisible_by < 1:
            raise PlanError(f"divisible_by must be >= 1, got {divisible_by}")
        rounded = keep - keep % divisible_by
        if rounded != keep:
            notes.append(f"rounded {keep} down to {rounded} (divisible_by={divisible_by})")
        keep = rounded
        if keep == 0:
            raise PlanError(
                f"{what} leaves {requested} experts, which divisible_by={divisible_by} "
                "rounds down to 0; lower divisible_by or keep more experts"
            )
    per_group = None
    grouped = group_limit(n_group, topk_group) is not None
    if grouped:
        if num_experts % n_group:
            raise PlanError(f"{num_experts} experts do not split into n_group={n_group} groups")
        per_group = keep // n_group
        rounded = per_group * n_group
        if rounded != keep:
            notes.append(
                f"rounded {keep} down to {rounded} for an equal count in each of "
                f"{n_group} groups (group-limited routing)"
            )
        keep = rounded
        if divisible_by is not None and keep % divisible_by:
            # find the largest count that is a multiple of both
            step = math.lcm(divisible_by, n_group)
            keep = keep - keep % step
            per_group = keep // n_group
            notes.append(f"rounded to {keep}, a multiple of lcm(divisible_by, n_group)={step}")
    if keep <= 0:
        raise PlanError(f"{what} keeps no experts; keep at least top_k={top_k}")
    if keep < top_k:
        raise PlanError(
            f"{what} keeps {keep} experts per layer, fewer than top_k={top_k} the router "
            f"selects per token; keep at least {top_k} (lower sparsity)"
        )
    if grouped:
        reachable = (topk_group or 1) * per_group
        if reachable < top_k:
            raise PlanError(
                f"{what} keeps {per_group} experts in each of {n_group} groups; the router "
                f"picks topk_group={topk_group} groups, so only {reachable} experts are "
                f"reachable per token, fewer than top_k={top_k}; lower sparsity"
            )
    for note in notes if log else ():
        logger.info(f"REAP keep count: {note}")
    return KeepCount(num_experts, keep, requested, per_group, tuple(notes))


def group_args(metadata: dict) -> tuple[int, int | None, int | None]:
    top_k = metadata.get("top_k")
    if top_k is None:
        logger.warning("scores metadata has no top_k; the keep count is only checked against 1")
        top_k = 1
    return int(top_k), metadata.get("n_group"), metadata.get("topk_group")


def keep_count_for_scores(
    scores,
    *,
    sparsity: float | None = None,
    num_experts_to_keep: int | None = None,
    divisible_by: int | None = None,
) -> KeepCount:
    """The keep-count rule with ``num_experts``, ``top_k`` and groups taken from the
    metadata of ``scores`` (an :class:`~reap_modifier.scores.ExpertScores`)."""
    top_k, n_group, topk_group = group_args(scores.metadata)
    return compute_keep_count(
        scores.num_experts,
        top_k,
        sparsity=sparsity,
        num_experts_to_keep=num_experts_to_keep,
        divisible_by=divisible_by,
        n_group=n_group,
        topk_group=topk_group,
    )
