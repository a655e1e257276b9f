"""``REAPPruningModifier``: router-weighted expert activation pruning (arXiv 2510.13999).

A drop-in superset of llm-compressor 0.14's modifier of the same name: ``sparsity``,
``ignore`` and ``report_path`` keep their meaning; scores, plans, manifests, other
saliency criteria, ``divisible_by`` and seven MoE families are added.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from llmcompressor.core import Event, State
from llmcompressor.modeling.moe.context import get_calibrate_all_experts_flag
from llmcompressor.modifiers import Modifier
from llmcompressor.modifiers.factory import ModifierFactory
from loguru import logger
from pydantic import Field, PrivateAttr, field_validator, model_validator

from . import compat
from .calibration import distributed
from .calibration.observer import SaliencyObserver
from .calibration.packed import PackedCompute, check_module_formats, compressed_modules
from .checkpoint.compressed_save import compressed_source, route_save_through_rewriter
from .checkpoint.manifest import build_manifest, tool_versions
from .fileio import sha256_file, write_json_atomic
from .models import MoEArchitecture, find_moe_architecture
from .models.refusals import check_prunable
from .scores import BASELINE_METHODS, SALIENCY_NAMES, ExpertScores
from .scores.baselines import baseline_saliency, baseline_scores, layer_number, model_fingerprint
from .scores.keep_count import KeepCount, PlanError, compute_keep_count
from .scores.plan import PruningPlan
from .surgery import apply_plan, check_plan_fits
from .wholeness import check_whole

__all__ = ["REAPPruningModifier"]

compat.install()

SaliencyName = Literal[SALIENCY_NAMES]  # calibrated statistics + weight baselines


class REAPPruningModifier(Modifier):
    """
    Prune whole routed experts of every MoE layer by REAP saliency

        ``S_j = mean over tokens routed to j of g_j(x) * ||f_j(x)||_2``

    (``g_j``: the weight the model multiplies expert ``j``'s output by; ``f_j``: the
    expert output, in the latent space for latent MoE). Statistics are observed over
    all calibration batches; on calibration end every layer is cut at the same keep
    count and the model is pruned in memory (experts, router rows, score-correction
    bias, config counts).

    :param sparsity: fraction of experts to drop per layer, in (0, 1)
    :param num_experts_to_keep: experts to keep per layer (instead of ``sparsity``)
    :param divisible_by: round the kept count down to a multiple (e.g. 8 for EP)
    :param saliency: ranking criterion: ``reap`` (default), ``frequency``,
        ``weighted_frequency``, ``ean``, ``ean_mean``, ``max_norm``
    :param ignore: module-name regexes (``re.search``; ``re:`` prefix accepted) of
        MoE blocks to skip; refused if it leaves some MoE layers unpruned
    :param report_path: ``.json`` with ``{layer: [retained original ids]}`` (upstream format)
    :param scores_path: write the raw per-layer statistics (safetensors + metadata)
    :param manifest_path: write ``pruning_manifest.json``
    :param calibration_source: label of the calibration corpus (per-source counts)
    :param scores_in: cut from a precomputed scores file instead of calibrating
    :param plan_in: apply a precomputed plan (``reap cut`` output) instead of calibrating
    :param seed: seed of the ``random`` baseline
    :param dequantize: for a model whose experts are compressed-tensors packed
        (MXFP4 ...): ``layer`` (default) keeps them packed and dequantizes one MoE
        layer's experts at a time while it is computed, ``expert`` one expert
        projection per call (least memory), ``model`` decompresses the whole model
        before calibration (the dense model's memory). Other modifiers in the recipe
        imply ``model``.

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
    ignore: list[str] = Field(default_factory=list)
    report_path: str | None = None
    scores_path: str | None = None
    manifest_path: str | None = None
    calibration_source: str = "default"
    scores_in: str | None = None
    plan_in: str | None = None
    seed: int = 0
    dequantize: Literal["layer", "expert", "model"] = "layer"

    _arch: MoEArchitecture | None = PrivateAttr(default=None)
    _keep: KeepCount | None = PrivateAttr(default=None)
    _observer: SaliencyObserver | None = PrivateAttr(default=None)
    _plan: PruningPlan | None = PrivateAttr(default=None)
    _scores: ExpertScores | None = PrivateAttr(default=None)
    _cpu_group: object | None = PrivateAttr(default=None)
    _calibrate_all: bool | None = PrivateAttr(default=None)
    _packed: PackedCompute | None = PrivateAttr(default=None)

    # -- validation (before any model work) -----------------------------------------

    @field_validator("sparsity")
    @classmethod
    def _check_sparsity(cls, v: float | None) -> float | None:
        if v is not None and not 0.0 < v < 1.0:
            raise ValueError(f"sparsity must be in (0, 1), got {v}")
        return v

    @field_validator("num_experts_to_keep", "divisible_by")
    @classmethod
    def _check_positive(cls, v: int | None, info) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"{info.field_name} must be >= 1, got {v}")
        return v

    @field_validator("report_path", "manifest_path")
    @classmethod
    def _check_json(cls, v: str | None, info) -> str | None:
        if v is not None and not str(v).endswith(".json"):
            raise ValueError(f"{info.field_name} must end with .json, got {v}")
        return v

    @field_validator("scores_path")
    @classmethod
    def _check_scores_suffix(cls, v: str | None) -> str | None:
        if v is not None and not str(v).endswith(".safetensors"):
            raise ValueError(f"scores_path must end with .safetensors, got {v}")
        return v

    @field_validator("scores_in", "plan_in")
    @classmethod
    def _check_input_exists(cls, v: str | None, info) -> str | None:
        if v is not None and not Path(v).is_file():
            raise ValueError(f"{info.field_name} {v!r} does not exist")
        return v

    @model_validator(mode="after")
    def _check_keep_spec(self) -> REAPPruningModifier:
        if self.plan_in is not None:
            given = [
                name
                for name in ("sparsity", "num_experts_to_keep", "divisible_by", "scores_in")
                if getattr(self, name) is not None
            ]
            if given:
                raise ValueError(f"plan_in fixes the kept experts; remove {', '.join(given)}")
        elif (self.sparsity is None) == (self.num_experts_to_keep is None):
            raise ValueError(
                "give exactly one of `sparsity` (fraction to drop) or "
                "`num_experts_to_keep`"
                + (" (both were given)" if self.sparsity is not None else "")
            )
        if self.scores_in is not None and self.saliency in BASELINE_METHODS:
            raise ValueError(
                f"saliency {self.saliency!r} is computed from router weights; drop "
                "scores_in or choose a calibrated saliency"
            )
        if (
            not self.calibrates
            and self.scores_path is not None
            and self.saliency not in BASELINE_METHODS
        ):
            raise ValueError(
                "scores_path writes calibration statistics, but with scores_in/plan_in "
                "nothing is calibrated; remove scores_path"
            )
        self.requires_calibration_data = self.calibrates
        return self

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
        self._cpu_group = distributed.make_cpu_group()
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
            n_group=arch.n_group if arch.group_limited else None,
            topk_group=arch.topk_group if arch.group_limited else None,
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
        return True

    def _prepare_weights(self, model: torch.nn.Module) -> None:
        """Compressed-tensors experts: keep them packed (calibration dequantizes one
        MoE layer or expert at a time) or decompress the whole model (``dequantize:
        model``, or another modifier in the recipe), before any pruning or calibration.

        :raises PackedFormatError: a compressed module's format has no decompressor
        """
        packed = compressed_modules(model)
        if not packed:
            return
        check_module_formats(packed)  # a format nothing can compute: refuse now
        others = self._other_modifiers()
        if self.dequantize == "model" or others:
            why = f"the recipe also runs {', '.join(others)}" if others else "dequantize: model"
            logger.info(f"REAP: decompressing the whole model before calibration ({why})")
            compat.decompress_loaded_model(model)
            return
        if not self.calibrates:
            logger.info("REAP: pruning without calibration: compressed experts stay packed")
            return
        self._packed = PackedCompute(model, self.dequantize)
        self._packed.attach()

    def _other_modifiers(self) -> list[str]:
        from llmcompressor.core import active_session

        recipe = active_session().lifecycle.recipe
        return [
            type(m).__name__
            for m in (recipe.modifiers if recipe is not None else [])
            if not isinstance(m, REAPPruningModifier)
        ]

    def _release_packed(self) -> None:
        if self._packed is not None:
            self._packed.detach()

    def _make_output_dirs(self) -> None:
        for path in (self.report_path, self.scores_path, self.manifest_path):
            if path is not None:
                Path(path).parent.mkdir(parents=True, exist_ok=True)

    def on_calibration_start(self, state: State, event: Event, **kwargs) -> None:
        if self._plan is not None or self._observer is None:
            return
        self._calibrate_all = get_calibrate_all_experts_flag()
        if self._calibrate_all:
            logger.info(
                "REAP: moe_calibrate_all_experts is on; REAP observes routed tokens only "
                "(identical scores either way) — turning it off makes calibration cheaper"
            )
        self._observer.attach()

    def on_calibration_end(self, state: State, event: Event, **kwargs) -> None:
        self.remove_hooks()
        if self._observer is not None:
            self._observer.detach()
        self._release_packed()
        if self._plan is None and self._observer is not None:
            self._decide_and_prune(state.model)

    def on_finalize(self, state: State, **kwargs) -> bool:
        self.remove_hooks()
        if self._observer is not None:
            self._observer.detach()
        self._release_packed()
        if self._plan is None:
            self._decide_and_prune(state.model)
        self._choose_save_path(state.model)
        if self._cpu_group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(group=self._cpu_group)
            self._cpu_group = None
        return True

    # -- decision ------------------------------------------------------------------------

    def _decide_and_prune(self, model: torch.nn.Module) -> None:
        self._observer.reset_pending()
        # what each rank observed, recorded so that drops or double counts show
        per_rank = distributed.gather_counts(self._observer.local_counts(), self._cpu_group)
        # data parallel: every rank holds the global sums before any decision
        distributed.reduce_accumulators(self._observer.accumulators, self._cpu_group)
        scores = self._observer.to_scores(
            self.calibration_source,
            metadata={
                "kind": "calibration",
                "model_fingerprint": self._fingerprint(),
                "model_name_or_path": str(getattr(model, "name_or_path", "") or ""),
                "calibration": {
                    "source": self.calibration_source,
                    "world_size": distributed.world_size(),
                    "samples": sum(r["samples"] for r in per_rank),
                    "tokens": sum(r["tokens"] for r in per_rank),
                    "padding_skipped": sum(r["padding"] for r in per_rank),
                    "ranks": per_rank,
                    "moe_calibrate_all_experts": self._calibrate_all,
                },
                "versions": tool_versions(),
            },
        )
        self._scores = scores
        if scores.total_tokens() == 0:
            raise RuntimeError(self._no_tokens_message(model))
        if self.scores_path is not None and distributed.is_source_process():
            scores.save(self.scores_path)
            logger.info(f"REAP: wrote scores to {self.scores_path}")
        counts = {name: stats["count"] for name, stats in scores.layers.items()}
        self._cut(model, scores.saliency(self.saliency), counts)

    def _no_tokens_message(self, model: torch.nn.Module) -> str:
        """Why no token reached the MoE blocks: no data, or a pipeline that never called them."""
        batches = self._observer.pipeline_batches if self._observer is not None else 0
        if batches:
            family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
            return (
                f"REAP observed no tokens although the sequential pipeline cached {batches} "
                f"calibration batches: it never called the MoE blocks of {family} "
                f"({type(model).__name__}; its traced layers are not the ones holding the "
                'experts). Run oneshot with pipeline="basic".'
            )
        return (
            "REAP observed no tokens: no calibration data reached the MoE layers. "
            "Pass a dataset to oneshot (num_calibration_samples > 0)."
        )

    def _load_scores_in(self) -> ExpertScores:
        """Read ``scores_in`` and check it belongs to this model (before any change)."""
        arch = self._arch
        scores = ExpertScores.load(self.scores_in)
        if scores.num_experts != arch.num_experts:
            raise ValueError(
                f"scores_in {self.scores_in} holds {scores.num_experts} experts per layer; "
                f"the model has {arch.num_experts}"
            )
        if set(scores.layer_names) != set(arch.layer_names):
            missing = sorted(set(arch.layer_names) - set(scores.layer_names))[:3]
            raise ValueError(
                f"scores_in {self.scores_in} does not cover the model's MoE layers "
                f"(missing e.g. {missing}); were the scores made from this model?"
            )
        theirs = scores.metadata.get("model_fingerprint")
        if theirs and theirs != self._fingerprint():
            raise ValueError(
                f"scores_in {self.scores_in} was computed on a model with different "
                "router weights (model_fingerprint mismatch)"
            )
        scores.saliency(self.saliency)  # the criterion exists in this file
        return scores

    def _cut_from_file(self, model: torch.nn.Module, scores: ExpertScores) -> None:
        """``scores_in``: the same cut, from statistics computed elsewhere."""
        self._scores = scores
        counts = {n: s["count"] for n, s in scores.layers.items() if "count" in s}
        self._cut(model, scores.saliency(self.saliency), counts or None)

    def _cut_from_weights(self, model: torch.nn.Module) -> None:
        """Calibration-free baselines from the router weights alone."""
        weights = self._router_weights()
        saliency = baseline_saliency(self.saliency, weights, seed=self.seed)
        if self.scores_path is not None and distributed.is_source_process():
            baseline_scores(self.saliency, weights, seed=self.seed).save(self.scores_path)
        self._cut(model, saliency, None)

    def _cut(
        self,
        model: torch.nn.Module,
        saliency: dict[str, torch.Tensor],
        counts: dict[str, torch.Tensor] | None,
    ) -> None:
        arch = self._arch
        plan = PruningPlan.from_saliency(
            saliency,
            self._keep,
            criterion=self.saliency,
            n_group=arch.n_group if arch.group_limited else None,
            params=self._plan_params(),
            counts=counts,
        )
        # identical on every rank by construction; rank 0's ids are broadcast anyway
        plan.kept = distributed.broadcast_kept(
            plan.kept, arch.layer_names, self._keep.keep, self._cpu_group
        )
        self._apply(model, plan)

    def _apply(self, model: torch.nn.Module, plan: PruningPlan) -> None:
        self._plan = plan
        apply_plan(model, self._arch, plan)
        # before any output is written: every tensor cut, one forward runs (packed
        # experts: the checkpoint rewriter verifies instead of decompressing the model)
        sample = self._observer.sample_ids if self._observer is not None else None
        check_whole(
            model,
            self._arch,
            plan.num_experts,
            sample_ids=sample,
            run_forward=not compressed_modules(model),
        )
        if distributed.is_source_process():
            self._write_outputs(plan)

    def _router_weights(self, layers=None) -> dict[str, torch.Tensor]:
        from compressed_tensors import align_module_device

        weights = {}
        for layer in layers if layers is not None else self._arch.layers:
            with align_module_device(layer.router):
                weights[layer.name] = layer.router_weight().detach().to("cpu").clone()
        return weights

    def _fingerprint(self) -> str:
        # model_fingerprint hashes only the lowest-numbered MoE layer's router: copy
        # just that one (all routers of a K3 are ~2.4 GB in float32)
        first = min(self._arch.layers, key=lambda layer: (layer_number(layer.name), layer.name))
        return model_fingerprint(self._router_weights([first]))

    def _choose_save_path(self, model: torch.nn.Module) -> None:
        """Bit-exact rewrite of a compressed source when only REAP ran, else the
        regular save (with linearized experts repacked so every family reloads)."""
        source = compressed_source(model)
        if source is not None and self._plan is not None:
            others = self._other_modifiers()
            if route_save_through_rewriter(model, self._plan, source, other_modifiers=others):
                return
        compat.repack_linearized_experts(model)

    def _plan_params(self) -> dict:
        return {
            "sparsity": self.sparsity,
            "num_experts_to_keep_requested": self.num_experts_to_keep,
            "divisible_by": self.divisible_by,
            "calibration_source": self.calibration_source if self.calibrates else None,
            "scores_in": self.scores_in,
            "seed": self.seed if self.saliency == "random" else None,
            "tokens": self._scores.metadata.get("tokens") if self._scores else None,
        }

    def _write_outputs(self, plan: PruningPlan) -> None:
        if self.report_path is not None:
            write_json_atomic(self.report_path, plan.kept)
        if self.manifest_path is not None:
            scores_file = self.scores_in or self.scores_path
            scores_ref = None
            if scores_file is not None and Path(scores_file).is_file():
                scores_ref = {"path": str(scores_file), "sha256": sha256_file(scores_file)}
            source = "plan " + str(self.plan_in) if self.plan_in else f"saliency {plan.saliency}"
            manifest = build_manifest(
                plan,
                method=f"REAP modifier, in-memory surgery ({source})",
                model_class=self._arch.model_class,
                count_key=self._arch.count_keys[0],
                scores=scores_ref,
            )
            write_json_atomic(self.manifest_path, manifest)

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


def _register() -> None:
    ModifierFactory.register("REAPPruningModifier", REAPPruningModifier)


_register()
