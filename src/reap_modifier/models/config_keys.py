"""MoE config keys, shared by everything that reads MoE fields from a config object or
a ``config.json`` (architecture discovery, in-memory surgery, the checkpoint rewriter,
the weight baselines)."""

from __future__ import annotations

__all__ = [
    "COUNT_KEYS",
    "EXPERTS_ATTR",
    "MODULE_COUNT_ATTRS",
    "N_GROUP_KEYS",
    "ROUTER_ATTRS",
    "TOPK_GROUP_KEYS",
    "TOP_K_KEYS",
    "first_key",
    "text_config",
]

#: the routed-expert count, per family
COUNT_KEYS = ("num_experts", "num_local_experts", "moe_num_experts", "n_routed_experts")
#: experts per token (``top_k`` last: old configs also carry a sampling ``top_k``)
TOP_K_KEYS = (
    "num_experts_per_tok",
    "num_experts_per_token",
    "experts_per_token",
    "moe_top_k",
    "moe_topk",
    "top_k_experts",
    "top_k",
)
N_GROUP_KEYS = ("n_group", "num_expert_group")
TOPK_GROUP_KEYS = ("topk_group", "top_k_group")
#: attribute of a MoE block holding the router, and the one holding the experts
ROUTER_ATTRS = ("gate", "router")
EXPERTS_ATTR = "experts"
#: per-module integer attributes that mirror the expert count
MODULE_COUNT_ATTRS = ("num_experts", "n_routed_experts", "experts_per_rank", "num_local_experts")


def text_config(config):
    """The config holding MoE fields (``text_config`` for multimodal wrappers such as K3)."""
    sub = getattr(config, "text_config", None)
    return sub if sub is not None else config


def first_key(config, keys) -> tuple[str | None, object]:
    """The first of ``keys`` set on ``config`` and its value, else ``(None, None)``."""
    for key in keys:
        value = getattr(config, key, None)
        if value is not None:
            return key, value
    return None, None
