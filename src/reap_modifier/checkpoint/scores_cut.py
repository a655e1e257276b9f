"""A plan cut from a scores file against a checkpoint's layout (``reap prune --scores``):
the scores must belong to the checkpoint (expert count, MoE layers, top-k), whose config
is authoritative for top-k and groups."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..scores import ExpertScores
from ..scores.belongs import ModelFacts
from ..scores.plan import PruningPlan, cut_scores
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
    """Cut a plan from a scores file with the keep-count rule, checked against ``layout``
    (:func:`reap_modifier.scores.plan.cut_scores`).

    The checkpoint's config is authoritative for top-k and groups; the scores
    metadata must agree with it where it states them.
    """
    n_group, topk_group = layout.groups
    facts = ModelFacts(
        num_experts=layout.num_experts,
        layers=tuple(layout.blocks),
        top_k=layout.top_k,
        n_group=n_group,
        topk_group=topk_group,
        resolve=lambda layer: resolve_block(layer, layout.blocks, what="layer"),
        cover_all=False,
        name="the checkpoint",
    )
    return cut_scores(
        ExpertScores.load(scores_path),
        facts,
        keep=keep,
        sparsity=sparsity,
        divisible_by=divisible_by,
        saliency=saliency,
        source=f"scores file {scores_path}",
    )
