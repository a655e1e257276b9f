"""What the post-cut step refuses before any model work: a router the block-error selection
does not model, a block a component cannot express, no calibration data, another modifier
of the recipe changing the tensors the fits change."""

from __future__ import annotations

from ..models import MoEArchitecture, MoELayer
from .components import COMPONENT
from .errors import PostCutError
from .routing import selection_rule
from .settings import PostCutSettings

__all__ = ["check_post_cut_request", "component_problems"]


def component_problems(component: str, layers: list[MoELayer]) -> list[str]:
    """Why ``component`` cannot be fitted on these layers (empty when it can)."""
    check = COMPONENT[component].problem
    return [p for layer in layers if (p := check(layer))]


def check_post_cut_request(
    state, arch: MoEArchitecture, settings: PostCutSettings, modifier_type: type
) -> None:
    """Refuse, before any model work, a post-cut step that cannot run: a router the
    block-error selection does not model, a block a component cannot express, no
    calibration data, or another modifier of the recipe that also changes the tensors the
    fits change.

    :param modifier_type: the REAP modifier's class (its own instances are not others)
    :raises PostCutError: what cannot run, and what to change
    """
    from compressed_tensors.utils import match_named_modules
    from llmcompressor.core import active_session

    fields, components = settings.fields, settings.components
    if settings.selection == "block_error":
        for layer in arch.layers:
            try:
                selection_rule(layer)
            except PostCutError as exc:
                raise PostCutError(f"selection: block_error cannot choose for {exc}") from exc

    for component in components:
        problems = component_problems(component, arch.layers)
        if problems:
            raise PostCutError(
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
        for path in COMPONENT[c].params(layer)
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
