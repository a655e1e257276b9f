"""What the post-cut step (:mod:`reap_modifier.post_cut`) refuses before any model work,
and which block tensors each of its components changes."""

from __future__ import annotations

from .compensation import compensation_problem, dense_params
from .models import MoEArchitecture, MoELayer
from .router_fit import RouterFitError, router_fit_problem, router_params

__all__ = ["check_post_cut_request", "component_problems", "params_of"]


def _bias_params(layer: MoELayer) -> dict[str, list[str]]:
    from .bias_fit import BIAS_ATTR

    return {layer.router_attr: [BIAS_ATTR]}


def params_of(component: str, layer: MoELayer) -> dict[str, list[str]]:
    if component == "router":
        return router_params(layer)
    if component == "bias":
        return _bias_params(layer)
    return dense_params(layer)


def component_problems(component: str, layers: list[MoELayer]) -> list[str]:
    """Why ``component`` cannot be fitted on these layers (empty when it can)."""
    if component == "router":
        check = router_fit_problem
    elif component == "bias":
        from .bias_fit import bias_fit_problem as check
    else:
        check = compensation_problem
    return [p for layer in layers if (p := check(layer))]


def check_post_cut_request(
    state,
    arch: MoEArchitecture,
    components: list[str],
    fields: str,
    modifier_type: type,
    selection: str = "saliency",
) -> None:
    """Refuse, before any model work, a post-cut step that cannot run: a router the
    block-error selection does not model, a block a component cannot express, no
    calibration data, or another modifier of the recipe that also changes the tensors the
    fits change.

    :param fields: the recipe fields that asked for the fit (for the messages)
    """
    from compressed_tensors.utils import match_named_modules
    from llmcompressor.core import active_session

    if selection == "block_error":
        from .block_routing import BlockSelectionError, routing_rule

        for layer in arch.layers:
            try:
                routing_rule(layer)
            except BlockSelectionError as exc:
                raise ValueError(f"selection: block_error cannot choose for {exc}") from exc

    for component in components:
        problems = component_problems(component, arch.layers)
        if problems:
            raise RouterFitError(
                f"{fields} cannot fit these blocks ({component}): "
                + "; ".join(problems[:3])
                + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
                + f"; remove the field that asks for {component!r}"
            )
    if getattr(state.data, "calib", None) is None:
        raise ValueError(
            f"{fields} fit(s) on calibration data, but oneshot got none: pass a dataset "
            f"(num_calibration_samples > 0) or remove {fields}"
        )
    recipe = active_session().lifecycle.recipe
    fitted = {
        f"{layer.name}.{path}"
        for layer in arch.layers
        for c in components
        for path in (params_of(c, layer) if c != "bias" else {layer.router_attr: []})
    }
    for other in recipe.modifiers if recipe is not None else []:
        targets = getattr(other, "targets", None)
        if isinstance(other, modifier_type) or not targets:
            continue
        targets = [targets] if isinstance(targets, str) else list(targets)
        ignore = list(getattr(other, "ignore", None) or [])
        hit = sorted(
            name for name, _ in match_named_modules(state.model, targets, ignore) if name in fitted
        )
        if hit:
            raise ValueError(
                f"{fields} fit(s) {hit[0]}"
                + (f" and {len(hit) - 1} more" if len(hit) > 1 else "")
                + f", but {type(other).__name__} in the recipe also changes them (targets "
                f"{targets}); add them to its `ignore` (e.g. 're:.*gate$') or remove {fields}"
            )
