"""The unpruned model routed as a pruned one, without cutting anything: how the post-cut
step scores two plans (REAP's cut and a block-error selection) end to end on the same
model, where a copy of the model has no room (Kimi K3).

Within :func:`routed_as`, every MoE block routes through a copy of its router cut to the
plan's kept rows (weight, bias, score-correction bias; count attributes), so the top-k,
the weights, the groups and the renormalisation are those of the pruned router; the block's
own count attributes are the pruned ones; and the routed dispatch maps the pruned router's
ids (``0..n-1``) back to the kept experts' original ids, so the unpruned experts compute
exactly what the pruned model's sliced experts would. Nothing is written: the routers,
blocks and experts are the model's own once the context exits.

A layer that routes through anything else per expert (non-expert router rows, a router
with submodules, a block-level bias, other per-expert routing vectors or token -> expert
tables) or through a dispatch shape :mod:`.dispatch` does not swap has no such view:
:func:`view_problem` says why, and the step then keeps REAP's cut unscored.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from ..models import MoEArchitecture, MoELayer
from ..models.config_keys import MODULE_COUNT_ATTRS
from ..models.expert_tensors import cut_dim
from ..scores.plan import PruningPlan
from ..wholeness import is_table, routing_tensors
from .dispatch import dispatch_problem, instance_attrs, original_dispatch, routed_dispatch

__all__ = ["routed_as", "view_problem"]

#: router tensors cut to the kept rows
_ROWS = ("weight", "bias", "e_score_correction_bias")


def view_problem(layer: MoELayer, num_experts: int) -> str | None:
    """Why ``layer`` cannot be routed as pruned without cutting it (``None``: it can)."""
    problem = dispatch_problem(layer)
    if problem is not None:
        return problem
    router = layer.router
    if layer.extra_rows or list(router.children()):
        return f"{layer.name}: the router has non-expert rows or submodules"
    rows = {
        id(getattr(router, a)) for a in _ROWS if isinstance(getattr(router, a, None), torch.Tensor)
    }
    for name, module, _, tensor in routing_tensors(layer):
        if id(tensor) in rows or tensor.device.type == "meta":
            continue
        scope = "router" if module is not layer.block else "block"
        if is_table(tensor) or cut_dim(tensor.shape, num_experts, scope) is not None:
            return f"{name}: a per-expert routing tensor outside the router's rows"
    return None


def _router_view(router: nn.Module, kept: torch.Tensor, num_experts: int) -> nn.Module:
    """A copy of ``router`` holding its own tensors, on their compute device, the
    per-expert rows cut to ``kept``, and its count attributes set to ``len(kept)``."""
    from compressed_tensors import align_module_device

    view = copy.copy(router)
    view.__dict__.pop("forward", None)  # an offload wrapper bound to the router itself
    view._forward_pre_hooks, view._forward_hooks = (
        type(router._forward_hooks)(),
        type(router._forward_hooks)(),
    )
    with align_module_device(router):
        params = {n: p.detach() for n, p in router.named_parameters(recurse=False)}
        buffers = {n: b for n, b in router.named_buffers(recurse=False)}
        for store in (params, buffers):
            for n, t in store.items():
                if n in _ROWS and t.dim() >= 1 and t.shape[0] == num_experts:
                    store[n] = t.index_select(0, kept.to(t.device))
                else:
                    store[n] = t.clone()
    view._parameters = dict(params)
    view._buffers = dict(buffers)
    for key in MODULE_COUNT_ATTRS:
        if getattr(view, key, None) == num_experts and isinstance(getattr(view, key), int):
            view.__dict__[key] = len(kept)
    if getattr(view, "out_features", None) == num_experts:
        view.__dict__["out_features"] = len(kept)
    return view


@contextmanager
def routed_as(arch: MoEArchitecture, plan: PruningPlan) -> Iterator[None]:
    """Within the context, every MoE block of the (unpruned) model routes as ``plan``'s
    pruned block does (see the module docstring).

    :raises ValueError: a layer has no such view (:func:`view_problem`)
    """
    E = plan.num_experts
    with ExitStack() as stack:
        for layer in arch.layers:
            problem = view_problem(layer, E)
            if problem is not None:
                raise ValueError(problem)
            kept = torch.tensor(plan.kept[layer.name], dtype=torch.long)
            n = int(kept.numel())
            block = layer.block
            counts = {
                k: n
                for k in MODULE_COUNT_ATTRS
                if isinstance(getattr(block, k, None), int) and getattr(block, k) == E
            }
            dispatch = original_dispatch(layer)

            def remapped(x, ids, weights, dispatch=dispatch, kept=kept):
                return dispatch(x, kept.to(ids.device)[ids], weights)

            stack.enter_context(instance_attrs(block, **counts))
            stack.enter_context(_swapped_router(layer, _router_view(layer.router, kept, E)))
            stack.enter_context(routed_dispatch(layer, remapped))
        yield


@contextmanager
def _swapped_router(layer: MoELayer, view: nn.Module) -> Iterator[None]:
    parent, original = layer.block, layer.block._modules[layer.router_attr]
    parent._modules[layer.router_attr] = view
    try:
        yield
    finally:
        parent._modules[layer.router_attr] = original
