"""Do these scores belong to this model: one check for the modifier's ``scores_in``,
``reap cut`` and ``reap prune --scores`` (through :func:`reap_modifier.scores.plan.cut_scores`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import ScoresError

if TYPE_CHECKING:
    import torch

__all__ = [
    "ModelFacts",
    "ScoresMismatchError",
    "check_scores_belong",
    "routed_counts",
]

ANOTHER_MODEL = "the scores were made for another model"


class ScoresMismatchError(ScoresError):
    """A scores file was made for another model than the one it is applied to."""


@dataclass(frozen=True)
class ModelFacts:
    """What a scores file must match to belong to a model."""

    num_experts: int
    #: the model's MoE layer names
    layers: tuple[str, ...]
    top_k: int | None = None
    n_group: int | None = None
    topk_group: int | None = None
    #: the model's ``model_fingerprint``, computed only when the scores state one
    fingerprint: Callable[[], str] | None = None
    #: a scored layer's name -> the model's layer it is; raises ``ValueError`` saying why
    #: none is (default: the name itself, when it is one of ``layers``)
    resolve: Callable[[str], str] | None = None
    #: whether the scores must cover every layer of the model
    cover_all: bool = True
    #: how messages name the model
    name: str = "the model"


def _refuse(message: str) -> ScoresMismatchError:
    return ScoresMismatchError(f"{message}; {ANOTHER_MODEL}")


def check_scores_belong(scores, facts: ModelFacts, source: str) -> None:
    """Refuse ``scores`` (an :class:`~reap_modifier.scores.ExpertScores`) made for another
    model than ``facts``: its expert count, its MoE layers (each scored layer one of the
    model's; all of them when ``facts.cover_all``), its top-k and its fingerprint where the
    scores state them. ``source`` names the scores in the message.

    :raises ScoresMismatchError: the first difference, in one line
    """
    if scores.num_experts != facts.num_experts:
        raise _refuse(
            f"{source} holds {scores.num_experts} experts per layer, {facts.name} has "
            f"{facts.num_experts}"
        )
    resolved, failures = set(), []
    for layer in scores.layers:
        try:
            resolved.add(_resolve(facts, layer))
        except ValueError as exc:
            failures.append(exc)
    missing = [layer for layer in facts.layers if layer not in resolved]
    if facts.cover_all and missing:
        raise _refuse(
            f"{source} does not cover {facts.name}'s MoE layers (missing e.g. {missing[:3]})"
        )
    if failures:
        raise _refuse(f"{source}: {failures[0]}")
    theirs = scores.metadata.get("top_k")
    if theirs is not None and facts.top_k is not None and int(theirs) != facts.top_k:
        raise _refuse(f"{source} states top_k={theirs}, {facts.name} has top_k={facts.top_k}")
    theirs = scores.metadata.get("model_fingerprint")
    if theirs and facts.fingerprint is not None and theirs != facts.fingerprint():
        raise _refuse(
            f"{source} was computed on a model with different router weights "
            "(model_fingerprint mismatch)"
        )


def _resolve(facts: ModelFacts, layer: str) -> str:
    if facts.resolve is not None:
        return facts.resolve(layer)
    if layer not in facts.layers:
        raise ValueError(f"layer {layer!r} is not a MoE layer of {facts.name}")
    return layer


def routed_counts(scores) -> dict[str, torch.Tensor] | None:
    """Per-layer routed counts (they mark never-routed experts), when every layer has them."""
    if scores.layers and all("count" in stats for stats in scores.layers.values()):
        return {layer: stats["count"] for layer, stats in scores.layers.items()}
    return None
