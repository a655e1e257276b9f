"""``REAPPruningModifier``: router-weighted expert activation pruning (arXiv 2510.13999).

A drop-in superset of llm-compressor 0.14's modifier of the same name: ``sparsity``
keeps upstream's count and ``report_path`` its format; ``ignore`` matches as upstream's
but is refused when it would leave some MoE layers unpruned; ``propagate_pruned: true``
keeps upstream's experts. Scores, plans, manifests, other saliency criteria,
``divisible_by`` and MoE families beyond upstream's (docs/families.md) are added
(docs/upstream-compatibility.md).
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import torch
from llmcompressor.core import Event, State
from llmcompressor.modifiers import Modifier
from llmcompressor.modifiers.factory import ModifierFactory
from loguru import logger
from pydantic import Field, PrivateAttr, field_validator, model_validator

from . import compat, recipe_rules, registries
from .calibration import distributed
from .calibration.block_io import BlockIOCapture
from .calibration.checkpointing import CalibrationCheckpoint
from .calibration.observer import SaliencyObserver
from .calibration.packed import (
    PackedCompute,
    check_checkpoint_formats,
    compressed_modules,
)
from .calibration.progress import LayerProgress
from .calibration.routed_only import calibrate_all_experts, set_calibrate_all_experts
from .calibration_setup import CalibrationSetup, sample_positions
from .checkpoint.compressed_save import saved_dtypes
from .checkpoint.saved_config import fix_saved_expert_counts, spell_out_scoring_func
from .decision import CutDecision
from .layerwise import LayerwiseCut
from .models import MoEArchitecture, find_moe_architecture
from .models.loading import register_kimi_auto_classes
from .models.refusals import check_prunable
from .outputs import ModifierOutputs
from .post_cut import (
    PostCutSettings,
    PostCutStep,
    asks_post_cut,
    check_post_cut_request,
)
from .scores import BASELINE_METHODS, SALIENCY_NAMES, ExpertScores
from .scores.keep_count import KeepCount, PlanError, compute_keep_count
from .scores.plan import PruningPlan
from .surgery import apply_plan, check_plan_fits
from .wholeness import check_whole

__all__ = ["REAPPruningModifier", "recipe_keeps_experts_packed"]

compat.install()

SaliencyName = Literal[SALIENCY_NAMES]  # calibrated statistics + weight baselines


class REAPPruningModifier(CalibrationSetup, CutDecision, ModifierOutputs, Modifier):
    """
    Prune whole routed experts of every MoE layer by REAP saliency

        ``S_j = mean over tokens routed to j of g_j(x) * ||f_j(x)||_2``

    (``g_j``: the weight the model multiplies expert ``j``'s output by; ``f_j``: the
    expert output, in the latent space for latent MoE). Statistics are observed over
    all calibration batches; on calibration end every layer is cut at the same keep
    count and the model is pruned in memory (experts, router rows, score-correction
    bias, config counts).

    Lifecycle:

    - (construction)
        - refuse a bad recipe before any model work (rules: recipe_rules.py)
    - on_initialize
        - find the MoE layers, refuse what cannot be pruned exactly or fitted, compute
          the keep count
        - keep compressed experts packed or decompress the model (calibration_setup.py)
        - ``plan_in``, ``scores_in`` or a weight baseline: cut now (decision.py)
        - else make the observer (and the resumable checkpoint, the per-layer cut of
          ``propagate_pruned``) and check the sequential trace reaches every MoE block
    - on_calibration_start
        - attach the saliency observer (and the post-cut fits' block capture); turn
          ``moe_calibrate_all_experts`` off when REAP calibrates alone
    - on_sequential_epoch_end
        - report progress; ``propagate_pruned``: cut the layers just calibrated
    - on_calibration_end
        - remove hooks, restore the flag; reduce the statistics over ranks, decide and
          cut every layer (decision.py), write report, scores and manifest
          (outputs.py); with a post-cut step (post_cut/): choose, cut, fit
    - on_finalize
        - the same cut and fits if calibration never ended, then choose the save path
          (outputs.py) and release the process group

    Fields (each with its default and rules in ``docs/recipe.md``):

    :param sparsity: fraction of experts to drop per layer, in (0, 1)
    :param num_experts_to_keep: experts to keep per layer (instead of ``sparsity``)
    :param divisible_by: round the kept count down to a multiple (e.g. 8 for EP)
    :param saliency: ranking criterion: ``reap`` (default), ``frequency``,
        ``weighted_frequency``, ``ean``, ``ean_mean``, ``max_norm``, or a weight baseline
    :param selection: ``saliency`` (default) or ``block_error``: the same count re-chosen
        per layer by the block's re-routed output error (``docs/selection.md``), trying the
        ``selection_candidates`` lowest-ranked experts per step, dropping ``selection_drops``;
        ``selection_groups``: a string column of the calibration dataset naming each
        sample's group, whose worst error is minimised instead of the pooled one
    :param ignore: module-name regexes of MoE blocks to skip (refused if partial)
    :param report_path: ``.json`` ``{layer: [retained original ids]}`` (upstream format)
    :param scores_path: write the raw per-layer statistics (safetensors + metadata)
    :param manifest_path: write ``pruning_manifest.json``
    :param calibration_source: label of the calibration corpus (per-source counts)
    :param scores_in: cut from a precomputed scores file instead of calibrating
    :param plan_in: apply a precomputed plan (``reap cut`` output) instead of calibrating
    :param seed: seed of the ``random`` baseline
    :param dequantize: compressed-tensors experts: ``layer`` (default) keeps them packed
        and dequantizes one MoE layer at a time, ``expert`` one projection per call,
        ``model`` decompresses the whole model first (implied by other modifiers)
    :param propagate_pruned: cut each MoE layer as its sequential calibration epoch ends,
        as llm-compressor's own modifier does (its scores then hold for its own cut only)
    :param calibrate_router: / ``calibrate_bias`` / ``compensate``: the post-cut fits of
        the router rows, the score-correction bias, the dense tensors (``post_cut/``,
        ``docs/router-calibration.md``); they need calibration data also with
        ``scores_in`` / ``plan_in`` / weight baselines
    :param router_fit_tokens: calibration tokens per MoE layer the post-cut step uses;
        ``router_fit_steps`` / ``router_fit_lr``, ``compensation_steps`` /
        ``compensation_lr``: the fits' Adam steps and relative step sizes
    :param validate_fit: keep each fitted component only where it lowers the whole
        model's KL on held-out calibration batches (default)
    :param fit_spill_dir: keep the post-cut step's captured rows on disk
    :param checkpoint_dir: make a sequential calibration resumable: a rerun with the same
        model, recipe and calibration samples resumes after the last complete layer,
        whatever the order they are drawn in (``docs/distributed.md``)

    The calibration-free baselines ``router_l1`` (compressed-tensors'
    MagnitudeExpertPruner criterion), ``router_signed_sum`` and ``random`` rank experts
    from the router weights alone; with them, ``scores_in`` or ``plan_in`` the model is
    pruned in ``on_initialize`` and no calibration data is needed.

    Example recipe::

        REAPPruningModifier:
          sparsity: 0.5
          divisible_by: 8
          scores_path: out/scores.safetensors
          manifest_path: out/pruning_manifest.json
    """

    requires_calibration_data: bool = True

    sparsity: float | None = None
    num_experts_to_keep: int | None = None
    divisible_by: int | None = None
    saliency: SaliencyName = "reap"
    selection: Literal["saliency", "block_error"] = "saliency"
    selection_candidates: int | None = Field(default=64, ge=1)
    selection_drops: int = Field(default=1, ge=1)
    selection_groups: str | None = None
    ignore: list[str] = Field(default_factory=list)
    report_path: str | None = None
    scores_path: str | None = None
    manifest_path: str | None = None
    calibration_source: str = "default"
    scores_in: str | None = None
    plan_in: str | None = None
    seed: int = 0
    dequantize: Literal["layer", "expert", "model"] = "layer"
    propagate_pruned: bool = False
    calibrate_router: bool = False
    router_fit_tokens: int = Field(default=4096, ge=2)
    router_fit_steps: int = Field(default=100, ge=0)
    router_fit_lr: float = Field(default=0.03, gt=0)
    calibrate_bias: bool = False
    compensate: bool = False
    compensation_steps: int = Field(default=200, ge=0)
    compensation_lr: float = Field(default=0.003, gt=0)
    validate_fit: bool = True
    fit_spill_dir: str | None = None
    checkpoint_dir: str | None = None

    _arch: MoEArchitecture | None = PrivateAttr(default=None)
    _keep: KeepCount | None = PrivateAttr(default=None)
    _observer: SaliencyObserver | None = PrivateAttr(default=None)
    _plan: PruningPlan | None = PrivateAttr(default=None)
    _scores: ExpertScores | None = PrivateAttr(default=None)
    _cpu_group: object | None = PrivateAttr(default=None)
    _calibrate_all: bool | None = PrivateAttr(default=None)
    _packed: PackedCompute | None = PrivateAttr(default=None)
    _layerwise: LayerwiseCut | None = PrivateAttr(default=None)
    _source_fingerprint: str | None = PrivateAttr(default=None)
    _restore_calibrate_all: bool | None = PrivateAttr(default=None)
    _post_cut: PostCutStep | None = PrivateAttr(default=None)
    _ranking: dict | None = PrivateAttr(default=None)
    _capture: BlockIOCapture | None = PrivateAttr(default=None)
    _deferred_plan: PruningPlan | None = PrivateAttr(default=None)
    _router_fit: dict | None = PrivateAttr(default=None)
    _fitted_tensors: dict | None = PrivateAttr(default=None)
    _checkpoint: CalibrationCheckpoint | None = PrivateAttr(default=None)
    _progress: LayerProgress | None = PrivateAttr(default=None)
    #: the model whose sequential trace must reach every MoE block (a weak reference)
    _traced_model: object | None = PrivateAttr(default=None)

    # -- validation (before any model work; the rules: recipe_rules.py) ----------------

    @field_validator("sparsity")
    @classmethod
    def _check_sparsity(cls, v: float | None) -> float | None:
        return recipe_rules.check_sparsity(v)

    @field_validator("num_experts_to_keep", "divisible_by")
    @classmethod
    def _check_positive(cls, v: int | None, info) -> int | None:
        return recipe_rules.check_positive(v, info.field_name)

    @field_validator("report_path", "manifest_path")
    @classmethod
    def _check_json(cls, v: str | None, info) -> str | None:
        return recipe_rules.check_json_suffix(v, info.field_name)

    @field_validator("scores_path")
    @classmethod
    def _check_scores_suffix(cls, v: str | None) -> str | None:
        return recipe_rules.check_scores_suffix(v)

    @field_validator("scores_in", "plan_in")
    @classmethod
    def _check_input_exists(cls, v: str | None, info) -> str | None:
        return recipe_rules.check_input_exists(v, info.field_name)

    @model_validator(mode="after")
    def _check_keep_spec(self) -> REAPPruningModifier:
        recipe_rules.check_recipe(self)
        self.requires_calibration_data = self.calibrates or self.fits_after_cut
        return self

    @property
    def fits_after_cut(self) -> bool:
        """Whether the post-cut step runs (a block-error selection, or a fit of the router,
        the bias or the dense tensors): the cut waits for the blocks' captured inputs."""
        return asks_post_cut(self)

    @property
    def calibrates(self) -> bool:
        """Whether this modifier observes calibration data (else it prunes on initialize)."""
        return (
            self.plan_in is None
            and self.scores_in is None
            and self.saliency not in BASELINE_METHODS
        )

    # -- lifecycle -------------------------------------------------------------------

    def on_initialize(self, state: State, **kwargs) -> bool:
        # structure only: works on packed (compressed-tensors) experts
        self._arch = find_moe_architecture(state.model, self.ignore)
        check_prunable(state.model, self._arch)  # routings pruning cannot keep exact
        arch = self._arch
        if self.fits_after_cut:
            self._check_post_cut(state)
        self._cpu_group = distributed.make_cpu_group()
        if self.fits_after_cut:
            loader = state.data.calib
            located = sample_positions(loader, self._cpu_group)
            self._post_cut.locate_samples(located, self._cpu_group, loader)
            self._capture = self._post_cut.make_capture(self.register_hook, state.model)
        if self.plan_in is not None:
            plan = PruningPlan.load(self.plan_in)
            try:
                check_plan_fits(arch, plan)
            except PlanError as exc:
                raise PlanError(f"plan_in {self.plan_in}: {exc}") from exc
            logger.info(f"REAP: applying plan {self.plan_in} ({plan.num_kept} experts per layer)")
            self._prepare_weights(state.model)
            self._make_output_dirs()  # only once the plan is known to fit
            self._apply(state.model, plan)
            return True
        self._keep = compute_keep_count(
            arch.num_experts,
            arch.top_k,
            sparsity=self.sparsity,
            num_experts_to_keep=self.num_experts_to_keep,
            divisible_by=self.divisible_by,
            n_group=arch.n_group,
            topk_group=arch.topk_group,
        )
        logger.info(
            f"REAP: {arch.model_class}: {len(arch.layers)} MoE layers x "
            f"{arch.num_experts} experts (top-{arch.top_k}); keeping {self._keep.keep} "
            f"per layer by {self.saliency!r}"
        )
        scores_in = self._load_scores_in() if self.scores_in is not None else None
        self._prepare_weights(state.model)  # the request is valid: keep packed or decompress
        self._make_output_dirs()  # only once the request is known to be valid
        if scores_in is not None:
            self._cut_from_file(state.model, scores_in)
        elif self.saliency in BASELINE_METHODS:
            self._cut_from_weights(state.model)
        else:
            self._observer = SaliencyObserver(arch, self.register_hook, model=state.model)
            if self.checkpoint_dir is not None:
                self._open_checkpoint(state.model)
            self._progress = LayerProgress(self._cpu_group, self._checkpoint)
            self._check_trace_of(state.model)
            if self.propagate_pruned:
                # the routers change during calibration: fingerprint the unpruned model
                self._source_fingerprint = self._fingerprint()
                self._layerwise = LayerwiseCut(
                    arch, self._observer, self._cut_args(), self._cpu_group
                )
        return True

    def on_calibration_start(self, state: State, event: Event, **kwargs) -> None:
        if self._capture is not None:
            self._capture.attach()
        if self._plan is not None or self._observer is None:
            return
        self._calibrate_all = calibrate_all_experts()
        if self._calibrate_all:
            others = self._other_calibrating_modifiers()
            if not others:
                self._restore_calibrate_all = set_calibrate_all_experts(False)
                self._calibrate_all = False
                logger.info(
                    "REAP: moe_calibrate_all_experts off for this calibration (REAP is the "
                    "only modifier calibrating and observes routed tokens only; identical "
                    "scores either way); restored when it ends"
                )
            else:
                logger.info(
                    f"REAP: moe_calibrate_all_experts left on: {', '.join(others)} also "
                    "calibrate(s) in this pass (REAP's scores are identical either way)"
                )
        self._observer.attach()

    def on_sequential_epoch_end(self, state: State, event: Event, **kwargs) -> None:
        """``propagate_pruned``: cut the layers calibrated in this epoch (those among
        ``kwargs["modules"]``, else those that observed a forward); otherwise nothing:
        every layer is cut at calibration end. ``modules`` may be absent, as upstream.
        Each epoch's progress is reported (tokens/s, ETA)."""
        if self._progress is not None:
            self._progress.layer_done()
        if self._layerwise is not None and self._plan is None:
            self._observer.reset_pending()
            self._layerwise.cut(state.model, self._layerwise.pending(kwargs.get("modules")))

    def on_calibration_end(self, state: State, event: Event, **kwargs) -> None:
        self._restore_calibrate_all_flag()
        self.remove_hooks()
        if self._observer is not None:
            self._observer.detach()
        self._release_packed()
        if self._checkpoint is not None:
            registries.clear_sequential_checkpoint(self._checkpoint)
            self._checkpoint.complete()  # the last layer's statistics, before any decision
        if self._plan is None and self._observer is not None:
            self._decide_and_prune(state.model)
        self._run_post_cut(state.model)

    def on_finalize(self, state: State, **kwargs) -> bool:
        # never restore the calibrate-all flag here: finalize runs after oneshot's own
        # context has put the flag back, and writing it now would leave it set for the process
        self._restore_calibrate_all = None
        registries.remove_traced_subgraphs_listener(self._on_traced)
        if self._checkpoint is not None:
            registries.clear_sequential_checkpoint(self._checkpoint)
        if self._progress is not None:
            self._progress.close()
        self.remove_hooks()
        if self._observer is not None:
            self._observer.detach()
        self._release_packed()
        if self._plan is None and self._deferred_plan is None:
            self._decide_and_prune(state.model)
        self._run_post_cut(state.model)
        self._choose_save_path(state.model)
        if self._cpu_group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(group=self._cpu_group)
            self._cpu_group = None
        return True

    # -- the cut (deciding what to keep: decision.py) --------------------------------

    def _apply(self, model: torch.nn.Module, plan: PruningPlan) -> None:
        if self._capture is not None:
            # post-cut step: cut once the unpruned blocks' outputs are captured
            self._deferred_plan = plan
            return
        self._cut_model(model, plan)
        if distributed.is_source_process():
            self._write_outputs(plan)

    def _cut_model(self, model: torch.nn.Module, plan: PruningPlan) -> None:
        self._plan = plan
        apply_plan(model, self._arch, plan)
        # before any output is written: every tensor cut, one forward runs (packed
        # experts: the checkpoint rewriter verifies instead of decompressing the model)
        self._check_whole(model, plan)

    def _check_whole(self, model: torch.nn.Module, plan: PruningPlan) -> None:
        observer = self._observer
        check_whole(
            model,
            self._arch,
            plan.num_experts,
            sample_ids=observer.sample_ids if observer is not None else None,
            run_forward=not compressed_modules(model),
            block_inputs=observer.block_inputs if observer is not None else None,
        )

    # -- the post-cut step (post_cut/) --------------------------------------------------

    def _check_post_cut(self, state: State) -> None:
        """Refuse what the post-cut step cannot do, before any model work."""
        settings = PostCutSettings.from_recipe(self)
        check_post_cut_request(state, self._arch, settings, type(self))
        self._post_cut = PostCutStep(self._arch, settings)

    def _run_post_cut(self, model: torch.nn.Module) -> None:
        """The post-cut step around the cut deferred until every MoE block's unpruned
        inputs and outputs were captured: choose the plan (a block-error selection may
        re-choose its experts), cut, fit and validate each component; then write the
        outputs, once."""
        step = self._post_cut
        if self._capture is None or self._deferred_plan is None or step is None:
            return
        self._capture = None  # the cut is no longer deferred
        plan, self._deferred_plan = self._deferred_plan, None
        overlay = partial(self._packed_overlay, model)
        try:
            plan = step.choose(model, plan, self._ranking or {}, overlay)
            self._cut_model(model, plan)
            step.settings.saved_dtype = saved_dtypes(model)  # the fits are rounded to it
            self._router_fit = step.fit(model, overlay)
        finally:
            step.close()  # the captured rows and their spilled files, also on failure
        self._fitted_tensors = step.tensors
        if distributed.is_source_process():
            self._write_outputs(plan)  # the manifest records the fit

    @property
    def router_fit(self) -> dict | None:
        """The fit's record (method, tokens, steps, losses per layer), when one ran."""
        return self._router_fit

    # -- accessors for callers and tests --------------------------------------------------

    @property
    def plan(self) -> PruningPlan | None:
        return self._plan

    @property
    def scores(self) -> ExpertScores | None:
        return self._scores

    @property
    def architecture(self) -> MoEArchitecture | None:
        return self._arch

    @property
    def packed(self) -> PackedCompute | None:
        """The packed-experts overlay of the last calibration (its ``stats``), if one ran."""
        return self._packed


def recipe_keeps_experts_packed(recipe) -> bool:
    """Whether ``recipe`` (anything ``oneshot`` accepts) holds only REAP modifiers and
    none of them asks for ``dequantize: model``: then nothing but REAP reads the
    weights and the model can stay packed. Unparseable recipes answer False (upstream
    reports their errors)."""
    if recipe is None:
        return False
    try:
        if isinstance(recipe, REAPPruningModifier):
            modifiers = [recipe]
        elif isinstance(recipe, list) and all(isinstance(m, REAPPruningModifier) for m in recipe):
            modifiers = recipe
        else:
            from llmcompressor.recipe import Recipe

            modifiers = Recipe.create_instance(recipe).modifiers
    except Exception:  # noqa: BLE001 - upstream parses (and reports) it again
        return False
    return bool(modifiers) and all(
        isinstance(m, REAPPruningModifier) and m.dequantize != "model" for m in modifiers
    )


def _register() -> None:
    ModifierFactory.register("REAPPruningModifier", REAPPruningModifier)
    registries.set_packed_load_rule(
        registries.PackedLoadRule(
            keeps_packed=recipe_keeps_experts_packed, check_config=check_checkpoint_formats
        )
    )
    registries.add_saved_config_fixup(fix_saved_expert_counts)
    registries.add_saved_config_fixup(spell_out_scoring_func)
    try:
        register_kimi_auto_classes()
    except Exception as exc:  # noqa: BLE001 - K3 support is optional at import
        logger.debug(f"REAP: Kimi K3 auto-class registration skipped: {exc}")


_register()
