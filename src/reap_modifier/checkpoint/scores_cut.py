"""A plan cut from a scores file against a checkpoint's layout (``reap prune --scores``):
the scores must belong to the checkpoint (expert count, MoE layers, top-k), whose config
is authoritative for top-k and groups."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..scores import ExpertScores
from ..scores.plan import PruningPlan, cut_plan
from .binding import resolve_block
from .errors import CheckpointError

__all__ = ["ScoresCut", "build_plan_from_scores"]


@dataclass(frozen=True)
class ScoresCut:
    """The cut of a plan from a scores file, made once the checkpoint's layout is known."""

    scores_path: Path
    keep: int | None = None
    sparsity: float | None = None
    divisible_by: int | None = None
    saliency: str = "reap"

    def plan_for(self, layout) -> PruningPlan:
        if not layout.blocks:
            raise CheckpointError(f"{layout.path}: no MoE layer in the checkpoint")
        return build_plan_from_scores(
            self.scores_path,
            layout,
            keep=self.keep,
            sparsity=self.sparsity,
            divisible_by=self.divisible_by,
            saliency=self.saliency,
        )


def build_plan_from_scores(
    scores_path: Path,
    layout,
    *,
    keep: int | None,
    sparsity: float | None,
    divisible_by: int | None,
    saliency: str,
):
    """Cut a plan from a scores file with the keep-count rule, checked against ``layout``.

    The checkpoint's config is authoritative for top-k and groups; the scores
    metadata must agree with it where it states them.
    """
    scores = ExpertScores.load(scores_path)
    meta = scores.metadata
    E = layout.num_experts
    if scores.num_experts != E:
        raise CheckpointError(
            f"scores file {scores_path} is for {scores.num_experts} experts per layer, the "
            f"checkpoint has {E}: the scores were made for another model"
        )
    for layer in scores.layers:  # every scored layer must be a MoE block of this checkpoint
        try:
            resolve_block(layer, layout.blocks, what=f"scores file {scores_path}: layer")
        except CheckpointError as exc:
            raise CheckpointError(f"{exc}; the scores were made for another model") from exc
    top_k = layout.top_k if layout.top_k is not None else meta.get("top_k")
    if top_k is None:
        raise CheckpointError("neither config.json nor the scores file states top-k")
    if (
        meta.get("top_k") is not None
        and layout.top_k is not None
        and int(meta["top_k"]) != layout.top_k
    ):
        raise CheckpointError(f"scores file has top_k={meta['top_k']}, config.json {layout.top_k}")
    n_group, topk_group = layout.groups
    if n_group is None:
        n_group, topk_group = meta.get("n_group"), meta.get("topk_group")
    counts = {layer: stats["count"] for layer, stats in scores.layers.items() if "count" in stats}
    return cut_plan(
        scores.saliency(saliency),
        counts or None,
        num_experts=E,
        top_k=int(top_k),
        groups=(n_group, topk_group),
        sparsity=sparsity,
        keep=keep,
        divisible_by=divisible_by,
        criterion=saliency,
        propagated=meta.get("propagate_pruned"),
    )
