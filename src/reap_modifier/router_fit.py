"""Router calibration after a cut: fit one MoE layer's router so that the pruned block
reproduces the unpruned block's output; every expert stays as it is.

After REAP drops experts, each token whose top-k held a dropped expert is sent to the
next-best kept ones with weights that were never fitted for that. For one MoE layer,
given its calibration inputs ``X`` and the *unpruned* block's outputs ``Y`` on them
(captured before the cut, see :mod:`reap_modifier.calibration.block_io`), this module
fits the pruned router's rows so that the pruned block's output ``B(X)`` matches ``Y``:

    minimise  L = sum_t ||B(x_t) - y_t||^2 / sum_t ||y_t||^2     (relative squared error)

over the router ``weight`` (and a linear router's ``bias``), with the experts, the
shared experts and the latent projections frozen, through the model's own routing:
the block's own ``forward`` and router (sigmoid / softmax, score-correction bias,
grouped top-k, renormalisation, routed scaling factor) run unchanged; only the
dispatch to the routed experts is swapped (:func:`differentiable_dispatch`) for one that
computes the selected experts' outputs without gradient and combines them with the
routing weights *with* gradient (every supported family's block output is linear in
the routing weights: ``sum_k w_k f_{e_k}(x)``).

Method (chosen by measurement, see ``docs/router-calibration.md``): full-batch Adam
steps on ``L`` through the selected experts' routing weights, the top-k selection
recomputed by the router at every step (so tokens move between experts as the rows
change), with early stopping on held-out fitting tokens (every 8th token): the fitted
rows are those of the step with the lowest held-out loss, and the cut's rows are kept
when no step lowers it, so a fit never makes the layer-local loss worse on held-out
tokens. Why not a closed-form / second-order step: the map from rows to output is
piecewise (the top-k selection) and, within a selection, non-linear (sigmoid/softmax
and renormalisation); a Gauss-Newton step needs the ``[E*H]^2`` curvature of the
weights (K3: 448 x 7168 rows, a 10^13-entry matrix) or a per-row block approximation
that ignores renormalisation, and a step solved for one selection is invalidated as
soon as the selection moves. Measured on tiny models of each router kind
(``benchmarks/router_fit_tiny.py --lbfgs``, half the experts cut): at 100 iterations
Adam with early stopping reached a lower held-out loss than L-BFGS (quasi-Newton,
strong-Wolfe line search, same loss and parametrisation) on 6 of 6 layers (e.g. K3
0.41 vs 0.50, DeepSeek-V3 0.75 vs 0.79); L-BFGS fits the training tokens as well or
better and is ahead at 20 iterations, but overfits. Each Adam step costs one pass of
the layer's selected experts over the fitting tokens (expert outputs are cached per
token and recomputed only where the selection changed).

The score-correction bias (DeepSeek-V3 / Kimi K3 ``e_score_correction_bias``) only
moves the top-k *selection*, never a routing weight, so it receives no gradient; it is
kept as the cut left it (its kept rows) and the fit reports it as not fitted.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from torch import nn

from .models import MoELayer

__all__ = [
    "FIT_METHOD",
    "FITTED_PARAMS",
    "RouterFitError",
    "RouterFitResult",
    "block_output",
    "differentiable_dispatch",
    "fit_block",
    "fit_router",
    "holdout_rows",
    "relative_error",
    "router_params",
    "router_fit_problem",
    "trainable",
]

FIT_METHOD = "adam-layer-local"
#: router tensors the fit changes (when the router has them)
FITTED_PARAMS = ("weight", "bias")
#: every ``HOLDOUT_EVERY``-th fitting token is held out for early stopping
HOLDOUT_EVERY = 8
_KIMI_ACTIVATIONS = ("sigmoid", "softmax")


class RouterFitError(ValueError):
    """A router the fit cannot express, or fitting data that cannot be used."""


@dataclass
class RouterFitResult:
    """What one layer's fit did (losses are relative squared errors, see :func:`relative_error`)."""

    tokens: int
    steps: int
    best_step: int
    loss_before: float
    loss_after: float
    holdout_before: float
    holdout_after: float
    fitted: list[str]

    def to_dict(self) -> dict:
        return asdict(self)


def router_fit_problem(layer: MoELayer) -> str | None:
    """Why the fit cannot express ``layer``'s router, or ``None`` when it can."""
    router = layer.router
    weight = getattr(router, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return f"{layer.name}: router {type(router).__name__} has no 2-D `weight`"
    if not weight.is_floating_point():
        return (
            f"{layer.name}: router weight is {weight.dtype} (quantized); the fit needs a "
            "floating-point router (keep the router out of the quantization scheme)"
        )
    if layer.kind == "kimi":
        act = getattr(router, "moe_router_activation_func", None)
        if act not in _KIMI_ACTIVATIONS:
            return f"{layer.name}: router activation {act!r} is not one of {_KIMI_ACTIVATIONS}"
    elif layer.kind != "experts_call":
        return f"{layer.name}: dispatch shape {layer.kind!r} has no differentiable dispatch"
    return None


class _ExpertCache:
    """Selected experts' outputs per (token, slot), recomputed only where the selection moved."""

    def __init__(self) -> None:
        self.ids: torch.Tensor | None = None
        self.outs: torch.Tensor | None = None

    def get(self, x: torch.Tensor, ids: torch.Tensor, one_slot) -> torch.Tensor:
        with torch.no_grad():
            if self.ids is None or self.ids.shape != ids.shape:
                rows = torch.arange(ids.shape[0], device=ids.device)
                self.outs = None
            else:
                rows = (self.ids != ids).any(dim=1).nonzero().flatten()
            if rows.numel():
                sub, sub_ids = x[rows], ids[rows]
                ones = torch.ones(sub_ids.shape[0], 1, dtype=torch.float32, device=x.device)
                new = torch.stack(
                    [one_slot(sub, sub_ids[:, k : k + 1], ones) for k in range(ids.shape[1])],
                    dim=1,
                )
                if self.outs is None:
                    self.outs = new
                else:
                    self.outs[rows] = new.to(self.outs.dtype)
            self.ids = ids.clone()
            return self.outs


@contextmanager
def _instance_attrs(obj: object, **attrs) -> Iterator[None]:
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


@contextmanager
def differentiable_dispatch(layer: MoELayer, cache: _ExpertCache | None = None) -> Iterator[None]:
    """Within the context, ``layer.block(x)`` is differentiable in its routing weights.

    The routed experts are called under ``no_grad`` one top-k slot at a time with weight
    1 (so ``f_e(x)`` is exactly what the model's dispatch computes), and the block gets
    ``sum_k w_k f_k`` with ``w`` carrying gradient. The block's own forward and router
    run unchanged.
    """
    cache = cache if cache is not None else _ExpertCache()
    if layer.kind == "kimi":
        block = layer.block
        original = type(block).moe_infer

        def one_slot(x, ids, ones):
            return original(block, x, ids, ones)

        def dispatch(x, ids, weights):
            outs = cache.get(x, ids, one_slot)
            return (outs.to(weights.dtype) * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)

        # calibrate-all mode dispatches to moe_train
        with _instance_attrs(block, moe_infer=dispatch, moe_train=dispatch):
            yield
    else:
        experts = layer.experts
        original = experts.forward

        def one_slot(x, ids, ones):
            return original(x, ids, ones.to(x.dtype))

        def forward(x, ids, weights):
            outs = cache.get(x, ids, one_slot)
            return (outs.to(weights.dtype) * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)

        with _instance_attrs(experts, forward=forward):
            yield


def _output(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def block_output(layer: MoELayer, inputs: torch.Tensor) -> torch.Tensor:
    """The block's output on ``inputs`` ``[N, H]`` (no gradient), as ``[N, H]``."""
    with torch.no_grad():
        return _output(layer.block(inputs.unsqueeze(0))).reshape(inputs.shape[0], -1)


def relative_error(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``sum ||output - target||^2 / sum ||target||^2`` in float32."""
    diff = output.float() - target.float()
    return diff.pow(2).sum() / target.float().pow(2).sum().clamp_min(1e-30)


def _leaf(block: nn.Module, path: str) -> tuple[nn.Module, str, nn.Module]:
    """``(parent, attribute, module)`` of the block's submodule at dotted ``path``."""
    parent_path, _, attr = path.rpartition(".")
    parent = block.get_submodule(parent_path) if parent_path else block
    return parent, attr, getattr(parent, attr)


def _proxy(module: nn.Module, masters: dict[str, nn.Parameter]) -> nn.Module:
    """A shallow copy of ``module`` whose ``masters`` parameters replace its own (the
    others and its buffers are the module's current tensors)."""
    proxy = copy.copy(module)
    proxy._parameters = {n: masters.get(n, getattr(module, n)) for n in list(module._parameters)}
    proxy._buffers = {n: getattr(module, n) for n in list(module._buffers)}
    # methods bound to the module on the instance (compressed-tensors' offload wraps
    # `forward` so) are bound to the copy instead
    for key, value in list(vars(module).items()):
        if getattr(value, "__self__", None) is module and hasattr(value, "__func__"):
            setattr(proxy, key, value.__func__.__get__(proxy))
    return proxy


@contextmanager
def trainable(
    layer: MoELayer, params: dict[str, list[str]]
) -> Iterator[tuple[dict[str, nn.Parameter], Callable[[], None]]]:
    """For the duration of a fit, the block computes through shallow copies of its
    submodules ``params`` names (``{module path in the block: [parameter names]}``,
    e.g. ``{"gate": ["weight"]}``), whose listed parameters are float32 master
    parameters. The modules themselves are never touched, so offloaded parameters
    (compressed-tensors' offload caches replace ``_parameters``) stay as they are.

    Yields the masters by ``"path.name"`` and ``sync``, which hands the copies the
    masters cast to each tensor's own dtype (differentiably: a bf16 model computes in
    bf16 as it will after the save, while Adam updates float32 masters); call it before
    every forward."""
    block = layer.block
    masters: dict[str, nn.Parameter] = {}
    swaps = []
    for path, names in params.items():
        parent, attr, module = _leaf(block, path)
        own = {n: nn.Parameter(getattr(module, n).detach().float().clone()) for n in names}
        dtypes = {n: getattr(module, n).dtype for n in names}
        proxy = _proxy(module, own)
        swaps.append((parent, attr, module, proxy, own, dtypes))
        masters.update({f"{path}.{n}": p for n, p in own.items()})

    def sync() -> None:
        for _, _, _, proxy, own, dtypes in swaps:
            for n, master in own.items():
                proxy._parameters[n] = master if dtypes[n] == master.dtype else master.to(dtypes[n])

    for parent, attr, _, proxy, _, _ in swaps:
        parent._modules[attr] = proxy
    try:
        yield masters, sync
    finally:
        for parent, attr, module, _, _, _ in reversed(swaps):
            parent._modules[attr] = module


def holdout_rows(tokens: int) -> torch.Tensor:
    """Which of ``tokens`` fitting rows are held out for early stopping (every
    :data:`HOLDOUT_EVERY`-th; the last when there are fewer)."""
    held = torch.zeros(tokens, dtype=torch.bool)
    held[HOLDOUT_EVERY - 1 :: HOLDOUT_EVERY] = True
    if not held.any():
        held[-1] = True
    return held


def router_params(layer: MoELayer) -> dict[str, list[str]]:
    """The router tensors the fit changes (:data:`FITTED_PARAMS` the router has)."""
    router = layer.router
    names = [n for n in FITTED_PARAMS if isinstance(getattr(router, n, None), torch.Tensor)]
    return {layer.router_attr: names}


def fit_router(
    layer: MoELayer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    steps: int = 100,
    lr: float = 1e-2,
) -> tuple[dict[str, torch.Tensor], RouterFitResult]:
    """Fit ``layer``'s (already pruned) router to the unpruned block's outputs.

    :param inputs: ``[N, H]`` the layer's calibration inputs (no padding rows)
    :param targets: ``[N, H]`` the unpruned block's outputs on ``inputs``
    :param steps: Adam steps (full batch over the fitting tokens)
    :param lr: Adam step size relative to the root-mean-square of the router weight
    :returns: the fitted router tensors by attribute name (in the router's dtype; the
        cut's rows when no step lowered the held-out loss) and the fit's record; the
        layer itself is left unchanged
    :raises RouterFitError: the router cannot be expressed, or the shapes disagree
    """
    problem = router_fit_problem(layer)
    if problem is not None:
        raise RouterFitError(problem)
    fitted, result = fit_block(layer, inputs, targets, router_params(layer), steps=steps, lr=lr)
    prefix = f"{layer.router_attr}."
    return {k.removeprefix(prefix): v for k, v in fitted.items()}, result


def fit_block(
    layer: MoELayer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    params: dict[str, list[str]],
    *,
    steps: int = 100,
    lr: float = 1e-2,
) -> tuple[dict[str, torch.Tensor], RouterFitResult]:
    """Fit the block tensors ``params`` (``{module path in the block: [parameter
    names]}``) of an already pruned ``layer`` to the unpruned block's outputs: the
    method of this module (full-batch Adam through the model's own routing, the routed
    experts frozen, held-out early stopping). Each tensor's step size is ``lr`` times its
    own root-mean-square.

    :returns: the fitted tensors by ``"path.name"`` (in each tensor's dtype; the
        current tensors when no step lowered the held-out loss) and the fit's record;
        the layer itself is left unchanged
    :raises RouterFitError: the shapes disagree

    (Over 80 lines: the Adam loop, its held-out early stopping and the final record read
    best as one piece.)
    """
    if inputs.dim() != 2 or inputs.shape != targets.shape or inputs.shape[0] < 2:
        raise RouterFitError(
            f"{layer.name}: inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} "
            "must both be [tokens >= 2, hidden]"
        )
    held = holdout_rows(inputs.shape[0])
    x_fit, y_fit = inputs[~held], targets[~held]
    x_held, y_held = inputs[held], targets[held]
    fit_cache, held_cache = _ExpertCache(), _ExpertCache()

    def loss_on(x, y, cache) -> torch.Tensor:
        sync()
        with differentiable_dispatch(layer, cache):
            return relative_error(_output(layer.block(x.unsqueeze(0))).reshape(y.shape), y)

    dtypes = {n: p.dtype for n, p in _current(layer, params).items()}
    with trainable(layer, params) as (masters, sync):
        # each module's tensors step relative to the size of its weight (a linear
        # router's bias starts at zero)
        scale = {
            n: masters.get(f"{n.rpartition('.')[0]}.weight", p).detach().pow(2).mean().sqrt()
            for n, p in masters.items()
        }
        groups = [
            {"params": [p], "lr": lr * scale[n].clamp_min(1e-8).item()} for n, p in masters.items()
        ]
        optimizer = torch.optim.Adam(groups)
        best = {n: p.detach().clone() for n, p in masters.items()}
        with torch.no_grad():
            held_before = loss_on(x_held, y_held, held_cache).item()
        best_held, best_step, fit_before = held_before, 0, None
        with torch.enable_grad():
            for step in range(1, steps + 1):
                optimizer.zero_grad(set_to_none=True)
                loss = loss_on(x_fit, y_fit, fit_cache)
                if fit_before is None:
                    fit_before = loss.item()
                loss.backward()
                optimizer.step()
                with torch.no_grad():
                    held_now = loss_on(x_held, y_held, held_cache).item()
                if held_now < best_held:
                    best_held, best_step = held_now, step
                    best = {n: p.detach().clone() for n, p in masters.items()}
        fitted = {n: best[n].to(dtypes[n]) for n in masters}
        with torch.no_grad():
            for n in masters:
                masters[n].copy_(fitted[n].float())
            fit_after = loss_on(x_fit, y_fit, _ExpertCache()).item()
            held_after = loss_on(x_held, y_held, _ExpertCache()).item()
            if fit_before is None:
                fit_before = fit_after
    result = RouterFitResult(
        tokens=int(inputs.shape[0]),
        steps=steps,
        best_step=best_step,
        loss_before=float(fit_before),
        loss_after=float(fit_after),
        holdout_before=float(held_before),
        holdout_after=float(held_after),
        fitted=list(masters) if best_step else [],
    )
    return fitted, result


def _current(layer: MoELayer, params: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    block = layer.block
    return {
        f"{p}.{n}": getattr(block.get_submodule(p), n) for p, names in params.items() for n in names
    }
