"""llm-compressor's post-load linearization of fused experts (``LinearExperts2D``).

Why: llm-compressor 0.14.0.1 builds a ``LinearExperts2D`` from the model config alone
(``MoEConfig.from_config``), so it fails on experts whose sizes or constants the
config does not give as one number: ERNIE-4.5-VL's ``moe_intermediate_size`` is a
list (text experts, vision experts), and MiniMax-M3's gate reads ``swiglu_alpha`` /
``swiglu_limit``, which the fused experts module holds and the linearized one lacks.
The linearized experts are built from a config whose intermediate size is the fused
module's own (``intermediate_dim``), and get the fused module's scalar attributes
they lack; experts the config already describes are built as before.
"""

from __future__ import annotations

import copy

__all__ = ["patch_linear_experts_from_source"]


def _config_for(experts, config):
    """``config``, or a shallow copy whose ``moe_intermediate_size`` is the fused
    module's own when the config holds several (a list)."""
    size = getattr(experts, "intermediate_dim", None)
    if not isinstance(size, int) or isinstance(getattr(config, "moe_intermediate_size", 0), int):
        return config
    config = copy.copy(config)
    object.__setattr__(config, "moe_intermediate_size", size)  # past the list validator
    return config


def patch_linear_experts_from_source() -> None:
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D

    original = LinearExperts2D.from_experts_module.__func__
    if getattr(original, "_reap_patched", False):
        return

    def from_experts_module(cls, experts, config):
        linear = original(cls, experts, _config_for(experts, config))
        for name, value in vars(experts).items():
            if (
                not name.startswith("_")
                and isinstance(value, (bool, int, float))
                and not hasattr(linear, name)
            ):
                setattr(linear, name, value)  # e.g. swiglu_alpha, read by the gate
        return linear

    from_experts_module._reap_patched = True
    LinearExperts2D.from_experts_module = classmethod(from_experts_module)
