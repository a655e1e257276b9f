"""MoE blocks this package recognises but cannot prune exactly: refused before any
calibration, with the family, the reason and what to do instead.

A refusal is a structural test on the located MoE layers (not a class-name list), so a
new family with the same shape is refused the same way. Each rule says why pruning
cannot equal masking the dropped experts out of routing for that shape.
"""

from __future__ import annotations

import re

from torch import nn

from .architecture import MoEArchitecture, MoELayer, UnsupportedMoEError
from .expert_tensors import hash_routed_message

__all__ = ["UnsupportedMoEError", "check_prunable", "check_traced"]


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
    parents: dict[str, list[str]] = {}
    for layer in arch.layers:
        parent, _, child = layer.name.rpartition(".")
        parents.setdefault(parent, []).append(child)
    for parent, children in parents.items():
        named = [c for c in children if not c.isdigit()]  # not the layers of a ModuleList
        if len(named) > 1:
            raise UnsupportedMoEError(
                f"{family} ({arch.model_class}): {parent} holds {len(children)} MoE blocks "
                f"({', '.join(children)}): modality-isolated experts (e.g. ERNIE-4.5-VL's "
                "text and vision experts) sharing one expert count in the config. Text "
                "calibration never routes a token to the other modality's experts, so REAP "
                "cannot score them, and pruning only one set would save a checkpoint whose "
                "counts disagree. Not supported: no workaround in this version."
            )
    for layer in arch.layers:
        table = _hash_table(layer)
        if table is not None:
            raise UnsupportedMoEError(
                hash_routed_message(
                    family, arch.model_class, layer.name, f"{layer.router_attr}.{table}"
                )
            )


def check_traced(
    model: nn.Module,
    arch: MoEArchitecture,
    subgraphs: list[set[int]] | None,
    error: Exception | None = None,
) -> None:
    """Raise :class:`UnsupportedMoEError` when the sequential pipeline could not trace
    the model (``error``) or its traced ``subgraphs`` (each a set of module ``id``s)
    leave some MoE block out: the model's forward calls its decoder layers from code
    the tracer wraps (Qwen3-Omni's thinker), so calibration would never reach those
    experts. Checked after tracing, before the first calibration batch."""
    workaround = (
        'Workaround: oneshot(..., pipeline="basic") (one calibration pass over the whole model).'
    )
    family = f"{_model_type(model)} ({arch.model_class})"
    if error is not None:
        cause = error.__cause__ or error  # the tracer's message is its generated code
        lines = [ln.strip() for ln in str(cause).splitlines() if ln.strip()]
        why = re.sub(r"\b(0x[0-9a-f]+|\d{9,})\b", "<id>", lines[-1] if lines else "")[:160]
        raise UnsupportedMoEError(
            f"{family}: llm-compressor's sequential pipeline cannot trace this model's "
            f"forward ({type(cause).__name__}: {why}), so it cannot calibrate "
            f"its MoE layers one decoder layer at a time. {workaround}"
        ) from error
    covered = set().union(*subgraphs) if subgraphs else set()
    missing = [layer.name for layer in arch.layers if id(layer.block) not in covered]
    if not missing:
        return
    raise UnsupportedMoEError(
        f"{family}: the sequential pipeline traced {len(subgraphs or [])} subgraph(s) "
        f"that never call {len(missing)} of its {len(arch.layers)} MoE layers (e.g. "
        f"{missing[0]}): the model's forward runs its decoder layers from code the tracer "
        f"cannot split, so REAP would observe no token. {workaround}"
    )
