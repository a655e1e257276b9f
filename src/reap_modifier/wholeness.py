"""Proof that a pruned model is whole, run after the cut and before anything is saved.

Surgery cuts what it knows (experts, router rows, per-expert routing vectors, token ->
expert tables). This module does not trust that (the per-tensor rule is
:mod:`reap_modifier.models.expert_tensors`, shared with the checkpoint rewriter): for every pruned MoE block it looks
at every parameter and buffer of the router, of the block itself and of fused experts
(any rank, any name) and names each one that still has the old expert count in a
dimension, each ModuleList of experts of the wrong length and each token -> expert
table that still holds an id the pruned block does not have; then it runs one forward
of the pruned model on a calibration sample. Any failure raises :class:`WholenessError`
naming the tensor or module, so the caller writes nothing (the modifier raises before
``oneshot`` saves; ``reap prune`` checks the same on the rewritten tensors).
"""

from __future__ import annotations

import torch
from loguru import logger
from torch import nn

from .models import MoEArchitecture, MoELayer
from .models.expert_tensors import left_behind

__all__ = ["WholenessError", "check_whole", "leftovers", "routing_tensors"]


class WholenessError(RuntimeError):
    """The pruned model is not whole; nothing was (or may be) written."""


def routing_tensors(layer: MoELayer):
    """``(qualified name, owner module, attr, tensor)`` of every tensor of the router
    (recursively) and of the block itself (direct only): where per-expert routing
    vectors and token -> expert tables live."""
    seen: set[int] = set()
    router_name = layer.router_attr
    owners = [
        (f"{router_name}.{n}" if n else router_name, m) for n, m in layer.router.named_modules()
    ]
    owners.append(("", layer.block))
    for prefix, module in owners:
        items = list(module.named_parameters(recurse=False)) + list(
            module.named_buffers(recurse=False)
        )
        for attr, tensor in items:
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            name = f"{prefix}.{attr}" if prefix else attr
            yield f"{layer.name}.{name}", module, attr, tensor


def is_table(tensor: torch.Tensor) -> bool:
    """An integer tensor of the routing path: a token -> expert id table."""
    return not tensor.is_floating_point() and tensor.dtype != torch.bool and tensor.dim() >= 1


def _fused_tensors(layer: MoELayer):
    experts = layer.experts
    if isinstance(experts, nn.ModuleList):
        return
    for name, tensor in list(experts.named_parameters()) + list(experts.named_buffers()):
        yield f"{layer.name}.experts.{name}", tensor


def leftovers(arch: MoEArchitecture, old_count: int) -> list[str]:
    """What the cut left with the old expert count: one line per tensor or module."""
    new_count = arch.num_experts
    problems: list[str] = []
    for layer in arch.layers:
        for name, module, _, tensor in routing_tensors(layer):
            if tensor.device.type == "meta":
                continue
            if is_table(tensor):
                if tensor.numel() and int(tensor.max()) >= new_count:
                    problems.append(
                        f"{name}: token -> expert table still holds expert id "
                        f"{int(tensor.max())} (the block now has {new_count} experts)"
                    )
            elif left_behind(
                tensor.shape, old_count, "router" if module is not layer.block else "block"
            ):
                problems.append(
                    f"{name}: shape {tuple(tensor.shape)} still has {old_count} experts"
                )
        for name, tensor in _fused_tensors(layer):
            if left_behind(tensor.shape, old_count, "experts"):
                problems.append(
                    f"{name}: shape {tuple(tensor.shape)} still has {old_count} experts"
                )
        experts = layer.experts
        if isinstance(experts, nn.ModuleList):
            count = sum(1 for key in experts._modules if key.isdigit())
            if count != new_count:
                problems.append(
                    f"{layer.name}.experts: {count} expert modules, expected {new_count}"
                )
    return problems


def check_whole(
    model: nn.Module,
    arch: MoEArchitecture,
    old_count: int,
    sample_ids: torch.Tensor | None = None,
    run_forward: bool = True,
) -> None:
    """Raise :class:`WholenessError` unless every pruned block is consistent with
    ``arch.num_experts`` experts and one forward of ``model`` on ``sample_ids`` runs.

    :param sample_ids: ``[1, T]`` token ids (a calibration sample); a few ids below the
        vocabulary size when not given
    :param run_forward: skip the forward (packed compressed-tensors experts, whose
        forward would decompress the whole model; the checkpoint rewriter verifies)
    """
    problems = leftovers(arch, old_count)
    if problems:
        raise WholenessError(
            f"{arch.model_class}: the pruned model is not whole, nothing was written. "
            f"{len(problems)} tensor(s) of pruned MoE blocks were not cut to "
            f"{arch.num_experts} experts: "
            + "; ".join(problems[:8])
            + ". This family needs an adapter for these tensors (docs/architecture.md, "
            "'Adding a model family')."
        )
    if not run_forward:
        return
    if sample_ids is None:
        vocab = int(getattr(arch.config, "vocab_size", 8) or 8)
        sample_ids = (torch.arange(8) % vocab).unsqueeze(0)
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), None)
    ids = sample_ids[:1, :16].to(device or "cpu")
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    except Exception as exc:
        raise WholenessError(
            f"{arch.model_class}: the pruned model fails its first forward, nothing was "
            f"written: {type(exc).__name__}: {exc}"
        ) from exc
    logger.info(f"REAP: pruned model is whole ({len(arch.layers)} MoE layers, one forward ran)")
