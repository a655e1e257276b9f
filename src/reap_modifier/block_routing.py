"""How a MoE router routes as a function of its logits and the set of kept experts: the
routing rule of each router class the block-error selection models
(:mod:`reap_modifier.block_selection`), read from the class's own forward, and
:func:`route`, the top-k ids and weights of the block pruned to a kept set."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .models import MoELayer
from .models.config_keys import group_limit

__all__ = ["BlockSelectionError", "RoutingRule", "route", "routing_rule"]


class BlockSelectionError(ValueError):
    """A block or input the block-error selection cannot use; the message says what to change."""


@dataclass(frozen=True)
class RoutingRule:
    """How a router turns logits into top-k ids and weights (see :func:`routing_rule`)."""

    top_k: int
    activation: str  # "sigmoid" | "softmax"
    bias: torch.Tensor | None  # [E] added to the scores for the choice only
    n_group: int  # expert groups the choice is masked by (1: none)
    topk_group: int
    renormalize: bool
    renorm_eps: float
    scaling: float

    @property
    def limited_groups(self) -> int | None:
        """Groups a cut must fill equally (:func:`~reap_modifier.models.config_keys.group_limit`)."""
        return group_limit(self.n_group, self.topk_group)


def _kimi_rule(router) -> RoutingRule:
    n_group, topk_group = int(router.num_expert_group or 1), int(router.topk_group or 1)
    masked = n_group > 1 and n_group > topk_group
    return RoutingRule(
        top_k=int(router.top_k),
        activation=str(router.moe_router_activation_func),
        bias=router.e_score_correction_bias.detach().float(),
        n_group=n_group if masked else 1,
        topk_group=topk_group if masked else 1,
        renormalize=bool(router.moe_renormalize) and int(router.top_k) > 1,
        renorm_eps=1e-20,
        scaling=float(router.routed_scaling_factor),
    )


def _deepseek_v3_rule(router) -> RoutingRule:
    return RoutingRule(
        top_k=int(router.top_k),
        activation="sigmoid",
        bias=router.e_score_correction_bias.detach().float(),
        n_group=int(router.num_group),
        topk_group=int(router.topk_group),
        renormalize=bool(router.norm_topk_prob),
        renorm_eps=1e-20,
        scaling=float(router.routed_scaling_factor),
    )


def _qwen3_rule(router) -> RoutingRule:
    return RoutingRule(
        top_k=int(router.top_k),
        activation="softmax",
        bias=None,
        n_group=1,
        topk_group=1,
        renormalize=bool(router.norm_topk_prob),
        renorm_eps=0.0,
        scaling=1.0,
    )


#: router class name -> its rule, each written from the class's forward
_RULES = {
    "KimiMoEGate": _kimi_rule,
    "DeepseekV3TopkRouter": _deepseek_v3_rule,
    "Qwen3MoeTopKRouter": _qwen3_rule,
}


def routing_rule(layer: MoELayer) -> RoutingRule:
    """The routing rule of ``layer``'s router.

    :raises BlockSelectionError: a router or block this module does not model
    """
    router, name = layer.router, type(layer.router).__name__
    if name not in _RULES:
        raise BlockSelectionError(
            f"{layer.name}: block-error selection models the routers {sorted(_RULES)}, not "
            f"{name}; use selection: saliency for this model"
        )
    if layer.extra_rows:
        raise BlockSelectionError(f"{layer.name}: routers with non-expert rows are not modelled")
    if getattr(getattr(layer.block, "config", None), "latent_moe_use_norm", False):
        raise BlockSelectionError(
            f"{layer.name}: latent_moe_use_norm normalises the routed sum, so the block is "
            "not linear in the expert outputs; use selection: saliency for this model"
        )
    rule = _RULES[name](router)
    if rule.activation not in ("sigmoid", "softmax"):
        raise BlockSelectionError(f"{layer.name}: router activation {rule.activation!r}")
    return rule


def route(
    rule: RoutingRule, logits: torch.Tensor, kept: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids and weights ``[..., k]`` as the router of the block pruned to ``kept``
    routes: router ``logits`` ``[..., E]`` and ``kept`` ``[..., E]`` (bool) broadcast
    (``[N, E]`` with ``[B, 1, E]``: ``B`` kept sets on ``N`` tokens)."""
    neg = torch.zeros(kept.shape, dtype=logits.dtype, device=logits.device)
    neg = neg.masked_fill(~kept, float("-inf"))
    if rule.activation == "softmax":
        scores = torch.softmax(logits + neg, dim=-1)
    else:
        scores = logits.sigmoid().expand(torch.broadcast_shapes(logits.shape, kept.shape))
    choice = scores + neg if rule.bias is None else scores + rule.bias.to(logits) + neg
    if rule.n_group > 1:
        shape = choice.shape
        grouped = choice.view(*shape[:-1], rule.n_group, shape[-1] // rule.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        picked = group_scores.topk(rule.topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, picked, True)
        choice = grouped.masked_fill(~mask[..., None], float("-inf")).view(shape)
    ids = choice.topk(rule.top_k, dim=-1).indices
    weights = scores.gather(-1, ids)
    if rule.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + rule.renorm_eps)
    return ids, weights * rule.scaling
