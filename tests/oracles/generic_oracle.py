"""Masked routing for any family: the unpruned model with some experts removed from
routing, without a hand-written router forward per family.

Which modules are the MoE blocks, and where their router weight and per-expert biases
live, comes from the hand-written table :data:`family_routing.ROUTING`, never from the
product's discovery: a router or bias the pruner gets wrong then shows as a logits
difference instead of being masked the same wrong way.

Inside each listed MoE block's forward, a torch-function mode follows the router's
weight (and every cast / view / transpose of it) and adds ``-inf`` to the logits of the
dropped experts wherever that weight enters a matmul; every per-expert routing vector
the table names (router bias, ``e_score_correction_bias``, ``expert_bias``,
``[1, E]`` statics) gets ``-inf`` at the dropped experts for the same forward. So a
softmax router gives them probability 0, a sigmoid router selection score ``-inf``
(their weight is never gathered), and a grouped router scores groups over kept
experts only: the semantics of the hand-written ``oracles.masked_routing``.
"""

from __future__ import annotations

import contextlib

import torch
from family_routing import ROUTING, moe_blocks, router_and_biases
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = ["generic_masked_routing", "mask_block", "masked_block_errors"]

_MATMULS = {
    torch.nn.functional.linear,
    torch.matmul,
    torch.mm,
    torch.bmm,
    torch.einsum,
    torch.addmm,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    torch.Tensor.mm,
}


class _MaskRouterLogits(TorchFunctionMode):
    def __init__(self, weight: torch.Tensor, mask: torch.Tensor):
        super().__init__()
        self.mask = mask  # [E] of 0 / -inf
        self.tracked = [weight]
        self.numel = weight.numel()
        self.hits = 0

    def _is_tracked(self, t) -> bool:
        return isinstance(t, torch.Tensor) and any(t is w for w in self.tracked)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat, _ = tree_flatten((args, kwargs))
        if not any(self._is_tracked(t) for t in flat):
            return out
        if func in _MATMULS:
            if not isinstance(out, torch.Tensor) or out.shape[-1] != self.mask.numel():
                raise AssertionError(f"router matmul {func} gave shape {tuple(out.shape)}")
            self.hits += 1
            return out + self.mask.to(out.device, out.dtype)
        if isinstance(out, torch.Tensor) and out.numel() == self.numel:
            self.tracked.append(out)  # a cast, view or transpose of the weight
        return out


def mask_block(block: torch.nn.Module, weight: torch.Tensor, mask: torch.Tensor):
    """Run ``block``'s forward inside a mode that adds ``mask`` ([rows] of 0 / -inf) to every
    matmul output of the router ``weight``; returns the mode (its ``hits`` count the matmuls).
    Undo with ``block.__dict__.pop("forward")``."""
    mode = _MaskRouterLogits(weight, mask)
    inner = block.forward

    def forward(*a, **k):
        with mode:
            return inner(*a, **k)

    block.forward = forward
    return mode


@contextlib.contextmanager
def generic_masked_routing(model: torch.nn.Module, family: str, dropped: dict[str, list[int]]):
    """Route every MoE block of ``model`` (the unpruned ``family`` model) as if its
    ``dropped`` experts (``{block path: expert ids}``) did not exist. The blocks, routers
    and biases come from :data:`family_routing.ROUTING`, never from the product; the
    blocks must be exactly those ``dropped`` names, every bias the table names must
    exist on some block, and each router's weight must be seen in a matmul."""
    blocks = moe_blocks(model, family)
    assert sorted(blocks) == sorted(dropped), (
        f"{family}: MoE blocks by the table {sorted(blocks)} != pruned {sorted(dropped)}"
    )
    extra = ROUTING[family].extra_rows
    saved, modes, seen_biases = [], [], 0
    try:
        for name, block in blocks.items():
            weight, biases = router_and_biases(block, family)
            E = int(weight.shape[0]) - extra
            mask = torch.zeros(E + extra)  # trailing non-expert rows: unmasked
            mask[list(dropped[name])] = float("-inf")
            for t in biases:
                assert E in t.shape and t.is_floating_point(), (name, tuple(t.shape))
                seen_biases += 1
                shape = [1] * t.dim()
                shape[list(t.shape).index(E)] = E
                saved.append((t, t.detach().clone()))
                with torch.no_grad():
                    t.add_(mask[:E].view(shape).to(t.dtype))
            modes.append((block, mask_block(block, weight, mask)))
        if ROUTING[family].biases:
            assert seen_biases, f"{family}: no block has {ROUTING[family].biases}"
        yield modes
        for block, mode in modes:
            assert mode.hits > 0, f"{type(block).__name__}: router weight never used in a matmul"
    finally:
        for block, _ in modes:
            block.__dict__.pop("forward", None)
        with torch.no_grad():
            for t, old in saved:
                t.copy_(old)


def masked_block_errors(block, family: str, x, y, kept, groups) -> list[float]:
    """Per group (ascending label), the relative squared error ``sum ||b(x) - y||^2 /
    sum ||y||^2`` of ``block`` routed without the experts outside ``kept``: ``-inf`` added
    to their router logits (:func:`mask_block`) and to the per-expert biases the table
    names. ``x``, ``y``: ``[N, H]``; ``groups``: ``[N]`` integer labels."""
    weight, biases = router_and_biases(block, family)
    E = int(weight.shape[0])
    mask = torch.zeros(E)
    mask[[e for e in range(E) if e not in kept]] = float("-inf")
    saved = [(t, t.detach().clone()) for t in biases]
    mode = mask_block(block, weight, mask)
    try:
        with torch.no_grad():
            for t in biases:
                t.add_(mask.view(t.shape).to(t.dtype))
            out = block(x[None])
    finally:
        block.__dict__.pop("forward")
        with torch.no_grad():
            for t, old in saved:
                t.copy_(old)
    assert mode.hits > 0
    out = (out[0] if isinstance(out, tuple) else out).reshape(x.shape[0], -1).double()
    tok = (out - y.double()).pow(2).sum(-1)
    yy = y.double().pow(2).sum(-1)
    return [
        float(tok[groups == g].sum() / yy[groups == g].sum()) for g in sorted(set(groups.tolist()))
    ]
