"""Compensation after a cut: refit the MoE block's dense tensors so that the pruned block
reproduces the unpruned block's output; routed expert tensors are never touched.

Besides its routed experts, a MoE block has dense, always-on tensors: the shared
expert(s) (DeepSeek-V3 / Kimi K3 / GLM ``shared_experts``, Qwen2/3-MoE ``shared_expert``
with its ``shared_expert_gate``, Hunyuan ``shared_mlp``, ...) and, in a latent MoE (Kimi
K3), the projection ``routed_expert_up_proj`` from the experts' latent space back to the
hidden size. After a cut they still compute what the unpruned block needed; refitting
them on the block's captured inputs ``X`` and the unpruned block's outputs ``Y`` (the same
data the router fit uses, :mod:`reap_modifier.calibration.block_io`) absorbs much of what
the dropped experts did. The checkpoint stays standard: the same tensors, new values.

Two steps, both on the pruned block with its current router:

1. **Closed form** (:func:`closed_form`): the block's output is linear in the weight of
   each *output projection* (a shared expert's ``down_proj``, K3's
   ``routed_expert_up_proj``): ``B(x) = r(x) + sum_i c_i(x) W_i a_i(x)``, with ``a_i`` the
   projection's input and ``c_i`` a per-token scale (1, or Qwen's sigmoid shared-expert
   gate). ``r``, ``c_i`` and ``a_i`` are read off the block itself (its forward with the
   projections zeroed, then each one alone), and the linearity is checked, never assumed.
   Ridge least squares (float64) of ``Y - r`` on ``[c_i a_i]`` gives every projection at
   once (one eigendecomposition of the Gram matrix serves every regulariser); the
   regulariser is chosen from a grid by the error on held-out fitting tokens
   (every 8th, as the router fit holds out), and the current weights are kept when no
   solution lowers it.
2. **Gradient** (:func:`compensate`): starting from the closed form, every tensor of the
   shared expert(s), the up-projection and the router rows are fitted together by the
   router fit's method (:func:`~.block_fit.fit_block`: full-batch Adam
   through the model's own routing, experts frozen, held-out early stopping). Measured on
   the bundled model at 50%: held-out layer-local error after the router fit
   0.073-0.142, closed form 0.054-0.106, closed form + gradient 0.029-0.059 (the
   gate and up projections of the shared expert change what it computes, which no
   linear refit can).

Whether a compensated model is better end to end is decided by the post-cut step
(:mod:`.step`) on held-out calibration windows.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..models import MoELayer
from .block_fit import (
    BlockFitResult,
    block_output,
    fit_block,
    holdout_rows,
    relative_error,
    tensors_written,
)
from .dispatch import block_tensor, dispatch_problem
from .errors import CompensationError
from .router_fit import router_fit_problem, router_params

__all__ = [
    "RIDGE_GRID",
    "SHARED_EXPERT_ATTRS",
    "ClosedFormResult",
    "closed_form",
    "compensate",
    "compensation_problem",
    "dense_params",
    "output_projections",
]

#: block attributes that hold shared (always-on) experts, by family
SHARED_EXPERT_ATTRS = ("shared_experts", "shared_expert", "shared_mlp")
#: a latent MoE's projection from the experts' space back to the hidden size (Kimi K3)
LATENT_UP_ATTR = "routed_expert_up_proj"
#: names of a shared expert's output projection
_DOWN_NAMES = ("down_proj", "w2", "fc2")
#: ridge regularisers tried, relative to the mean diagonal of the Gram matrix
RIDGE_GRID = (0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
#: how far from linear a projection's contribution may be (relative; at least four
#: rounding units of the block's dtype), else refused
_LINEAR_TOLERANCE = 1e-3


@dataclass
class ClosedFormResult:
    """One layer's closed-form refit (errors are relative squared errors on held-out
    fitting tokens)."""

    projections: list[str]
    ridge: float | None
    holdout_before: float
    holdout_after: float

    def to_dict(self) -> dict:
        return asdict(self)


def _linears(module: nn.Module, prefix: str) -> dict[str, nn.Module]:
    return {
        f"{prefix}.{name}" if name else prefix: m
        for name, m in module.named_modules()
        if isinstance(getattr(m, "weight", None), torch.Tensor)
        and m.weight.dim() == 2
        and not list(m.children())
    }


def _shared_modules(layer: MoELayer) -> dict[str, nn.Module]:
    """Every weight-bearing leaf of the block's shared expert(s) and their gate
    (``shared_expert_gate``), by path in the block."""
    block, leaves = layer.block, {}
    for attr in (*SHARED_EXPERT_ATTRS, "shared_expert_gate"):
        module = getattr(block, attr, None)
        if isinstance(module, nn.Module):
            leaves.update(_linears(module, attr))
    return leaves


def output_projections(layer: MoELayer) -> list[str]:
    """Paths (in the block) of the dense projections whose output enters the block's
    output: each shared expert's output projection and a latent MoE's up-projection."""
    block, paths = layer.block, []
    for attr in SHARED_EXPERT_ATTRS:
        module = getattr(block, attr, None)
        if isinstance(module, nn.Module):
            paths += [
                f"{attr}.{name}"
                for name in _DOWN_NAMES
                if isinstance(getattr(module, name, None), nn.Linear)
            ]
    if isinstance(getattr(block, LATENT_UP_ATTR, None), nn.Linear):
        paths.append(LATENT_UP_ATTR)
    return paths


def dense_params(layer: MoELayer) -> dict[str, list[str]]:
    """The block tensors compensation fits (``{path: [parameter names]}``): every
    shared-expert tensor, the latent up-projection and, where the router fit can express
    the router (:func:`~.router_fit.router_fit_problem`), its fitted tensors."""
    leaves = _shared_modules(layer)
    up = getattr(layer.block, LATENT_UP_ATTR, None)
    if isinstance(up, nn.Linear):
        leaves[LATENT_UP_ATTR] = up
    params = {
        path: [n for n, p in m.named_parameters(recurse=False) if p.is_floating_point()]
        for path, m in leaves.items()
    }
    if router_fit_problem(layer) is None:  # a router the fit can express moves with them
        params.update(router_params(layer))
    return {p: names for p, names in params.items() if names}


def compensation_problem(layer: MoELayer) -> str | None:
    """Why compensation cannot fit ``layer``, or ``None`` when it can."""
    problem = dispatch_problem(layer)
    if problem is not None:
        return problem
    if not output_projections(layer):
        return (
            f"{layer.name}: {type(layer.block).__name__} has no shared expert or latent "
            "projection to compensate with (the router fit is all there is)"
        )
    for path, names in dense_params(layer).items():
        module = layer.block.get_submodule(path)
        for name in names:
            if not getattr(module, name).is_floating_point():
                return f"{layer.name}: {path}.{name} is quantized; keep it out of the scheme"
    return None


@contextmanager
def _scaled(block: nn.Module, paths: list[str], factors: list[float]):
    """Multiply each projection's output by a factor for the context (a forward hook;
    the weights are never written)."""
    handles = [
        block.get_submodule(p).register_forward_hook(lambda m, a, out, f=f: out * f)
        for p, f in zip(paths, factors)
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _probe(layer: MoELayer, inputs: torch.Tensor, paths: list[str]):
    """``(rest, features, widths)``: the block output with every projection silenced,
    and per projection ``c * [a, 1]`` (``1`` when it has a bias)."""
    block = layer.block
    seen: dict[str, torch.Tensor] = {}
    handles = [
        block.get_submodule(p).register_forward_hook(
            lambda m, a, out, p=p: seen.__setitem__(p, (a[0], out))
        )
        for p in paths
    ]

    def run() -> torch.Tensor:
        out = block(inputs.unsqueeze(0))
        return block_tensor(out).reshape(inputs.shape[0], -1).double()

    try:
        with torch.no_grad():
            with _scaled(block, paths, [0.0] * len(paths)):
                rest = run()
            feats, widths = [], []
            for i, p in enumerate(paths):
                factors = [1.0 if j == i else 0.0 for j in range(len(paths))]
                with _scaled(block, paths, factors):
                    alone = run() - rest
                a, o = seen[p]
                o_dtype = o.dtype
                a = a.reshape(inputs.shape[0], -1).double()
                o = o.reshape(inputs.shape[0], -1).double()
                c = (alone * o).sum(-1) / o.pow(2).sum(-1).clamp_min(1e-300)
                off = (alone - c[:, None] * o).norm() / alone.norm().clamp_min(1e-300)
                # the block computes in its own dtype: bf16 rounding alone leaves ~1e-2
                tolerance = max(_LINEAR_TOLERANCE, 4 * torch.finfo(o_dtype).eps)
                if off > tolerance:
                    raise ValueError(
                        f"{layer.name}: {p}'s output does not enter the block output as a "
                        f"per-token scale (relative residual {off:.2g}); it cannot be refitted "
                        "in closed form"
                    )
                module = block.get_submodule(p)
                parts = [a] + ([torch.ones_like(c)[:, None]] if module.bias is not None else [])
                feats.append(c[:, None] * torch.cat(parts, dim=1))
                widths.append(feats[-1].shape[1])
    finally:
        for h in handles:
            h.remove()
    return rest, torch.cat(feats, dim=1), widths


def closed_form(
    layer: MoELayer, inputs: torch.Tensor, targets: torch.Tensor, grid=RIDGE_GRID
) -> tuple[dict[str, torch.Tensor], ClosedFormResult]:
    """Ridge least-squares refit of the block's output projections (see the module
    docstring), on the pruned block with its current router.

    :returns: the refitted tensors by ``"path.name"`` (each in its own dtype; empty when
        no regulariser lowered the held-out error) and the record
    """
    paths = output_projections(layer)
    rest, feats, widths = _probe(layer, inputs, paths)
    target = targets.double() - rest
    held = holdout_rows(inputs.shape[0])
    f_fit, t_fit, f_held, t_held = feats[~held], target[~held], feats[held], target[held]
    current = []
    block = layer.block
    for p in paths:
        m = block.get_submodule(p)
        current.append(m.weight.double())
        if m.bias is not None:
            current.append(m.bias.double()[:, None])
    w_now = torch.cat(current, dim=1)
    norm = targets[held].double().pow(2).sum().clamp_min(1e-300)

    def held_error(w: torch.Tensor) -> float:
        return ((f_held @ w.T - t_held).pow(2).sum() / norm).item()

    gram, cross = f_fit.T @ f_fit, f_fit.T @ t_fit
    scale = gram.diagonal().mean().clamp_min(1e-300)
    # one eigendecomposition serves every regulariser: (G + r I)^-1 = Q (L + r)^-1 Q^T
    values, vectors = torch.linalg.eigh(gram)
    projected = vectors.T @ cross
    floor = values.max().clamp_min(1e-300) * 1e-12  # rank-deficient directions stay at zero
    before = held_error(w_now)
    best, best_ridge, best_inverse = before, None, None
    held_basis = f_held @ vectors  # each regulariser is scored in the eigenbasis; only the
    for ridge in grid:  # chosen one's weights are formed (K3: 0.45 TFLOP each)
        shifted = values + ridge * scale
        inverse = torch.where(shifted > floor, 1.0 / shifted.clamp_min(floor), 0.0)
        pred = held_basis @ (inverse[:, None] * projected)
        err = ((pred - t_held).pow(2).sum() / norm).item()
        if err < best:
            best, best_ridge, best_inverse = err, ridge, inverse
    best_w = None if best_inverse is None else (vectors @ (best_inverse[:, None] * projected)).T
    tensors: dict[str, torch.Tensor] = {}
    if best_w is not None:
        start = 0
        for p, width in zip(paths, widths):
            m = block.get_submodule(p)
            chunk = best_w[:, start : start + width]
            start += width
            tensors[f"{p}.weight"] = chunk[:, : m.weight.shape[1]].to(m.weight.dtype)
            if m.bias is not None:
                tensors[f"{p}.bias"] = chunk[:, -1].to(m.bias.dtype)
    return tensors, ClosedFormResult(paths, best_ridge, before, best)


def compensate(
    layer: MoELayer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    steps: int = 200,
    lr: float = 0.003,
) -> tuple[dict[str, torch.Tensor], dict]:
    """Closed form, then the gradient fit of every dense tensor of the block and its
    router rows (see the module docstring). The layer is left as it was (the gradient
    step starts from the closed form, written for its duration).

    :returns: the changed tensors by ``"path.name"`` and the record
        (``{"closed_form": ..., "gradient": ...}``)
    :raises CompensationError: a block compensation cannot fit
    """
    problem = compensation_problem(layer)
    if problem is not None:
        raise CompensationError(problem)
    tensors, closed = closed_form(layer, inputs, targets)
    grad: BlockFitResult | None = None
    held = holdout_rows(inputs.shape[0])
    with tensors_written(layer, tensors):
        if steps > 0:
            fitted, grad = fit_block(
                layer, inputs, targets, dense_params(layer), steps=steps, lr=lr
            )
            if grad.best_step:
                tensors.update(fitted)
        with tensors_written(layer, tensors):
            after = relative_error(block_output(layer, inputs[held]), targets[held]).item()
    record = {
        "closed_form": closed.to_dict(),
        "gradient": grad.to_dict() if grad is not None else None,
        "holdout_after": after,
    }
    return {k: v.detach() for k, v in tensors.items()}, record
