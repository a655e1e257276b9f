"""The rules a ``REAPPruningModifier`` recipe must follow, checked before any model work.

Each field rule is one function the modifier's pydantic validators call; ``check_recipe``
holds the rules between fields (which inputs exclude which, which options need which).
Every refusal is a ``ValueError`` whose message says what to change (pydantic reports it
as the recipe's validation error).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from .post_cut import stage_fields
from .scores import BASELINE_METHODS
from .scores.keep_count import check_keep_spec

__all__ = [
    "check_input_exists",
    "check_json_suffix",
    "check_positive",
    "check_recipe",
    "check_scores_suffix",
    "check_sparsity",
]


def check_sparsity(v: float | None) -> float | None:
    if v is not None and not 0.0 < v < 1.0:
        raise ValueError(f"sparsity must be in (0, 1), got {v}")
    return v


def check_positive(v: int | None, field: str) -> int | None:
    if v is not None and v < 1:
        raise ValueError(f"{field} must be >= 1, got {v}")
    return v


def check_json_suffix(v: str | None, field: str) -> str | None:
    if v is not None and not str(v).endswith(".json"):
        raise ValueError(f"{field} must end with .json, got {v}")
    return v


def check_scores_suffix(v: str | None) -> str | None:
    if v is not None and not str(v).endswith(".safetensors"):
        raise ValueError(f"scores_path must end with .safetensors, got {v}")
    return v


def check_input_exists(v: str | None, field: str) -> str | None:
    if v is not None and not Path(v).is_file():
        raise ValueError(f"{field} {v!r} does not exist")
    return v


def check_recipe(recipe: BaseModel) -> None:
    """The rules between fields of ``recipe`` (a ``REAPPruningModifier``): the keep
    count, inputs that replace calibration, options that need calibration or a fit."""
    _check_keep_and_inputs(recipe)
    _check_fit_options(recipe)
    if recipe.checkpoint_dir is not None:
        clash = (
            "nothing is calibrated (scores_in, plan_in or a weight baseline)"
            if not recipe.calibrates
            else "propagate_pruned cuts layers during calibration"
            if recipe.propagate_pruned
            else "fit_spill_dir: with checkpoint_dir the post-cut step's rows are kept there"
            if recipe.fit_spill_dir is not None
            else None
        )
        if clash:
            raise ValueError(f"checkpoint_dir cannot resume this run: {clash}; remove one")


def _check_keep_and_inputs(recipe: BaseModel) -> None:
    """One keep count (or ``plan_in`` alone); what needs calibration refused without it."""
    if recipe.plan_in is not None:
        given = [
            name
            for name in ("sparsity", "num_experts_to_keep", "divisible_by", "scores_in")
            if getattr(recipe, name) is not None
        ]
        if given:
            raise ValueError(f"plan_in fixes the kept experts; remove {', '.join(given)}")
    else:
        check_keep_spec(
            recipe.num_experts_to_keep, recipe.sparsity, "`num_experts_to_keep`", "`sparsity`"
        )
    if recipe.scores_in is not None and recipe.saliency in BASELINE_METHODS:
        raise ValueError(
            f"saliency {recipe.saliency!r} is computed from router weights; drop "
            "scores_in or choose a calibrated saliency"
        )
    if (
        not recipe.calibrates
        and recipe.scores_path is not None
        and recipe.saliency not in BASELINE_METHODS
    ):
        raise ValueError(
            "scores_path writes calibration statistics, but with scores_in/plan_in "
            "nothing is calibrated; remove scores_path"
        )
    if recipe.propagate_pruned and not recipe.calibrates:
        raise ValueError(
            "propagate_pruned cuts layers during calibration, but with scores_in, "
            "plan_in or a weight baseline nothing is calibrated; remove propagate_pruned"
        )


def _check_fit_options(recipe: BaseModel) -> None:
    """The post-cut fits' settings only with a fit, and no fit with ``propagate_pruned``."""
    fit_only = sorted(
        f
        for f in recipe.model_fields_set
        if f.startswith("router_fit_") or f in ("validate_fit", "fit_spill_dir")
    )
    if fit_only and not recipe.fits_after_cut:
        raise ValueError(
            f"{', '.join(fit_only)} only apply with `calibrate_router`, `calibrate_bias` "
            "or `compensate`"
        )
    unused = sorted(f for f in recipe.model_fields_set if f.startswith("compensation_"))
    if unused and not recipe.compensate:
        raise ValueError(f"{', '.join(unused)} only apply with `compensate: true`")
    unused = sorted(f for f in recipe.model_fields_set if f.startswith("selection_"))
    if unused and recipe.selection != "block_error":
        raise ValueError(f"{', '.join(unused)} only apply with `selection: block_error`")
    if recipe.selection == "block_error" and recipe.plan_in is not None:
        raise ValueError("plan_in fixes the kept experts; remove `selection: block_error`")
    if recipe.fits_after_cut and recipe.propagate_pruned:
        raise ValueError(
            f"{stage_fields(recipe)} fit(s) each block against the unpruned block, which "
            "propagate_pruned never sees after the first layer; use one of the two"
        )
