"""Saving workarounds: expert counts in the saved config.json, linearized experts packed
back into each family's native module, the GPT-OSS and Llama-4 repacks."""

from __future__ import annotations

import torch
from loguru import logger

from ..registries import saved_config_fixups

__all__ = [
    "patch_gpt_oss_repack",
    "patch_llama4_repack",
    "patch_resave_config",
    "repack_linearized_experts",
]


def patch_resave_config() -> None:
    """Why: llm-compressor 0.14.0.1 ``resave_config`` rewrites config.json from the
    *original* checkpoint's config and patches only ``num_experts``,
    ``num_local_experts`` and ``moe_num_experts``; DeepSeek-V3 / GLM4-MoE keep the old
    ``n_routed_experts`` and the pruned checkpoint cannot load. After it, run the
    saved-config fixups the core registered (the live expert counts)."""
    from llmcompressor.transformers.compression import compressed_tensors_utils as ctu

    original = ctu.resave_config
    if getattr(original, "_reap_patched", False):
        return

    def resave_config(config, save_dir):
        original(config, save_dir)
        for fixup in saved_config_fixups():
            fixup(config, save_dir)

    resave_config._reap_patched = True
    ctu.resave_config = resave_config


def repack_linearized_experts(model) -> int:
    """Pack experts that llm-compressor linearized *after loading* back into the
    model's native fused experts module; returns how many were repacked.

    Why: ``oneshot`` linearizes fused MoE experts post-load (``LinearExperts2D``) and
    saves them under ``experts.{e}.gate_proj/up_proj/down_proj`` names. That happens
    to be the checkpoint format of Qwen3-MoE / OLMoE / DeepSeek-V3 / GLM4-MoE, but not
    of Mixtral (``w1/w2/w3``) or GPT-OSS (fused): transformers then loads those
    experts as random weights. Repacking lets transformers' own save conversion
    write each family's native names. Quantized experts are left alone: their
    compressed-tensors format is per-expert 2-D by design.
    """
    from llmcompressor.modeling.moe.linearize import get_linearized_moes

    repacked = 0
    for name, experts in get_linearized_moes(model):
        if getattr(experts, "_source_experts_cls", None) is None:
            continue  # loaded linearized through conversion mappings: saves correctly
        if any(hasattr(m, "quantization_scheme") for m in experts.modules()):
            continue
        model.set_submodule(name, experts.to_experts_module())
        repacked += 1
    if repacked:
        logger.info(f"REAP: repacked {repacked} linearized experts modules for saving")
    return repacked


def patch_gpt_oss_repack() -> None:
    """Why: llm-compressor 0.14.0.1 ``GptOssExpertMLP`` de-interleaves GPT-OSS's fused
    ``gate_up_proj`` (gate = even columns, up = odd) on linearization but inherits the
    generic *halves* layout for the inverse, so a repacked GPT-OSS model computes
    garbage. Install the matching inverse.
    """
    from llmcompressor.modeling.moe.gpt_oss import GptOssExpertMLP

    if getattr(GptOssExpertMLP.copy_to_experts_module, "_reap_patched", False):
        return

    def copy_to_experts_module(self, experts, index: int) -> None:
        experts.gate_up_proj[index, :, 0::2].copy_(self.gate_proj.weight.T)
        experts.gate_up_proj[index, :, 1::2].copy_(self.up_proj.weight.T)
        experts.down_proj[index].copy_(self.down_proj.weight.T)
        experts.gate_up_proj_bias[index, 0::2].copy_(self.gate_proj.bias)
        experts.gate_up_proj_bias[index, 1::2].copy_(self.up_proj.bias)
        experts.down_proj_bias[index].copy_(self.down_proj.bias)

    copy_to_experts_module._reap_patched = True
    GptOssExpertMLP.copy_to_experts_module = copy_to_experts_module


_LLAMA4_FLAGS = ("is_concatenated", "is_transposed", "has_bias", "has_gate")


def patch_llama4_repack() -> None:
    """Why: llm-compressor 0.14.0.1 ``Llama4LinearExperts.from_experts_module``
    overrides the base constructor without recording the source class and config that
    ``to_experts_module`` needs, so its linearized experts are never repacked and save
    as ``experts.{e}.gate_proj/...``, which transformers' Llama-4 does not load (random
    experts). Record them, and repack into a fresh ``Llama4TextExperts`` carrying the
    layout flags the per-expert copy reads (the linearization set them on the source
    module only)."""
    from llmcompressor.modeling.moe.llama4 import Llama4LinearExperts
    from llmcompressor.utils.dev import skip_weights_initialize

    if getattr(Llama4LinearExperts.to_experts_module, "_reap_patched", False):
        return
    from ..models.moe_fields import text_section  # the one reader of nested configs

    original = Llama4LinearExperts.from_experts_module.__func__

    def from_experts_module(cls, experts, config):
        self = original(cls, experts, config)
        self._source_experts_cls = type(experts)
        self._source_config = text_section(config)  # Llama4Config -> its text config
        return self

    @torch.no_grad()
    def to_experts_module(self):
        with skip_weights_initialize():
            fused = self._source_experts_cls(self._source_config)
        first = next(self.parameters(), None)
        if first is not None:
            fused.to(device=first.device, dtype=first.dtype)
        for flag in _LLAMA4_FLAGS:
            setattr(fused, flag, getattr(type(self), flag))
        for index in range(self.num_experts):
            self[index].copy_to_experts_module(fused, index)
        for flag in _LLAMA4_FLAGS:
            delattr(fused, flag)
        return fused

    to_experts_module._reap_patched = True
    Llama4LinearExperts.from_experts_module = classmethod(from_experts_module)
    Llama4LinearExperts.to_experts_module = to_experts_module
