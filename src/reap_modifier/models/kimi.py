"""Kimi K3 / Kimi Linear MoE blocks (llm-compressor's ``KimiSparseMoeBlock``).

The gate returns ``(top_k_ids, top_k_weights)``; the experts are a ``ModuleList`` of
``w1/w2/w3`` MLPs dispatched by ``moe_infer`` (routed tokens only) or ``moe_train``
(calibrate-all: every expert sees every token); for a latent MoE (K3) the experts
work in the latent space between ``routed_expert_down_proj`` and
``routed_expert_up_proj``, so their outputs are latent vectors.
"""

from __future__ import annotations

from torch import nn

from .base import MoEAdapter, register_adapter

__all__ = ["KimiBlockAdapter"]


@register_adapter
class KimiBlockAdapter(MoEAdapter):
    kind = "kimi"
    families = ("Kimi K3", "Kimi Linear")

    @classmethod
    def matches(cls, block: nn.Module, experts: nn.Module, router: nn.Module) -> bool:
        return (
            isinstance(experts, nn.ModuleList)
            and hasattr(block, "moe_infer")
            and hasattr(block, "gate")
        )
