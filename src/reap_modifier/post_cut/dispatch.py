"""How the post-cut stages reach a MoE block's routed experts, one rule per dispatch shape
(the adapter ``kind`` of :mod:`reap_modifier.models`).

Every post-cut stage runs the block's own ``forward`` and router unchanged and swaps only
the call that hands tokens to the routed experts: Kimi K3's ``moe_infer(x, ids, weights)``
(and ``moe_train``, which the calibrate-all mode dispatches to), or transformers' fused
``experts(x, ids, weights)``. The swaps are instance attributes (:func:`instance_attrs`),
so the modules and their offloaded parameters are never written. A family with another
dispatch shape is refused by every fit (:func:`dispatch_problem`); adding one is a row
here (see ``docs/architecture.md``, "Adding a model family").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from ..models import MoELayer

__all__ = [
    "DISPATCH_KINDS",
    "block_tensor",
    "contributions",
    "dispatch_input",
    "dispatch_problem",
    "instance_attrs",
    "one_slot",
    "original_dispatch",
    "routed_dispatch",
    "routed_off",
    "slot_outputs",
]

#: the dispatch shapes the post-cut stages can swap
DISPATCH_KINDS = ("kimi", "experts_call")


def dispatch_problem(layer: MoELayer) -> str | None:
    """Why the post-cut stages cannot swap ``layer``'s routed dispatch (``None``: they can)."""
    if layer.kind not in DISPATCH_KINDS:
        return f"{layer.name}: dispatch shape {layer.kind!r} has no differentiable dispatch"
    return None


def block_tensor(out) -> torch.Tensor:
    """A block's (or dispatch's) output tensor: the first item of a tuple output."""
    return out[0] if isinstance(out, tuple) else out


@contextmanager
def instance_attrs(obj: object, **attrs) -> Iterator[None]:
    """Set instance attributes for the context; restore what the instance held before
    (e.g. compressed-tensors' offload ``forward`` wrapper) or remove them."""
    saved = {k: vars(obj)[k] for k in attrs if k in vars(obj)}
    for k, v in attrs.items():
        object.__setattr__(obj, k, v)
    try:
        yield
    finally:
        for k in attrs:
            if k in saved:
                object.__setattr__(obj, k, saved[k])
            else:
                object.__delattr__(obj, k)


def one_slot(layer: MoELayer) -> Callable:
    """``(x [M, h], ids [M, 1], ones [M, 1]) -> [M, h]``: one routed expert per row with
    weight 1, through the model's own dispatch as it is now (so ``f_e(x)`` is exactly what
    the model computes)."""
    if layer.kind == "kimi":
        block, original = layer.block, type(layer.block).moe_infer
        return lambda x, ids, ones: original(block, x, ids, ones)
    original = layer.experts.forward
    return lambda x, ids, ones: original(x, ids, ones.to(x.dtype))


def slot_outputs(layer: MoELayer) -> Callable:
    """``(x [M, h], ids [M, k]) -> [M, k, h]``: the routed expert output of every (token,
    slot) with weight 1, as the model's dispatch computes it. Kimi blocks: all slots in one
    pass over the experts (:func:`~reap_modifier.calibration.kimi_grouped.routed_slot_outputs`:
    grouped_mm over the layer's stacked experts where it runs, else each expert once on
    all its rows), not one dispatch per slot (``k`` passes over 896 experts at K3's counts);
    other kinds: one dispatch call per slot."""
    if layer.kind == "kimi":
        from ..calibration.kimi_grouped import routed_slot_outputs, stack_kimi_experts

        block = layer.block
        stack = stack_kimi_experts(block.experts)
        return lambda x, ids: routed_slot_outputs(block, x, ids, stack)
    single = one_slot(layer)

    def per_slot(x, ids):
        ones = torch.ones(ids.shape[0], 1, dtype=torch.float32, device=x.device)
        return torch.stack([single(x, ids[:, k : k + 1], ones) for k in range(ids.shape[1])], 1)

    return per_slot


def original_dispatch(layer: MoELayer) -> Callable:
    """``(x, ids, weights) -> out``: the block's routed dispatch as it is now (taken before
    any swap), with the model's own weights."""
    if layer.kind == "kimi":
        block, original = layer.block, type(layer.block).moe_infer
        return lambda x, ids, weights: original(block, x, ids, weights)
    return layer.experts.forward


@contextmanager
def routed_dispatch(layer: MoELayer, fn: Callable) -> Iterator[None]:
    """Within the context the block's routed dispatch is ``fn(x, ids, weights)``."""
    if layer.kind == "kimi":
        with instance_attrs(layer.block, moe_infer=fn, moe_train=fn):
            yield
    else:
        with instance_attrs(layer.experts, forward=fn):
            yield


@contextmanager
def routed_off(layer: MoELayer) -> Iterator[None]:
    """Within the context the block's routed experts contribute nothing (their dispatch
    returns zeros), so the block's output is its ``base``: shared experts and the like."""

    def zeros(x, *_args, **_kwargs):
        return torch.zeros_like(x)

    with routed_dispatch(layer, zeros):
        yield


def dispatch_input(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """``[N, D]``: what the block hands its routed experts (K3 latent MoE: the latent)."""
    block = layer.block
    with torch.no_grad():
        if layer.kind == "kimi" and getattr(block, "use_latent_moe", False):
            return block.routed_expert_down_proj(x)
    return x


def contributions(layer: MoELayer, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[M, H]``: expert ``ids[m]``'s contribution to the block output on dispatch input
    ``h[m]`` with routing weight 1 (after the latent up-projection), through the model's
    own dispatch."""
    ones = torch.ones(ids.shape[0], 1, dtype=torch.float32, device=h.device)
    with torch.no_grad():
        if layer.kind == "kimi":
            block = layer.block
            out = block.moe_infer(h, ids[:, None], ones)
            if getattr(block, "use_latent_moe", False):
                return block.routed_expert_up_proj(out)
            return out
        return layer.experts(h, ids[:, None], ones.to(h.dtype))
