"""How a MoE router routes, as a function of its scores, its score-correction bias and
the set of kept experts: one :class:`RoutingRule` per router, read by :func:`read_rule`,
for every post-cut stage that routes outside the router's own forward (the block-error
selection, the bias fit).

The rules are written from the routers' own forwards: llm-compressor's ``KimiMoEGate``
(sigmoid or softmax, bias, groups, renormalise, scaling), transformers'
``DeepseekV3TopkRouter`` and every router that spells the DeepSeek-V3 rule with its
attribute names (``e_score_correction_bias``, ``top_k``, ``num_group`` /
``num_expert_group``, ``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``:
GLM-4.5, Dots1, ...), and transformers' ``Qwen3MoeTopKRouter`` (softmax, no bias). Each
stage checks the rule against the router's own choice before using it (the selection's
evaluator on the full set, the bias fit on every fitting token), so a router modelled
wrongly fails loudly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models import MoELayer
from ..models.config_keys import group_limit
from .errors import BlockSelectionError

__all__ = [
    "BIAS_ATTR",
    "RoutingRule",
    "choice_groups_mask",
    "read_rule",
    "route",
    "route_scores",
    "router_scores",
    "selection_rule",
]

#: the router tensor that moves the top-k selection only
BIAS_ATTR = "e_score_correction_bias"


@dataclass(frozen=True)
class RoutingRule:
    """How a router turns logits into top-k ids and weights."""

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

    @property
    def masks_groups(self) -> bool:
        """Whether the choice is limited to ``topk_group`` of ``n_group`` groups."""
        return self.n_group > self.topk_group


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
    n_group = getattr(router, "num_expert_group", None) or getattr(router, "num_group", 1)
    return RoutingRule(
        top_k=int(router.top_k),
        activation=str(getattr(router, "moe_router_activation_func", "sigmoid")),
        bias=getattr(router, BIAS_ATTR).detach().float(),
        n_group=int(n_group or 1),
        topk_group=int(getattr(router, "topk_group", 1) or 1),
        renormalize=bool(getattr(router, "norm_topk_prob", False)),
        renorm_eps=1e-20,
        scaling=float(getattr(router, "routed_scaling_factor", 1.0) or 1.0),
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


def read_rule(router) -> RoutingRule | None:
    """``router``'s rule: by its class, else by the DeepSeek-V3 attribute names when it
    carries a score-correction bias and ``top_k``; ``None`` for a router no rule models."""
    name = type(router).__name__
    if name in _RULES:
        return _RULES[name](router)
    if isinstance(getattr(router, BIAS_ATTR, None), torch.Tensor) and hasattr(router, "top_k"):
        return _deepseek_v3_rule(router)
    return None


def selection_rule(layer: MoELayer) -> RoutingRule:
    """The routing rule the block-error selection uses for ``layer``.

    :raises BlockSelectionError: a router or block this module does not model
    """
    rule = read_rule(layer.router)
    if rule is None:
        raise BlockSelectionError(
            f"{layer.name}: block-error selection models the routers {sorted(_RULES)} and "
            "DeepSeek-V3-style routers with a score-correction bias, not "
            f"{type(layer.router).__name__}; use selection: saliency for this model"
        )
    if layer.extra_rows:
        raise BlockSelectionError(f"{layer.name}: routers with non-expert rows are not modelled")
    if getattr(getattr(layer.block, "config", None), "latent_moe_use_norm", False):
        raise BlockSelectionError(
            f"{layer.name}: latent_moe_use_norm normalises the routed sum, so the block is "
            "not linear in the expert outputs; use selection: saliency for this model"
        )
    if rule.activation not in ("sigmoid", "softmax"):
        raise BlockSelectionError(f"{layer.name}: router activation {rule.activation!r}")
    return rule


def router_scores(router, inputs: torch.Tensor, rule: RoutingRule) -> torch.Tensor:
    """``[N, E]`` float32 routing scores (before the bias) as the router computes them."""
    with torch.no_grad():
        logits = F.linear(inputs.float(), router.weight.float())
    return logits.sigmoid() if rule.activation == "sigmoid" else logits.softmax(dim=-1)


def choice_groups_mask(choice: torch.Tensor, rule: RoutingRule) -> torch.Tensor:
    """``choice`` ``[..., E]`` with the experts outside each row's ``topk_group`` best
    groups (a group scored by the sum of its two best) at ``-inf``."""
    shape = choice.shape
    grouped = choice.view(*shape[:-1], rule.n_group, shape[-1] // rule.n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    picked = group_scores.topk(rule.topk_group, dim=-1).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, picked, True)
    return grouped.masked_fill(~mask[..., None], float("-inf")).view(shape)


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
        choice = choice_groups_mask(choice, rule)
    ids = choice.topk(rule.top_k, dim=-1).indices
    weights = scores.gather(-1, ids)
    if rule.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + rule.renorm_eps)
    return ids, weights * rule.scaling


def route_scores(
    scores: torch.Tensor, bias: torch.Tensor, rule: RoutingRule
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids and weights for ``scores`` ``[..., N, E]`` (:func:`router_scores`) and a
    score-correction ``bias`` ``[..., E]`` (leading dimensions broadcast: one selection per
    candidate bias; ``rule.bias`` is not used)."""
    choice = scores + bias.unsqueeze(-2)
    if rule.masks_groups:
        choice = choice_groups_mask(choice, rule)
    ids = choice.topk(rule.top_k, dim=-1, sorted=False)[1]
    weights = scores.expand(choice.shape).gather(-1, ids)
    if rule.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + rule.renorm_eps)
    return ids, weights * rule.scaling
