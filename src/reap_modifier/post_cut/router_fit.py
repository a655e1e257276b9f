"""Router calibration after a cut: fit one MoE layer's router so that the pruned block
reproduces the unpruned block's output; every expert stays as it is.

After REAP drops experts, each token whose top-k held a dropped expert is sent to the
next-best kept ones with weights that were never fitted for that. For one MoE layer,
given its calibration inputs ``X`` and the *unpruned* block's outputs ``Y`` on them
(captured before the cut, see :mod:`reap_modifier.calibration.block_io`), this module
fits the pruned router's rows (the router ``weight``, and a linear router's ``bias``) so
that the pruned block's output ``B(X)`` matches ``Y``, with the experts, the shared
experts and the latent projections frozen, by the fitting engine
(:func:`~.block_fit.fit_block`: the relative squared error through the model's own
routing, full-batch Adam, held-out early stopping; the cut's rows are kept when no step
lowers the held-out loss).

Why not a closed-form / second-order step: the map from rows to output is
piecewise (the top-k selection) and, within a selection, non-linear (sigmoid/softmax
and renormalisation); a Gauss-Newton step needs the ``[E*H]^2`` curvature of the
weights (K3: 448 x 7168 rows, a 10^13-entry matrix) or a per-row block approximation
that ignores renormalisation, and a step solved for one selection is invalidated as
soon as the selection moves. Measured on tiny models of each router kind
(``benchmarks/router_fit_tiny.py --lbfgs``, half the experts cut): at 100 iterations
Adam with early stopping reached a lower held-out loss than L-BFGS (quasi-Newton,
strong-Wolfe line search, same loss and parametrisation) on 6 of 6 layers (e.g. K3
0.41 vs 0.50, DeepSeek-V3 0.75 vs 0.79); L-BFGS fits the training tokens as well or
better and is ahead at 20 iterations, but overfits.

The score-correction bias (DeepSeek-V3 / Kimi K3 ``e_score_correction_bias``) only
moves the top-k *selection*, never a routing weight, so it receives no gradient; it is
kept as the cut left it (its kept rows); the bias fit (:mod:`.bias_fit`) moves it.
"""

from __future__ import annotations

import torch

from ..models import MoELayer
from .block_fit import BlockFitResult, check_rows, fit_block
from .dispatch import dispatch_problem
from .errors import RouterFitError

__all__ = ["FIT_METHOD", "FITTED_PARAMS", "fit_router", "router_fit_problem", "router_params"]

FIT_METHOD = "adam-layer-local"
#: router tensors the fit changes (when the router has them)
FITTED_PARAMS = ("weight", "bias")
_KIMI_ACTIVATIONS = ("sigmoid", "softmax")


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
    problem = dispatch_problem(layer)
    if problem is not None:
        return problem
    if layer.kind == "kimi":
        act = getattr(router, "moe_router_activation_func", None)
        if act not in _KIMI_ACTIVATIONS:
            return f"{layer.name}: router activation {act!r} is not one of {_KIMI_ACTIVATIONS}"
    return None


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
) -> tuple[dict[str, torch.Tensor], BlockFitResult]:
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
    check_rows(layer.name, inputs, targets, 2, RouterFitError)
    fitted, result = fit_block(layer, inputs, targets, router_params(layer), steps=steps, lr=lr)
    prefix = f"{layer.router_attr}."
    return {k.removeprefix(prefix): v for k, v in fitted.items()}, result
