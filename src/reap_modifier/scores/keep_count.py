"""The keep-count rule: how many experts every MoE layer keeps.

One rule for the modifier, ``reap cut`` and ``reap prune``. For ``sparsity`` it is
llm-compressor's own (``REAPPruningModifier.on_initialize``), so an upstream recipe
keeps the same number of experts; ``num_experts_to_keep`` and ``divisible_by`` are
ours and apply on top. With ``E`` experts per layer:

1. ``sparsity``: drop ``int(E * sparsity)`` (truncated, as upstream); refused when that
   is 0. ``num_experts_to_keep``: keep that many.
2. Routers with ``n_group > 1`` expert groups: ``sparsity`` drops
   ``round(int(E * sparsity) / n_group)`` experts per group (Python's ``round``, as
   upstream; refused when 0). For group-limited routers
   (:func:`~reap_modifier.models.config_keys.group_limit`) the cut keeps an equal
   count in every group and ``num_experts_to_keep`` is rounded down to a multiple of
   ``n_group``; when every group is always picked (``topk_group >= n_group``) only the
   count follows upstream and the cut is flat.
3. ``divisible_by``: rounded down to a multiple of it (of ``lcm(divisible_by,
   n_group)`` for group-limited routers).
4. Refused when the result is zero, below ``top_k``, or below what group-limited
   routing can reach (``topk_group * keep_per_group < top_k``).

Every adjustment of steps 2-3 is logged and recorded in the plan. Examples: E=8,
sparsity 0.2 keeps 7; 100 / 0.29 keeps 72 (``int(28.999...)`` = 28 dropped); 128 / 0.6
keeps 52; 896 / 0.3 keeps 628; E=64 with ``n_group`` 8, ``topk_group`` 4 and sparsity
0.3 drops ``round(19 / 8)`` = 2 per group and keeps 48; E=256, sparsity 0.2 keeps 208.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from loguru import logger

from ..models.config_keys import group_limit
from .errors import PlanError

__all__ = [
    "KeepCount",
    "PlanError",
    "check_keep_spec",
    "compute_keep_count",
    "group_args",
    "keep_count_for_scores",
    "sparsity_to_keep",
]


@dataclass(frozen=True)
class KeepCount:
    """Outcome of the keep-count rule (``requested``: the count of step 1)."""

    num_experts: int
    keep: int
    requested: int
    per_group: int | None = None
    adjustments: tuple[str, ...] = ()


def sparsity_to_keep(num_experts: int, sparsity: float) -> int:
    """Step 1 of the rule for a sparsity: ``E - int(E * sparsity)`` (upstream's count)."""
    return num_experts - int(num_experts * sparsity)


def check_keep_spec(
    keep: int | None,
    sparsity: float | None,
    keep_name: str = "num_experts_to_keep",
    sparsity_name: str = "sparsity",
) -> None:
    """Refuse unless exactly one of ``keep`` and ``sparsity`` is given; the names are the
    caller's spelling of the two options (``--keep N``, ``num_experts_to_keep``).

    :raises PlanError: both or neither were given
    """
    if (sparsity is None) == (keep is None):
        given = "both were given" if keep is not None else "neither was given"
        raise PlanError(f"give exactly one of {keep_name} or {sparsity_name} ({given})")


def _base_count(num_experts: int, sparsity: float | None, keep: int | None) -> tuple[int, str]:
    """Step 1: the requested keep count and how to name the request in messages."""
    check_keep_spec(keep, sparsity)
    if sparsity is not None:
        if not 0.0 < sparsity < 1.0:
            raise PlanError(f"sparsity must be in (0, 1), got {sparsity}")
        if int(num_experts * sparsity) == 0:
            raise PlanError(
                f"sparsity={sparsity} drops int({num_experts} x {sparsity}) = 0 of "
                f"{num_experts} experts, so nothing would be pruned; use a sparsity of at "
                f"least {1 / num_experts:.4g}"
            )
        return sparsity_to_keep(
            num_experts, sparsity
        ), f"sparsity={sparsity} of {num_experts} experts"
    if not 0 < keep <= num_experts:
        raise PlanError(f"num_experts_to_keep must be in [1, {num_experts}], got {keep}")
    return int(keep), f"num_experts_to_keep={keep}"


def _group_count(
    num_experts: int, keep: int, n_group: int, sparsity: float | None, what: str
) -> tuple[int, str | None]:
    """Step 2 for a group-limited router: an equal count in every group."""
    if num_experts % n_group:
        raise PlanError(f"{num_experts} experts do not split into n_group={n_group} groups")
    if sparsity is not None:
        drop = num_experts - keep
        per_group_drop = round(drop / n_group)  # Python's round, as upstream
        if per_group_drop == 0:
            raise PlanError(
                f"{what} drops {drop} experts, round({drop} / n_group={n_group}) = 0 per "
                "group: the drop is spread equally over the groups (as llm-compressor "
                "does), so nothing would be pruned; raise sparsity"
            )
        grouped = num_experts - per_group_drop * n_group
        note = (
            f"dropping {per_group_drop} experts in each of {n_group} groups "
            f"({num_experts - grouped} instead of {drop}; an equal drop per group, as "
            "llm-compressor)"
        )
    else:
        grouped = keep - keep % n_group
        note = (
            f"rounded {keep} down to {grouped} for an equal count in each of "
            f"{n_group} groups (group-limited routing)"
        )
    return grouped, note if grouped != keep else None


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
    requested, what = _base_count(num_experts, sparsity, num_experts_to_keep)
    keep = requested
    notes: list[str] = []
    groups = group_limit(n_group, topk_group)
    # llm-compressor spreads a sparsity's drop equally over any n_group > 1 groups, even
    # when every group is always picked (then the count is its, the cut stays flat)
    spread = groups
    if spread is None and sparsity is not None and (n_group or 1) > 1:
        spread = int(n_group) if num_experts % int(n_group) == 0 else None
    if spread is not None:
        keep, note = _group_count(num_experts, keep, spread, sparsity, what)
        notes += [note] if note else []
    if divisible_by is not None:
        if divisible_by < 1:
            raise PlanError(f"divisible_by must be >= 1, got {divisible_by}")
        step = math.lcm(divisible_by, groups or 1)
        rounded = keep - keep % step
        if rounded != keep:
            unit = f"divisible_by={divisible_by}" + (
                f", n_group={groups}: lcm {step}" if step != divisible_by else ""
            )
            notes.append(f"rounded {keep} down to {rounded} ({unit})")
        if rounded == 0:
            raise PlanError(
                f"{what} leaves {keep} experts, which divisible_by={divisible_by} "
                "rounds down to 0; lower divisible_by or keep more experts"
            )
        keep = rounded
    if keep < top_k:
        raise PlanError(
            f"{what} keeps {keep} experts per layer, fewer than top_k={top_k} the router "
            f"selects per token; keep at least {top_k} (lower sparsity)"
        )
    per_group = keep // groups if groups is not None else None
    if groups is not None:
        picked = topk_group if topk_group is not None else 1
        reachable = picked * per_group
        if reachable < top_k:
            raise PlanError(
                f"{what} keeps {per_group} experts in each of {groups} groups; the router "
                f"picks topk_group={picked} groups, so only {reachable} experts are "
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
