"""MoE blocks this package recognises but cannot prune exactly: refused before any
calibration, with the family, the reason and what to do instead.

A refusal is a structural test on one located MoE layer (not a class-name list), so a
new family with the same shape is refused the same way. Each rule says why pruning
cannot equal masking the dropped experts out of routing for that shape.
"""

from __future__ import annotations

import inspect

from torch import nn

from .architecture import MoEArchitecture, MoELayer, UnsupportedMoEError
from .expert_tensors import hash_routed_message

__all__ = ["UnsupportedMoEError", "check_prunable"]


def _model_type(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    return str(getattr(config, "model_type", type(model).__name__))


def _hash_table(layer: MoELayer) -> str | None:
    """Integer tensors of the router: a frozen token -> expert table."""
    for name, tensor in list(layer.router.named_buffers()) + list(layer.router.named_parameters()):
        if not tensor.is_floating_point() and tensor.dtype.is_signed and tensor.dim() >= 1:
            return name
    return None


def _input_gated(layer: MoELayer) -> bool:
    """Experts called with the hidden states only (the router score already multiplied
    into their input, every expert sees every token): Llama-4's ``experts(routed_in)``."""
    if layer.kind != "experts_call":  # (llm-compressor's linearized Llama-4 experts too)
        return False
    try:
        params = [
            p
            for p in inspect.signature(layer.experts.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        return False
    return len(params) == 1


def check_prunable(model: nn.Module, arch: MoEArchitecture) -> None:
    """Raise :class:`UnsupportedMoEError` for the first MoE layer with a routing that
    pruning cannot keep exact (before calibration, so no time is spent)."""
    family = _model_type(model)
    for layer in arch.layers:
        table = _hash_table(layer)
        if table is not None:
            raise UnsupportedMoEError(
                hash_routed_message(
                    family, arch.model_class, layer.name, f"{layer.router_attr}.{table}"
                )
            )
        if _input_gated(layer):
            raise UnsupportedMoEError(
                f"{family} ({arch.model_class}): MoE layer {layer.name} multiplies the "
                "router score into each expert's input and runs every expert on every "
                "token (`experts(hidden)`), so the per-slot expert output REAP weighs "
                "has no adapter yet (input-side gating). Not supported: no workaround in "
                "this version; docs/families.md lists the families that prune."
            )
