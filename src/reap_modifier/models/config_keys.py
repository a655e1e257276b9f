"""MoE config keys: every key the project knows for each MoE field.
:func:`reap_modifier.models.moe_fields.moe_fields` reads them from a ``config.json`` or a
config object; architecture discovery reads them from the live config."""

from __future__ import annotations

__all__ = [
    "COUNT_KEYS",
    "EXPERTS_ATTR",
    "MODULE_COUNT_ATTRS",
    "N_GROUP_KEYS",
    "ROUTED_SCALING_KEYS",
    "ROUTER_ATTRS",
    "SHARED_COUNT_KEYS",
    "TOPK_GROUP_KEYS",
    "TOP_K_KEYS",
    "first_key",
    "group_limit",
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
    "moe_k",
    "top_k_experts",
    "top_k",
)
N_GROUP_KEYS = ("n_group", "num_expert_group")
TOPK_GROUP_KEYS = ("topk_group", "top_k_group")
#: shared (always-on) experts, and the factor routed experts' outputs are scaled by
SHARED_COUNT_KEYS = ("n_shared_experts", "num_shared_experts")
ROUTED_SCALING_KEYS = ("routed_scaling_factor",)
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


def group_limit(n_group: int | None, topk_group: int | None) -> int | None:
    """The number of expert groups a cut must keep equally filled, or ``None``.

    A router is group-limited when it first picks ``topk_group`` of ``n_group`` expert
    groups and then the top-k experts inside them (DeepSeek-V3, Kimi): only then must
    every group keep the same number of experts. ``n_group`` of ``None`` or 1, or
    ``topk_group >= n_group`` (every group always picked), is not group-limited. An
    absent ``topk_group`` reads as 1, the default of the Kimi modeling code, which
    limits routing whenever ``n_group > 1``.
    """
    if n_group is None or int(n_group) <= 1:
        return None
    picked = 1 if topk_group is None else int(topk_group)
    return int(n_group) if picked < int(n_group) else None
