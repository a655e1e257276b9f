"""MoE blocks this package recognises but cannot prune exactly: refused before any
calibration, with the family, the reason and what to do instead.

A refusal is a structural test on the located MoE layers (not a class-name list), so a
new family with the same shape is refused the same way. Each rule says why pruning
cannot equal masking the dropped experts out of routing for that shape.
"""

from __future__ import annotations

from torch import nn

from .architecture import MoEArchitecture, MoELayer, UnsupportedMoEError

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


def _tied_layers(arch: MoEArchitecture) -> tuple[str, str] | None:
    """Two MoE layers holding the same expert or router tensor (tied weights)."""
    owner: dict[int, str] = {}
    for layer in arch.layers:
        tensors = list(layer.experts.parameters()) + list(layer.router.parameters())
        for tensor in {id(t): t for t in tensors}.values():
            other = owner.setdefault(id(tensor), layer.name)
            if other != layer.name:
                return other, layer.name
    return None


def check_prunable(model: nn.Module, arch: MoEArchitecture) -> None:
    """Raise :class:`UnsupportedMoEError` for the first MoE layer with a routing that
    pruning cannot keep exact (before calibration, so no time is spent)."""
    family = _model_type(model)
    tied = _tied_layers(arch)
    if tied is not None:
        raise UnsupportedMoEError(
            f"{family} ({arch.model_class}): MoE layers {tied[0]} and {tied[1]} share "
            "their expert weights (tied), e.g. the encoder and the bidirectional "
            "canvas decoder of a block-diffusion model. REAP scores and cuts every layer "
            "on its own, so the two would keep different experts of one tensor, and the "
            "checkpoint (which stores tied weights once) would not be the pruned model. "
            "REAP prunes causal decoders whose MoE layers own their experts; not "
            "supported, no workaround in this version (docs/families.md)."
        )
    for layer in arch.layers:
        table = _hash_table(layer)
        if table is not None:
            raise UnsupportedMoEError(
                f"{family} ({arch.model_class}): MoE layer {layer.name} is hash-routed: "
                f"its router picks experts from a frozen token -> expert table "
                f"(`{layer.router_attr}.{table}`), so removing an expert the table names "
                "changes which experts those tokens use, and no pruned checkpoint equals "
                "masking it out of routing. REAP refuses hash-routed models. Workaround: "
                "a configuration without hash layers (DeepSeek-V4: `mlp_layer_types` all "
                "'moe') prunes normally."
            )
