"""MoE blocks that call ``experts(hidden [N,H], top_k_ids [N,k], top_k_weights [N,k])``.

transformers 5's native fused experts (Qwen3-MoE, OLMoE, Mixtral, DeepSeek-V3,
GLM4-MoE, GPT-OSS) and llm-compressor's linearized ``LinearExperts2D`` all have this
signature, so one adapter covers them.
"""

from __future__ import annotations

from torch import nn

from .base import MoEAdapter, register_adapter

__all__ = ["ExpertsCallAdapter"]


@register_adapter
class ExpertsCallAdapter(MoEAdapter):
    kind = "experts_call"
    families = (
        "Qwen3-MoE",
        "OLMoE",
        "Mixtral",
        "DeepSeek-V3",
        "GLM4-MoE",
        "GPT-OSS",
        "LinearExperts2D",
    )

    @classmethod
    def matches(cls, block: nn.Module, experts: nn.Module, router: nn.Module) -> bool:
        from llmcompressor.modeling.moe.helpers import FusedExpertsProtocol
        from llmcompressor.modeling.moe.linear_experts import LinearExperts2D

        if isinstance(experts, LinearExperts2D) or isinstance(experts, FusedExpertsProtocol):
            return True
        # fused 3-D experts not decorated by `use_experts_implementation` (e.g. GPT-OSS
        # variants): a leading expert dimension on the projection parameters
        params = dict(experts.named_parameters(recurse=False))
        return "down_proj" in params and params["down_proj"].dim() == 3
