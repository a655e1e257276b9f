"""What a recipe asks of the post-cut step: the one table from recipe fields to stages
(:data:`STAGES`), and :class:`PostCutSettings`, the step's settings read from a
``REAPPruningModifier``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "COMPONENTS",
    "HOLDOUT_EVERY_BATCH",
    "STAGES",
    "PostCutSettings",
    "Stage",
    "asks_post_cut",
    "stage_fields",
]

#: every k-th calibration batch is held out to validate the fits
HOLDOUT_EVERY_BATCH = 8


@dataclass(frozen=True)
class Stage:
    """One stage a recipe field turns on."""

    #: the stage's name (a component's name in the record)
    name: str
    #: the recipe field, as a recipe names it
    label: str
    #: whether a recipe asks for the stage
    asked: Callable[[object], bool] = field(repr=False)


#: recipe field -> stage; the fitted components are those after the selection, in order
STAGES = (
    Stage("router", "calibrate_router", lambda r: r.calibrate_router),
    Stage("bias", "calibrate_bias", lambda r: r.calibrate_bias),
    Stage("dense", "compensate", lambda r: r.compensate),
    Stage("selection", "selection: block_error", lambda r: r.selection == "block_error"),
)
#: the post-cut components, in the order they are fitted
COMPONENTS = tuple(s.name for s in STAGES if s.name != "selection")


def asks_post_cut(recipe) -> bool:
    """Whether ``recipe`` asks for any post-cut stage (the cut then waits for the blocks'
    captured inputs)."""
    return any(s.asked(recipe) for s in STAGES)


def stage_fields(recipe) -> str:
    """The post-cut fields ``recipe`` turns on, as a recipe names them (for messages)."""
    return " / ".join(s.label for s in STAGES if s.asked(recipe))


@dataclass
class PostCutSettings:
    """What the recipe asked of the post-cut step."""

    components: list[str]
    tokens: int
    router_steps: int
    router_lr: float
    dense_steps: int
    dense_lr: float
    validate: bool = True
    spill_dir: str | None = None
    #: ``checkpoint_dir``: the rows spilled there and kept, each stage's per-layer result
    #: written as it finishes (:mod:`.resume`)
    resume_dir: str | None = None
    #: calibration samples one process would run (all ranks together; ``None``: unknown)
    samples: int | None = None
    #: samples per calibration batch
    batch_size: int = 1
    #: this rank's sample -> its position in one process's order (``None``: the same)
    position: Callable[[int], int] | None = None
    #: ``"block_error"``: re-choose the kept experts before the fits
    selection: str = "saliency"
    selection_candidates: int | None = 64
    selection_drops: int = 1
    #: a string column of the calibration dataset naming each sample's group: the
    #: block-error selection minimises the worst group's error (``None``: pooled)
    selection_groups: str | None = None
    #: the recipe fields that asked for the step (for messages)
    fields: str = ""
    #: ``(MoE layer name, tensor name in the block) -> dtype`` a fitted tensor is saved in
    #: (``None``, or a ``None`` answer: as in memory); the fits are rounded to it
    saved_dtype: Callable[[str, str], object] | None = field(default=None, repr=False)

    @classmethod
    def from_recipe(cls, recipe) -> PostCutSettings:
        """The settings a ``REAPPruningModifier`` asks for."""
        return cls(
            components=[s.name for s in STAGES if s.name in COMPONENTS and s.asked(recipe)],
            tokens=recipe.router_fit_tokens,
            router_steps=recipe.router_fit_steps,
            router_lr=recipe.router_fit_lr,
            dense_steps=recipe.compensation_steps,
            dense_lr=recipe.compensation_lr,
            validate=recipe.validate_fit,
            spill_dir=recipe.fit_spill_dir
            if recipe.checkpoint_dir is None
            else str(Path(recipe.checkpoint_dir) / "post_cut"),
            resume_dir=None
            if recipe.checkpoint_dir is None
            else str(Path(recipe.checkpoint_dir) / "post_cut"),
            selection=recipe.selection,
            selection_candidates=recipe.selection_candidates,
            selection_drops=recipe.selection_drops,
            selection_groups=recipe.selection_groups,
            fields=stage_fields(recipe),
        )

    @property
    def holdout_every(self) -> int | None:
        """Every how many calibration batches one is held out (``None``: no validation)."""
        if not self.validate:
            return None
        if self.samples is None:
            return HOLDOUT_EVERY_BATCH
        batches = -(-self.samples // self.batch_size)
        return min(HOLDOUT_EVERY_BATCH, batches) if batches >= 2 else None
