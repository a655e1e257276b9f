"""A plan cut from a scores file against a GGUF model (``reap prune SRC.gguf --scores``):
the scores (made on the transformers model, layers named ``model.layers.<L>.mlp``) must
belong to the file: its expert count, MoE layers and top-k; the file's keys are
authoritative for top-k and groups."""

from __future__ import annotations

from pathlib import Path

from ..scores.belongs import ModelFacts
from ..scores.plan import PruningPlan, cut_scores
from .binding import moe_layers, plan_layer_number
from .errors import GGUFError
from .layout import GGUFLayout

__all__ = ["plan_from_scores"]


def plan_from_scores(
    layout: GGUFLayout,
    scores_path: str | Path,
    *,
    keep: int | None = None,
    sparsity: float | None = None,
    divisible_by: int | None = None,
    saliency: str = "reap",
) -> PruningPlan:
    """Cut a plan from ``scores_path`` with the keep-count rule, checked against ``layout``
    (:func:`reap_modifier.scores.plan.cut_scores`)."""
    from ..scores import ExpertScores  # torch: only a cut from scores needs it

    layers = tuple(f"blk.{L}" for L in moe_layers(layout))
    if not layers or layout.num_experts is None:
        raise GGUFError(f"{layout.path}: no MoE layer in the file")

    def resolve(name: str) -> str:
        L = plan_layer_number(name)
        if L is None or f"blk.{L}" not in layers:
            raise ValueError(f"layer {name!r} is not a MoE layer of the file")
        return f"blk.{L}"

    n_group, group_used = layout.groups
    facts = ModelFacts(
        num_experts=layout.num_experts,
        layers=layers,
        top_k=layout.top_k,
        n_group=n_group,
        topk_group=group_used,
        resolve=resolve,
        cover_all=False,
        name=str(layout.path),
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
