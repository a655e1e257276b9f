"""Masked routing for any family: the unpruned model with some experts removed from
routing, without a hand-written router per family.

Inside each listed MoE block's forward, a torch-function mode follows the router's
weight (and every cast / view / transpose of it) and adds ``-inf`` to the logits of the
dropped experts wherever that weight enters a matmul; every per-expert routing vector
of the block named ``*bias*`` (router bias, ``e_score_correction_bias``, ``expert_bias``,
``[1, E]`` statics) gets ``-inf`` at the dropped experts for the same forward. So a
softmax router gives them probability 0, a sigmoid router selection score ``-inf``
(their weight is never gathered), and a grouped router scores groups over kept
experts only: the semantics of the hand-written ``oracles.masked_routing``.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = ["generic_masked_routing"]

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


@contextlib.contextmanager
def generic_masked_routing(arch, dropped: dict[str, list[int]]):
    """Route every MoE layer of ``arch`` (a located architecture of the unpruned
    model) as if its ``dropped`` experts did not exist. Asserts each router's weight
    was seen in a matmul."""
    from reap_modifier.wholeness import routing_tensors

    saved, modes = [], []
    try:
        for layer in arch.layers:
            ids = dropped.get(layer.name, [])
            E = int(layer.router_weight().shape[0]) - layer.extra_rows
            mask = torch.zeros(E + layer.extra_rows)  # trailing non-expert rows: unmasked
            mask[list(ids)] = float("-inf")
            for _name, _module, attr, t in routing_tensors(layer):
                if "bias" in attr and t.is_floating_point() and E in t.shape:
                    dim = list(t.shape).index(E)
                    bias_mask = mask[:E]
                    old = t.detach().clone()
                    shape = [1] * t.dim()
                    shape[dim] = E
                    with torch.no_grad():
                        t.add_(bias_mask.view(shape).to(t.dtype))
                    saved.append((t, old))
            mode = _MaskRouterLogits(layer.router_weight(), mask)
            block = layer.block
            inner = block.forward

            def forward(*a, _inner=inner, _mode=mode, **k):
                with _mode:
                    return _inner(*a, **k)

            block.forward = forward
            modes.append((block, mode))
        yield modes
        for block, mode in modes:
            assert mode.hits > 0, f"{type(block).__name__}: router weight never used in a matmul"
    finally:
        for block, _ in modes:
            block.__dict__.pop("forward", None)
        with torch.no_grad():
            for t, old in saved:
                t.copy_(old)
