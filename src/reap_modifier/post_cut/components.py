"""The post-cut components, one record each: what a component fits, what it refuses, which
block tensors it changes, and how it fits one layer. The step (:mod:`.step`) fits them in
the order of :data:`~.settings.COMPONENTS` and writes what they return; no component
writes the model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..models import MoELayer
from .bias_fit import FIT_METHOD as BIAS_METHOD
from .bias_fit import bias_fit_problem, fit_bias
from .compensation import compensate, compensation_problem, dense_params
from .router_fit import FIT_METHOD as ROUTER_METHOD
from .router_fit import fit_router, router_fit_problem, router_params
from .routing import BIAS_ATTR
from .settings import PostCutSettings

__all__ = ["COMPONENT", "Component"]

#: a component's fit of one layer: ``(layer, inputs, targets, settings) -> (tensors by
#: "path.name" in the block, the layer's record)``
FitFn = Callable[
    [MoELayer, torch.Tensor, torch.Tensor, PostCutSettings],
    tuple[dict[str, torch.Tensor], dict],
]


@dataclass(frozen=True)
class Component:
    """One post-cut component."""

    name: str
    #: the method, as the record names it
    method: str
    #: why the component cannot fit a layer (``None``: it can)
    problem: Callable[[MoELayer], str | None]
    #: the block tensors it changes, ``{module path in the block: [parameter names]}``
    params: Callable[[MoELayer], dict[str, list[str]]]
    fit: FitFn


def _fit_router(layer, x, y, s: PostCutSettings):
    fitted, result = fit_router(layer, x, y, steps=s.router_steps, lr=s.router_lr)
    return {f"{layer.router_attr}.{k}": v for k, v in fitted.items()}, result.to_dict()


def _fit_bias(layer, x, y, s: PostCutSettings):
    bias, result = fit_bias(layer, x, y)
    return ({} if bias is None else {f"{layer.router_attr}.{BIAS_ATTR}": bias}), result.to_dict()


def _fit_dense(layer, x, y, s: PostCutSettings):
    return compensate(layer, x, y, steps=s.dense_steps, lr=s.dense_lr)


#: every component by name
COMPONENT = {
    "router": Component("router", ROUTER_METHOD, router_fit_problem, router_params, _fit_router),
    "bias": Component(
        "bias",
        BIAS_METHOD,
        bias_fit_problem,
        lambda layer: {layer.router_attr: [BIAS_ATTR]},
        _fit_bias,
    ),
    "dense": Component(
        "dense", f"ridge+{ROUTER_METHOD}", compensation_problem, dense_params, _fit_dense
    ),
}
