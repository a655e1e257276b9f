"""The post-cut fitting engine: fit any tensors of an already pruned MoE block so that it
reproduces the unpruned block's output on captured rows, with the routed experts frozen.

For one MoE layer, given its calibration inputs ``X`` and the *unpruned* block's outputs
``Y`` on them (captured before the cut, :mod:`reap_modifier.calibration.block_io`):

    minimise  L = sum_t ||B(x_t) - y_t||^2 / sum_t ||y_t||^2     (relative squared error)

over the block tensors named in ``params``, through the model's own routing: the block's
own ``forward`` and router (sigmoid / softmax, score-correction bias, grouped top-k,
renormalisation, routed scaling factor) run unchanged; only the dispatch to the routed
experts is swapped (:func:`differentiable_dispatch`) for one that computes the selected
experts' outputs without gradient and combines them with the routing weights *with*
gradient (every supported family's block output is linear in the routing weights:
``sum_k w_k f_{e_k}(x)``).

Method (chosen by measurement, see ``docs/router-calibration.md``): full-batch Adam steps
on ``L``, the top-k selection recomputed by the router at every step (so tokens move
between experts as the rows change), with early stopping on held-out fitting rows
(:func:`holdout_rows`): the fitted tensors are those of the step with the lowest held-out
loss, and the current tensors are kept when no step lowers it. Each Adam step costs one
pass of the layer's selected experts over the fitting tokens (expert outputs are cached
per token and recomputed only where the selection changed, :class:`ExpertCache`).

Users: the router fit (:mod:`.router_fit`), compensation's gradient step
(:mod:`.compensation`); the bias fit and the block-error selection use its cache, loss
and row rules.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..models import MoELayer
from .dispatch import block_tensor, routed_dispatch, slot_outputs
from .errors import PostCutError

__all__ = [
    "HOLDOUT_EVERY",
    "BlockFitResult",
    "ExpertCache",
    "FitLosses",
    "block_output",
    "check_rows",
    "differentiable_dispatch",
    "fit_block",
    "holdout_rows",
    "read_tensors",
    "relative_error",
    "tensors_written",
    "trainable",
    "write_tensors",
]

#: every ``HOLDOUT_EVERY``-th fitting row is held out for early stopping
HOLDOUT_EVERY = 8


@dataclass
class FitLosses:
    """A layer fit's losses (relative squared errors, :func:`relative_error`) on its fitting
    and held-out rows, before and after, and the tensors it changed."""

    loss_before: float
    loss_after: float
    holdout_before: float
    holdout_after: float
    fitted: list[str]

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class BlockFitResult(FitLosses):
    """What one layer's gradient fit did."""

    tokens: int
    steps: int
    best_step: int


def check_rows(
    name: str, inputs: torch.Tensor, targets: torch.Tensor, minimum: int, error: type
) -> None:
    """Refuse rows that are not ``[tokens >= minimum, hidden]`` inputs and targets of one
    shape (``error``: the calling stage's error class)."""
    if inputs.dim() != 2 or inputs.shape != targets.shape or inputs.shape[0] < minimum:
        raise error(
            f"{name}: inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} "
            f"must both be [tokens >= {minimum}, hidden]"
        )


class ExpertCache:
    """Selected experts' outputs per (token, slot), recomputed only where the selection moved."""

    def __init__(self) -> None:
        self.ids: torch.Tensor | None = None
        self.outs: torch.Tensor | None = None

    def get(self, x: torch.Tensor, ids: torch.Tensor, slots) -> torch.Tensor:
        """``[N, k, h]`` outputs of ``ids``' experts on ``x``; ``slots``:
        :func:`~.dispatch.slot_outputs` of the layer."""
        with torch.no_grad():
            if self.ids is None or self.ids.shape != ids.shape:
                rows = torch.arange(ids.shape[0], device=ids.device)
                self.outs = None
            else:
                rows = (self.ids != ids).any(dim=1).nonzero().flatten()
            if rows.numel():
                new = slots(x[rows], ids[rows])
                if self.outs is None:
                    self.outs = new
                else:
                    self.outs[rows] = new.to(self.outs.dtype)
            self.ids = ids.clone()
            return self.outs


@contextmanager
def differentiable_dispatch(layer: MoELayer, cache: ExpertCache | None = None) -> Iterator[None]:
    """Within the context, ``layer.block(x)`` is differentiable in its routing weights.

    The routed experts' outputs of every selected (token, slot) are computed under
    ``no_grad`` with weight 1 (:func:`~.dispatch.slot_outputs`), and the block gets
    ``sum_k w_k f_k`` with ``w`` carrying gradient. The block's own forward and router run
    unchanged.
    """
    cache = cache if cache is not None else ExpertCache()
    slot = slot_outputs(layer)

    def dispatch(x, ids, weights):
        outs = cache.get(x, ids, slot)
        return (outs.to(weights.dtype) * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)

    with routed_dispatch(layer, dispatch):
        yield


def block_output(layer: MoELayer, inputs: torch.Tensor) -> torch.Tensor:
    """The block's output on ``inputs`` ``[N, H]`` (no gradient), as ``[N, H]``."""
    with torch.no_grad():
        return block_tensor(layer.block(inputs.unsqueeze(0))).reshape(inputs.shape[0], -1)


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


def read_tensors(layer: MoELayer, params: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """CPU copies of the block tensors ``params`` (``{path: [names]}``) by ``"path.name"``,
    offloaded or not."""
    from compressed_tensors import align_module_device

    out = {}
    for path, names in params.items():
        module = layer.block.get_submodule(path)
        with align_module_device(module):
            for n in names:
                out[f"{path}.{n}"] = getattr(module, n).detach().to("cpu", copy=True)
    return out


def write_tensors(layer: MoELayer, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` (``{"path.name": tensor}``, paths in the block) into ``layer``'s
    block, offloaded or not."""
    from compressed_tensors.offload import update_offload_parameter

    for name, tensor in tensors.items():
        path, _, attr = name.rpartition(".")
        update_offload_parameter(layer.block.get_submodule(path), attr, tensor)


@contextmanager
def tensors_written(layer: MoELayer, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """``tensors`` written into ``layer``'s block for the context, the previous values put
    back on exit."""
    params: dict[str, list[str]] = {}
    for name in tensors:
        path, _, attr = name.rpartition(".")
        params.setdefault(path, []).append(attr)
    saved = read_tensors(layer, params)
    write_tensors(layer, tensors)
    try:
        yield
    finally:
        write_tensors(layer, saved)


def holdout_rows(tokens: int) -> torch.Tensor:
    """Which of ``tokens`` fitting rows are held out for early stopping (every
    :data:`HOLDOUT_EVERY`-th; the last when there are fewer)."""
    held = torch.zeros(tokens, dtype=torch.bool)
    held[HOLDOUT_EVERY - 1 :: HOLDOUT_EVERY] = True
    if not held.any():
        held[-1] = True
    return held


def fit_block(
    layer: MoELayer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    params: dict[str, list[str]],
    *,
    steps: int = 100,
    lr: float = 1e-2,
) -> tuple[dict[str, torch.Tensor], BlockFitResult]:
    """Fit the block tensors ``params`` (``{module path in the block: [parameter
    names]}``) of an already pruned ``layer`` to the unpruned block's outputs: the
    method of this module (full-batch Adam through the model's own routing, the routed
    experts frozen, held-out early stopping). Each tensor's step size is ``lr`` times its
    own root-mean-square.

    :returns: the fitted tensors by ``"path.name"`` (in each tensor's dtype; the
        current tensors when no step lowered the held-out loss) and the fit's record;
        the layer itself is left unchanged
    :raises PostCutError: the shapes disagree

    (Over 80 lines: the Adam loop, its held-out early stopping and the final record read
    best as one piece.)
    """
    check_rows(layer.name, inputs, targets, 2, PostCutError)
    held = holdout_rows(inputs.shape[0])
    x_fit, y_fit = inputs[~held], targets[~held]
    x_held, y_held = inputs[held], targets[held]
    fit_cache, held_cache = ExpertCache(), ExpertCache()

    def loss_on(x, y, cache) -> torch.Tensor:
        sync()
        with differentiable_dispatch(layer, cache):
            return relative_error(block_tensor(layer.block(x.unsqueeze(0))).reshape(y.shape), y)

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
            fit_after = loss_on(x_fit, y_fit, ExpertCache()).item()
            held_after = loss_on(x_held, y_held, ExpertCache()).item()
            if fit_before is None:
                fit_before = fit_after
    result = BlockFitResult(
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
