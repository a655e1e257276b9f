"""The cut of a ``REAPPruningModifier``: which experts each MoE layer keeps, decided from
calibration statistics (``_decide_and_prune``, or layer by layer with
``propagate_pruned``), a scores file (``scores_in``) or the router weights alone (the
calibration-free baselines), then applied through the modifier's ``_apply``.

``CutDecision`` is a mixin of the modifier: its methods read the recipe's fields and the
modifier's state (``_arch``, ``_keep``, ``_observer``, ``_layerwise``, ``_cpu_group``,
``_scores``, ``_plan``, ``_calibrate_all``, ``_source_fingerprint``) and call its
``_apply``, ``_check_whole``, ``_plan_params`` and ``_write_outputs``.
"""

from __future__ import annotations

import torch
from loguru import logger

from .calibration import distributed
from .checkpoint.manifest import tool_versions
from .layerwise import LayerwiseCut
from .scores import ExpertScores
from .scores.baselines import baseline_saliency, baseline_scores, layer_number, model_fingerprint
from .scores.belongs import ModelFacts, check_scores_belong, routed_counts
from .scores.keep_count import PlanError
from .scores.plan import check_propagated_cut, cut_plan
from .surgery import update_config_counts

__all__ = ["CutDecision"]


class CutDecision:
    """Decide the kept experts and cut (a mixin of ``REAPPruningModifier``)."""

    def _decide_and_prune(self, model: torch.nn.Module) -> None:
        """Calibration is over: reduce the statistics over ranks, record them (and
        write ``scores_path``), then cut every layer not cut yet."""
        self._observer.reset_pending()
        layerwise = self._layerwise
        # what each rank observed, recorded so that drops or double counts show
        local = (layerwise.local_counts if layerwise else None) or self._observer.local_counts()
        per_rank = distributed.gather_counts(local, self._cpu_group)
        if layerwise is None:
            # data parallel: every rank holds the global sums before any decision
            distributed.reduce_accumulators(self._observer.accumulators, self._cpu_group)
        else:  # layers no epoch cut (reduced as they are cut)
            done = layerwise.cut_layers
            layerwise.cut(model, [n for n in self._arch.layer_names if n not in done])
        scores = self._observer.to_scores(
            self.calibration_source,
            metadata={
                "kind": "calibration",
                "model_fingerprint": self._source_fingerprint or self._fingerprint(),
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
                "propagate_pruned": layerwise.record() if layerwise else None,
            },
        )
        self._scores = scores
        if scores.total_tokens() == 0:
            raise RuntimeError(self._no_tokens_message(model))
        if self.scores_path is not None and distributed.is_source_process():
            scores.save(self.scores_path)
            logger.info(f"REAP: wrote scores to {self.scores_path}")
        if layerwise is not None:
            self._finish_layerwise(model, layerwise)
            return
        counts = {name: stats["count"] for name, stats in scores.layers.items()}
        self._cut(model, scores.saliency(self.saliency), counts)

    def _finish_layerwise(self, model: torch.nn.Module, layerwise: LayerwiseCut) -> None:
        """Every layer is pruned: join the pieces, update the config counts, write."""
        plan = layerwise.plan()
        plan.params.update(self._plan_params())  # with the observed token counts
        arch = self._arch
        update_config_counts(arch.config, arch.count_keys, plan.num_kept)
        arch.num_experts = plan.num_kept
        self._plan = plan
        self._check_whole(model, plan)
        if layerwise.record() is None:
            logger.info(
                "REAP: propagate_pruned: the whole model was one calibration epoch (basic "
                "pipeline), so every layer was observed on the unpruned model"
            )
        logger.info(
            f"REAP: pruned {len(arch.layers)} MoE layers to {plan.num_kept} of "
            f"{plan.num_experts} experts, each as its calibration epoch ended"
        )
        if distributed.is_source_process():
            self._write_outputs(plan)

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
        facts = ModelFacts(
            num_experts=arch.num_experts,
            layers=tuple(arch.layer_names),
            top_k=arch.top_k,
            n_group=arch.n_group,
            topk_group=arch.topk_group,
            fingerprint=self._fingerprint,
        )
        check_scores_belong(scores, facts, f"scores_in {self.scores_in}")
        scores.saliency(self.saliency)  # the criterion exists in this file
        propagated = scores.metadata.get("propagate_pruned")
        if propagated:
            try:
                check_propagated_cut(propagated, self._keep.keep, self.saliency)
            except PlanError as exc:
                raise PlanError(f"scores_in {self.scores_in}: {exc}") from exc
        return scores

    def _cut_from_file(self, model: torch.nn.Module, scores: ExpertScores) -> None:
        """``scores_in``: the same cut, from statistics computed elsewhere."""
        self._scores = scores
        propagated = scores.metadata.get("propagate_pruned")
        self._cut(model, scores.saliency(self.saliency), routed_counts(scores), propagated)

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
        propagated: dict | None = None,
    ) -> None:
        arch = self._arch
        self._ranking = saliency  # the candidate order of a block-error selection
        plan = cut_plan(saliency, counts, log=False, propagated=propagated, **self._cut_args())
        # identical on every rank by construction; rank 0's ids are broadcast anyway
        plan.kept = distributed.broadcast_kept(
            plan.kept, arch.layer_names, self._keep.keep, self._cpu_group
        )
        self._apply(model, plan)

    def _cut_args(self) -> dict:
        """Keyword arguments of :func:`cut_plan` for this recipe (its count is logged
        by ``on_initialize``)."""
        arch = self._arch
        return {
            "num_experts": arch.num_experts,
            "top_k": arch.top_k,
            "groups": (arch.n_group, arch.topk_group),
            "sparsity": self.sparsity,
            "keep": self.num_experts_to_keep,
            "divisible_by": self.divisible_by,
            "criterion": self.saliency,
            "params": self._plan_params(),
        }

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
