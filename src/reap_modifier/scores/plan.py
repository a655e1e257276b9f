"""The :class:`PruningPlan`: kept expert ids per MoE layer, and how one is cut.

Within a layer (or group) the ``keep`` highest-saliency experts survive (the keep
count comes from :mod:`.keep_count`); ties go to the lower original index. Kept ids
are ascending original ids, renumbered 0..n-1. A plan saves as ``plan.json``
(``reap cut`` output) and is what the in-memory surgery and the checkpoint rewriter
apply.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from loguru import logger

from ..fileio import write_json_atomic
from ..models.config_keys import group_limit
from .belongs import ModelFacts, check_scores_belong, routed_counts
from .errors import PlanError, ScoresError
from .keep_count import KeepCount, compute_keep_count, group_args

if TYPE_CHECKING:  # torch is imported where a cut needs it: loading a plan needs none
    import torch

__all__ = [
    "PLAN_FORMAT",
    "PLAN_VERSION",
    "PlanError",
    "PruningPlan",
    "check_propagated_cut",
    "cut_plan",
    "cut_scores",
    "plan_from_scores",
    "retained_mass",
    "select_experts",
]

PLAN_FORMAT = "reap-plan"
PLAN_VERSION = 1


def select_experts(saliency: torch.Tensor, keep: int, n_group: int | None = None) -> list[int]:
    """Ascending ids of the ``keep`` highest-saliency experts (per group when grouped).

    Deterministic: ties are broken toward the lower original index.
    """
    import torch

    scores = saliency.detach().to("cpu", torch.float64)
    num_experts = scores.numel()
    groups = n_group if n_group and n_group > 1 else 1
    size = num_experts // groups
    per = keep // groups
    kept: list[int] = []
    for g in range(groups):
        grp = scores[g * size : (g + 1) * size]
        # stable sort by descending score: ties keep index order (lower first)
        order = torch.sort(-grp, stable=True).indices[:per]
        kept.extend((torch.sort(order).values + g * size).tolist())
    return kept


def retained_mass(saliency: torch.Tensor, kept: list[int]) -> float:
    """Fraction of the layer's total saliency held by ``kept`` (1.0 for an all-zero layer)."""
    import torch

    scores = saliency.detach().to("cpu", torch.float64)
    total = float(scores.sum())
    if total == 0.0:
        return 1.0
    return float(scores[torch.as_tensor(kept, dtype=torch.long)].sum()) / total


@dataclass
class PruningPlan:
    """Kept original expert ids per MoE layer, plus how they were chosen.

    :param kept: layer name -> ascending kept original ids (position = new id)
    :param num_experts: experts per layer before pruning
    :param saliency: criterion name the ranking used
    :param params: parameters (sparsity / keep / divisible_by / ...)
    :param retained: layer name -> retained saliency mass (fraction)
    """

    kept: dict[str, list[int]]
    num_experts: int
    saliency: str = "reap"
    params: dict = field(default_factory=dict)
    retained: dict[str, float] = field(default_factory=dict)
    ties: dict[str, int] = field(default_factory=dict)
    never_routed: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_kept(self) -> int:
        counts = {len(v) for v in self.kept.values()}
        if len(counts) != 1:
            by_count: dict[int, list[str]] = {}
            for layer, ids in self.kept.items():
                by_count.setdefault(len(ids), []).append(layer)
            detail = "; ".join(
                f"{n} in {', '.join(layers[:3])}"
                + (f" (+{len(layers) - 3} more)" if len(layers) > 3 else "")
                for n, layers in sorted(by_count.items())
            )
            raise PlanError(
                f"plan keeps different counts per layer ({detail}); every MoE layer must keep "
                "the same number (configs hold one expert count)"
            )
        return counts.pop()

    def remap(self, layer: str) -> dict[int, int]:
        """old id -> new id for one layer."""
        return {old: new for new, old in enumerate(self.kept[layer])}

    def validate(self) -> PruningPlan:
        if not self.kept:
            raise PlanError("plan holds no layers")
        n = self.num_kept
        for layer, ids in self.kept.items():
            bad = [i for i in ids if not 0 <= i < self.num_experts]
            if bad:
                raise PlanError(
                    f"plan layer {layer!r}: ids {bad[:8]} outside [0, {self.num_experts}) "
                    f"(num_experts={self.num_experts})"
                )
            seen: set[int] = set()
            dup = sorted({i for i in ids if i in seen or seen.add(i)})
            if dup:
                raise PlanError(
                    f"plan layer {layer!r}: kept ids must be ascending and unique; {dup[:8]} repeated"
                )
            if list(ids) != sorted(ids):
                raise PlanError(f"plan layer {layer!r}: kept ids must be ascending (sort them)")
        if n == 0:
            raise PlanError("plan keeps no experts")
        return self

    @classmethod
    def from_saliency(
        cls,
        saliency: dict[str, torch.Tensor],
        keep: KeepCount,
        *,
        criterion: str,
        n_group: int | None = None,
        params: dict | None = None,
        counts: dict[str, torch.Tensor] | None = None,
    ) -> PruningPlan:
        """Cut every layer of ``saliency`` at ``keep`` (counts mark never-routed experts)."""
        import torch

        kept, retained, ties, never = {}, {}, {}, {}
        for layer, scores in saliency.items():
            ids = select_experts(scores, keep.keep, n_group)
            kept[layer] = ids
            retained[layer] = retained_mass(scores, ids)
            # ties straddling the cut: equal scores on both sides of it
            s = scores.to(torch.float64)
            kept_mask = torch.zeros(s.numel(), dtype=torch.bool)
            kept_mask[ids] = True
            if (~kept_mask).any():
                boundary = float(s[kept_mask].min())
                ties[layer] = int(((s == boundary) & ~kept_mask).sum())
            if counts is not None:
                never[layer] = (counts[layer] == 0).nonzero().flatten().tolist()
        n_ties = sum(ties.values())
        if n_ties:
            logger.warning(
                f"REAP: {n_ties} experts tied with the last kept score across "
                f"{sum(1 for v in ties.values() if v)} layers; lower index kept"
            )
        n_never = sum(len(v) for v in never.values())
        if n_never:
            logger.warning(
                f"REAP: {n_never} (layer, expert) pairs were never routed during "
                "calibration; they score 0 and are dropped first. More calibration "
                "data gives them support."
            )
        all_params = {
            "num_experts_to_keep": keep.keep,
            "requested_keep": keep.requested,
            "adjustments": list(keep.adjustments),
        }
        all_params.update(params or {})
        return cls(
            kept=kept,
            num_experts=keep.num_experts,
            saliency=criterion,
            params=all_params,
            retained=retained,
            ties={k: v for k, v in ties.items() if v},
            never_routed={k: v for k, v in never.items() if v},
        ).validate()

    # -- io ----------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "num_experts": self.num_experts,
            "num_kept": self.num_kept,
            "saliency": self.saliency,
            "params": self.params,
            "kept": self.kept,
            "retained_saliency_mass": self.retained,
            "ties_at_cut": self.ties,
            "never_routed": self.never_routed,
        }

    def save(self, path: str | os.PathLike) -> Path:
        return write_json_atomic(path, self.to_dict())

    @classmethod
    def from_dict(cls, data: dict) -> PruningPlan:
        if not isinstance(data, dict):
            raise PlanError(f"not a REAP plan (a JSON {type(data).__name__}, expected an object)")
        if data.get("format") != PLAN_FORMAT:
            raise PlanError(
                f"not a REAP plan (format {data.get('format')!r}, expected {PLAN_FORMAT!r})"
            )
        if data.get("version") != PLAN_VERSION:
            raise PlanError(
                f"plan version {data.get('version')!r} is not supported (this reap-modifier "
                f"reads version {PLAN_VERSION}); re-cut it with this version's `reap cut`"
            )
        for key in ("kept", "num_experts"):
            if key not in data:
                raise PlanError(f"plan lacks field {key!r}")
        kept = data["kept"]
        if not isinstance(kept, dict):
            raise PlanError(
                f"plan field 'kept' must map layer names to lists of expert ids, got a {type(kept).__name__}"
            )
        ids: dict[str, list[int]] = {}
        for layer, values in kept.items():
            if not isinstance(values, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in values
            ):
                raise PlanError(
                    f"plan layer {layer!r}: kept ids must be a list of integers, got {str(values)[:60]}"
                )
            ids[layer] = list(values)
        num_experts = data["num_experts"]
        if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
            raise PlanError(
                f"plan field 'num_experts' must be a positive integer, got {num_experts!r}"
            )
        return cls(
            kept=ids,
            num_experts=num_experts,
            saliency=data.get("saliency", "unknown"),
            params=data.get("params", {}),
            retained=data.get("retained_saliency_mass", {}),
            ties=data.get("ties_at_cut", {}),
            never_routed=data.get("never_routed", {}),
        ).validate()

    @classmethod
    def load(cls, path: str | os.PathLike) -> PruningPlan:
        """Read and validate a plan file; :class:`PlanError` names the file and the problem."""
        path = Path(path)
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError as exc:
            raise PlanError(f"plan file {path} does not exist") from exc
        except IsADirectoryError as exc:
            raise PlanError(f"plan file {path} is a directory") from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise PlanError(f"plan file {path} is not valid JSON: {exc}") from exc
        try:
            return cls.from_dict(data)
        except PlanError as exc:
            raise PlanError(f"plan file {path}: {exc}") from exc


# -- the cut -------------------------------------------------------------------------------


def cut_plan(
    saliency: dict[str, torch.Tensor],
    counts: dict[str, torch.Tensor] | None,
    *,
    num_experts: int,
    top_k: int,
    groups: tuple[int | None, int | None] = (None, None),
    sparsity: float | None = None,
    keep: int | None = None,
    divisible_by: int | None = None,
    criterion: str = "reap",
    params: dict | None = None,
    log: bool = True,
    propagated: dict | None = None,
) -> PruningPlan:
    """Cut per-layer saliency into a :class:`PruningPlan` with the keep-count rule.

    The one cut behind the modifier, ``reap cut`` and ``reap prune --scores``.

    :param saliency: layer name -> per-expert saliency (higher is kept)
    :param counts: layer name -> per-expert routed counts (marks never-routed experts)
    :param groups: ``(n_group, topk_group)`` of the router
    :param sparsity: fraction to drop (exclusive with ``keep``)
    :param keep: experts to keep per layer (``num_experts_to_keep``)
    :param params: extra parameters recorded in the plan
    :param log: log the keep count's adjustments
    :param propagated: the ``propagate_pruned`` record of the scores being cut
        (``{"keep", "saliency", ...}``); only that cut is allowed
    :raises PlanError: the keep count is invalid for this router, or differs from the
        cut a ``propagate_pruned`` scores file was measured under
    """
    n_group, topk_group = groups
    count = compute_keep_count(
        num_experts,
        top_k,
        sparsity=sparsity,
        num_experts_to_keep=keep,
        divisible_by=divisible_by,
        n_group=n_group,
        topk_group=topk_group,
        log=log,
    )
    if propagated:
        check_propagated_cut(propagated, count.keep, criterion)
    recorded = {
        "sparsity": sparsity,
        "num_experts_to_keep_requested": keep,
        "divisible_by": divisible_by,
        "top_k": top_k,
        "n_group": n_group,
        "topk_group": topk_group,
    }
    recorded.update(params or {})
    return PruningPlan.from_saliency(
        saliency,
        count,
        criterion=criterion,
        n_group=group_limit(n_group, topk_group),
        params=recorded,
        counts=counts,
    )


def check_propagated_cut(propagated: dict, keep: int, criterion: str) -> None:
    """Refuse to cut ``propagate_pruned`` statistics at any cut but their own."""
    if keep == propagated.get("keep") and criterion == propagated.get("saliency"):
        return
    raise PlanError(
        f"these scores were calibrated with propagate_pruned: every MoE layer after the "
        f"first was observed on a model whose earlier layers were already cut to "
        f"{propagated.get('keep')} experts by {propagated.get('saliency')!r}, so they hold "
        f"only for that cut; this asks for {keep} by {criterion!r}. Cut them at "
        f"{propagated.get('keep')} by {propagated.get('saliency')!r}, or calibrate with "
        "propagate_pruned: false (statistics of the unpruned model cut any tier)"
    )


def plan_from_scores(
    scores,
    *,
    sparsity: float | None = None,
    num_experts_to_keep: int | None = None,
    divisible_by: int | None = None,
    saliency: str | None = None,
    params: dict | None = None,
) -> PruningPlan:
    """Cut a scores file into a :class:`PruningPlan` (what ``reap cut`` does).

    ``top_k``, ``n_group`` and ``topk_group`` come from the scores metadata;
    ``saliency=None`` means the file's default (``reap`` for calibration files, the
    method of a baseline file).
    """
    recorded = {
        "model_class": scores.metadata.get("model_class"),
        "scores_kind": scores.kind,
    }
    recorded.update(params or {})
    return cut_scores(
        scores,
        keep=num_experts_to_keep,
        sparsity=sparsity,
        divisible_by=divisible_by,
        saliency=saliency,
        params=recorded,
    )


def cut_scores(
    scores,
    facts: ModelFacts | None = None,
    *,
    keep: int | None = None,
    sparsity: float | None = None,
    divisible_by: int | None = None,
    saliency: str | None = None,
    source: str = "scores file",
    params: dict | None = None,
) -> PruningPlan:
    """Cut ``scores`` into a plan with the keep-count rule, after checking they belong to
    the model of ``facts``, whose top-k and groups are authoritative; without ``facts``
    (``reap cut``) the scores' metadata gives them. ``saliency=None`` is the file's default.

    :raises ScoresMismatchError: the scores were made for another model
    :raises PlanError: the keep count is invalid for this router
    """
    meta = scores.metadata
    name = saliency or scores.default_saliency
    if facts is None:
        top_k, n_group, topk_group = group_args(meta)
    else:
        check_scores_belong(scores, facts, source)
        top_k = facts.top_k if facts.top_k is not None else meta.get("top_k")
        if top_k is None:
            raise ScoresError(f"neither {facts.name}'s config nor {source} states top-k")
        n_group, topk_group = facts.n_group, facts.topk_group
        if n_group is None:
            n_group, topk_group = meta.get("n_group"), meta.get("topk_group")
    return cut_plan(
        scores.saliency(name),
        routed_counts(scores),
        num_experts=scores.num_experts,
        top_k=int(top_k),
        groups=(n_group, topk_group),
        sparsity=sparsity,
        keep=keep,
        divisible_by=divisible_by,
        criterion=name,
        params=params,
        propagated=meta.get("propagate_pruned"),
    )
