"""The post-cut step: after REAP's cut, fit what the cut left behind, and keep a fitted
component only where it makes the model better end to end.

Components, in order (each fitted layer by layer on the MoE blocks' captured unpruned
inputs and outputs, :mod:`reap_modifier.calibration.block_io`, on the model as the
components before it left it):

``router``  the kept router rows (:mod:`reap_modifier.router_fit`);
``bias``    the score-correction bias, which moves the selection only
            (:mod:`reap_modifier.bias_fit`);
``dense``   the block's dense tensors: shared expert(s), a latent MoE's up-projection,
            with the router rows (:mod:`reap_modifier.compensation`).

Routed expert tensors are never touched. **Never worse than the cut alone:** every k-th
calibration batch (k = :data:`HOLDOUT_EVERY_BATCH`, or the number of batches when there
are fewer) is held out from every fit; the
unpruned model's next-token distributions on those batches are computed before the cut,
and after each component the whole model's ``KL(unpruned || pruned)`` on them is measured.
A component is kept only when it lowers that KL; otherwise its tensors are put back and
the record says so. The record (manifest ``router_fit``, ``reap verify --source``, the
log) lists each component, the KL before and after, whether it was kept and the tensors
it changed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from loguru import logger

from .calibration.block_io import BlockIOCapture, join_chunks, row_positions
from .calibration.sample_groups import SampleGroups, group_names
from .compensation import assign_tensors, compensate
from .fit_validation import ValidationSet
from .models import MoEArchitecture, MoELayer
from .post_cut_rules import check_post_cut_request, component_problems, params_of
from .router_fit import (
    FIT_METHOD,
    fit_router,
)
from .scores.plan import PruningPlan, retained_mass

__all__ = [
    "COMPONENTS",
    "HOLDOUT_EVERY_BATCH",
    "FitSettings",
    "PostCutFit",
    "ValidationSet",
    "check_post_cut_request",
    "component_problems",
]

#: the post-cut components, in the order they are fitted
COMPONENTS = ("router", "bias", "dense")
#: every k-th calibration batch is held out to validate the fits
HOLDOUT_EVERY_BATCH = 8


@dataclass
class FitSettings:
    """What the recipe asked of the post-cut step."""

    components: list[str]
    tokens: int
    router_steps: int
    router_lr: float
    dense_steps: int
    dense_lr: float
    validate: bool = True
    spill_dir: str | None = None
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

    @classmethod
    def from_recipe(cls, recipe, **data) -> FitSettings:
        """The settings a ``REAPPruningModifier`` asks for."""
        on = (recipe.calibrate_router, recipe.calibrate_bias, recipe.compensate)
        return cls(
            components=[c for c, wanted in zip(COMPONENTS, on, strict=True) if wanted],
            tokens=recipe.router_fit_tokens,
            router_steps=recipe.router_fit_steps,
            router_lr=recipe.router_fit_lr,
            dense_steps=recipe.compensation_steps,
            dense_lr=recipe.compensation_lr,
            validate=recipe.validate_fit,
            spill_dir=recipe.fit_spill_dir,
            **data,
            selection=recipe.selection,
            selection_candidates=recipe.selection_candidates,
            selection_drops=recipe.selection_drops,
            selection_groups=recipe.selection_groups,
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


class PostCutFit:
    """Drives the post-cut components for one modifier (see the module docstring).

    :param arch: the located MoE architecture (unpruned)
    :param settings: the recipe's choices
    """

    def __init__(self, arch: MoEArchitecture, settings: FitSettings):
        self.arch = arch
        self.settings = settings
        self.capture: BlockIOCapture | None = None
        self.record: dict | None = None
        self.selection: dict | None = None
        #: the CPU process group under data parallel (``None``: one process)
        self.group = None
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}
        #: each calibrated sample's group (``selection_groups``)
        self.groups: SampleGroups | None = None

    def locate_samples(self, located: dict, group, loader=None) -> None:
        """Where this rank's samples stand in one process's order
        (:func:`~reap_modifier.calibration_setup.sample_positions`), the process group
        whose ranks' rows are gathered before the fits, and (``selection_groups``) the
        group of each sample ``loader`` draws.

        :raises ValueError: the ``selection_groups`` column cannot label the samples
        """
        s = self.settings
        if s.selection_groups is not None:
            self.groups = SampleGroups(loader, s.selection_groups)
        s.position, s.samples, s.batch_size = (
            located["position"],
            located["samples"],
            located["batch_size"],
        )
        self.group = group
        if group is not None and s.spill_dir is not None:  # one folder per rank
            s.spill_dir = str(Path(s.spill_dir) / f"rank{self._rank()}")

    def make_capture(self, register_hook, model: torch.nn.Module) -> BlockIOCapture:
        s = self.settings
        self.capture = BlockIOCapture(
            self.arch,
            register_hook,
            s.tokens,
            model=model,
            holdout_every=s.holdout_every,
            spill_dir=s.spill_dir,
            position=s.position,
            batch_size=s.batch_size,
            label_of=self.groups.label if self.groups is not None else None,
        )
        return self.capture

    def run(
        self,
        model: torch.nn.Module,
        plan: PruningPlan,
        ranking: dict[str, torch.Tensor],
        apply_plan: Callable[[PruningPlan], None],
        overlay: Callable[[], object | None],
    ) -> None:
        """Cut (``apply_plan``; with ``selection: block_error`` the plan's experts re-chosen
        first, ``ranking`` ordering the candidates), then fit and validate each component.

        :param overlay: makes a packed model computable for the duration of a fit
            (returns an attached object with ``detach``, or ``None``)
        """

        capture, s = self.capture, self.settings
        capture.detach()
        # data parallel: every rank's rows and held-out samples are gathered in the order one
        # process records them; the first rank fits on them alone (the ranks share one copy
        # of the weights in llm-compressor's data-parallel offload, so their writes must not
        # mix) while the others wait, then every rank holds its result
        labels = self._sample_labels(capture)
        rows, positions = {}, {}
        for n in self.arch.layer_names:
            chunks = _gathered(capture.chunks(n), self.group)
            rows[n] = join_chunks(chunks, s.tokens)
            if labels is not None:
                positions[n] = row_positions(chunks, s.tokens)
        held = sorted(_gathered(capture.validation_samples(), self.group), key=lambda h: h[0])
        empty = [n for n, (x, _) in rows.items() if x.shape[0] < 2]
        if empty:
            raise RuntimeError(
                f"the post-cut fit captured no calibration tokens for {empty[0]}: no "
                "calibration data reached the MoE layers (num_calibration_samples > 0)"
            )
        if self._rank() != 0:
            self._follow(apply_plan)
            return
        groups = self._row_groups(labels, positions)
        self._run_first(model, plan, ranking, apply_plan, overlay, rows, held, groups)
        self._share((self.record, self.tensors))

    def _sample_labels(self, capture: BlockIOCapture) -> dict[int, str] | None:
        """Every rank's calibrated samples' groups by position (``None``: no groups)."""
        if self.groups is None:
            return None
        return dict(_gathered(list(capture.labels.items()), self.group))

    def _row_groups(self, labels: dict[int, str] | None, positions: dict[str, torch.Tensor]):
        """``(names, {layer: [N] group index of each captured row})`` from the samples'
        ``labels`` and each row's sample position (``None`` without groups); warns once
        when the rows miss a group of the calibration, or hold one only."""
        if labels is None:
            return None
        first = [labels[p] for p in positions[self.arch.layer_names[0]].tolist()]
        names = group_names(first, set(labels.values()), self.settings.selection_groups)
        index = {g: i for i, g in enumerate(names)}
        ids = {
            n: torch.tensor([index[labels[p]] for p in pos.tolist()], dtype=torch.long)
            for n, pos in positions.items()
        }
        return names, ids

    def _run_first(self, model, plan, ranking, apply_plan, overlay, rows, held, groups) -> None:
        """The post-cut step on the first (or only) rank; ``groups``: the group names and
        each captured row's group index per layer (``None`` without ``selection_groups``)."""
        s = self.settings
        if not s.components:
            self._cut(model, plan, ranking, rows, apply_plan, overlay, groups)
            self.record = {
                "method": None,
                "tokens": s.tokens,
                "components": [],
                "selection": self.selection,
                "layers": {},
            }
            return
        logger.warning(
            "REAP post-cut fit: the fitted tensors follow the calibration text, and the "
            "held-out check uses the same text: a language absent from it can get worse "
            "(fitted on English only, Chinese KL rose 32-43% on the bundled model); "
            "calibrate on every language the model serves"
        )
        validation = ValidationSet([inputs for _, inputs in held]) if s.validate else None
        if validation is not None and not validation.batches:
            logger.warning(
                "REAP post-cut fit: no held-out calibration batch reached the model "
                "(too few batches, or the model takes no input_ids): the fitted components "
                "are kept without an end-to-end check"
            )
            validation = None
        with _attached(overlay()):
            if validation is not None:
                validation.record_reference(model)
        self._cut(model, plan, ranking, rows, apply_plan, overlay, groups)
        components, layers = [], {n: {} for n in self.arch.layer_names}
        changed: dict[str, dict[str, torch.Tensor]] = {n: {} for n in self.arch.layer_names}
        with _attached(overlay()):
            kl_now = validation.kl(model) if validation is not None else None
            kl_cut = kl_now
            for component in s.components:
                entry = self._component(component, model, rows, validation, kl_now, layers, changed)
                components.append(entry)
                if entry["kept"] and entry["kl_after"] is not None:
                    kl_now = entry["kl_after"]
        self.tensors = {n: t for n, t in changed.items() if t}
        self.record = {
            "method": FIT_METHOD,
            "tokens": s.tokens,
            "steps": s.router_steps,
            "lr": s.router_lr,
            "dense_steps": s.dense_steps if "dense" in s.components else None,
            "dense_lr": s.dense_lr if "dense" in s.components else None,
            "validation": None
            if validation is None
            else {
                "holdout_every_batch": s.holdout_every,
                "batches": len(validation.batches),
                "tokens": validation.tokens,
                "kl_cut": kl_cut,
                "kl_final": kl_now,
            },
            "components": components,
            "selection": self.selection,
            "layers": {n: rec.get("router", {}) for n, rec in layers.items()},
            "component_layers": layers,
        }

    def _cut(self, model, plan, ranking, rows, apply_plan, overlay, groups) -> None:
        s = self.settings
        if s.selection == "block_error":
            with _attached(overlay()):
                plan = self.select(
                    plan,
                    ranking,
                    rows,
                    candidates=s.selection_candidates,
                    drops=s.selection_drops,
                    groups=groups,
                )
        self._share(plan)
        apply_plan(plan)
        self._barrier()

    # -- data parallel ----------------------------------------------------------------

    def _rank(self) -> int:
        if self.group is None:
            return 0
        import torch.distributed as dist

        return dist.get_rank(self.group)

    def _share(self, obj):
        """``obj`` of the first rank, on every rank (``obj`` itself in one process)."""
        if self.group is None:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def _barrier(self) -> None:
        if self.group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def _follow(self, apply_plan) -> None:
        """Another rank: cut as the first rank cut, wait for its fits, then hold the
        fitted tensors (written here too unless the ranks share the weights)."""
        from compressed_tensors import align_module_device
        from compressed_tensors.offload import update_offload_parameter

        apply_plan(self._share(None))
        self._barrier()
        self.record, self.tensors = self._share(None)
        for layer in self.arch.layers:
            for name, tensor in self.tensors.get(layer.name, {}).items():
                path, _, attr = name.rpartition(".")
                module = layer.block.get_submodule(path)
                with align_module_device(module):
                    same = torch.equal(getattr(module, attr).detach().to("cpu"), tensor)
                if not same:
                    update_offload_parameter(module, attr, tensor)

    def select(
        self,
        plan: PruningPlan,
        ranking: dict[str, torch.Tensor],
        rows: dict[str, tuple[torch.Tensor, torch.Tensor]],
        *,
        candidates: int | None,
        drops: int,
        groups: tuple[list[str], dict[str, torch.Tensor]] | None = None,
    ) -> PruningPlan:
        """``selection: block_error``: the same keep count as ``plan``, the kept experts
        chosen per layer by greedy elimination on the block's re-routed output error
        (:mod:`reap_modifier.block_selection`; with ``groups``, the group names and each
        row's group index per layer, the worst group's error), ``ranking`` (the cut's
        saliency) ordering the candidates; call on the unpruned model."""
        from compressed_tensors import align_module_device
        from tqdm.auto import tqdm

        from .block_selection import select_by_block_error

        names, row_groups = groups if groups is not None else (None, {})
        keep, kept, records = plan.num_kept, {}, {}
        for layer in tqdm(self.arch.layers, desc="REAP block-error selection"):
            x, y = rows[layer.name]
            ids_of = row_groups.get(layer.name)
            with align_module_device(layer.block):
                device = layer.router.weight.device
                ids, record = select_by_block_error(
                    layer,
                    x.to(device),
                    y.to(device),
                    keep,
                    ranking=ranking.get(layer.name),
                    groups=ids_of.to(device) if ids_of is not None else None,
                    candidates=candidates,
                    drops_per_step=drops,
                    baseline=plan.kept[layer.name],
                )
            kept[layer.name], records[layer.name] = ids, record.to_dict()
            if names is not None:
                errors = records[layer.name]["group_errors"]
                records[layer.name]["group_errors"] = {names[int(g)]: v for g, v in errors.items()}
        retained = {n: retained_mass(ranking[n], ids) for n, ids in kept.items() if n in ranking}
        changed = sum(len(set(kept[n]) - set(plan.kept[n])) for n in kept)
        kept_cut = sorted(n for n, r in records.items() if r["kept_baseline"])
        group_record = None
        if names is not None:
            counts = row_groups[self.arch.layer_names[0]].bincount(minlength=len(names))
            group_record = {
                "column": self.settings.selection_groups,
                "names": names,
                "tokens": dict(zip(names, counts.tolist(), strict=True)),
            }
        logger.info(
            f"REAP block-error selection: {keep} experts per layer; {changed} of "
            f"{keep * len(kept)} kept experts differ from {plan.saliency}'s cut"
            + (f"; {len(kept_cut)} layer(s) keep that cut (no lower error)" if kept_cut else "")
        )
        self.selection = {
            "method": "block_error",
            "candidate_order": plan.saliency,
            "candidates": candidates,
            "drops_per_step": drops,
            "differs_from_ranking": changed,
            "layers_keeping_ranking_cut": kept_cut,
            "objective": "pooled" if names is None else "worst_group",
            "groups": group_record,
            "layers": records,
        }
        return PruningPlan(
            kept=kept,
            num_experts=plan.num_experts,
            saliency="block_error",
            params={**plan.params, "selection": "block_error", "candidate_order": plan.saliency},
            retained=retained,
        )

    def _component(self, component, model, rows, validation, kl_now, layers, changed) -> dict:
        """Fit ``component`` on every layer, then keep it (its tensors join ``changed``)
        when the held-out KL drops below ``kl_now``, else put its tensors back; returns
        the component's entry of the record."""
        from tqdm.auto import tqdm

        saved = {layer.name: self._snapshot(component, layer) for layer in self.arch.layers}
        fitted_now: dict[str, dict[str, torch.Tensor]] = {}
        for layer in tqdm(self.arch.layers, desc=f"REAP post-cut fit: {component}"):
            x, y = rows[layer.name]
            tensors, rec = self._fit(component, layer, x, y)
            fitted_now[layer.name] = tensors
            layers[layer.name][component] = rec
        kl_after = validation.kl(model) if validation is not None else None
        kept = kl_after is None or kl_after < kl_now
        names = sorted({n for t in fitted_now.values() for n in t})
        if kept:
            for name, tensors in fitted_now.items():
                changed[name].update(tensors)
        else:
            for layer in self.arch.layers:
                self._restore(layer, saved[layer.name])
                for n in fitted_now[layer.name]:
                    changed[layer.name].pop(n, None)
        logger.info(
            f"REAP post-cut fit: {component} "
            + (
                f"{'kept' if kept else 'DROPPED (no better than without it)'}: "
                f"held-out KL {kl_now:.5g} -> {kl_after:.5g} nats/token"
                if kl_after is not None
                else "kept without validation"
            )
            + f"; tensors per layer: {', '.join(names) or 'none'}"
        )
        return {
            "name": component,
            "kept": kept,
            "kl_before": kl_now,
            "kl_after": kl_after,
            "tensors": names,
        }

    # -- per component ----------------------------------------------------------------

    def _fit(self, component: str, layer: MoELayer, x: torch.Tensor, y: torch.Tensor):
        from compressed_tensors import align_module_device

        s = self.settings
        with align_module_device(layer.block):
            device = layer.router.weight.device
            x, y = x.to(device), y.to(device)
            if component == "router":
                fitted, result = fit_router(layer, x, y, steps=s.router_steps, lr=s.router_lr)
                tensors = {f"{layer.router_attr}.{k}": v for k, v in fitted.items()}
                rec = result.to_dict()
            elif component == "bias":
                from .bias_fit import BIAS_ATTR, fit_bias

                bias, result = fit_bias(layer, x, y)
                tensors = {} if bias is None else {f"{layer.router_attr}.{BIAS_ATTR}": bias}
                rec = result.to_dict()
            else:
                tensors, rec = compensate(layer, x, y, steps=s.dense_steps, lr=s.dense_lr)
        if component != "dense":  # compensation writes what it fits as it goes
            assign_tensors(layer, tensors)
        logger.debug(f"REAP post-cut fit {component} {layer.name}: {rec}")
        return {k: v.detach().to("cpu") for k, v in tensors.items()}, rec

    def _snapshot(self, component: str, layer: MoELayer) -> dict[str, torch.Tensor]:
        from compressed_tensors import align_module_device

        out = {}
        for path, names in params_of(component, layer).items():
            module = layer.block.get_submodule(path)
            with align_module_device(module):
                for n in names:
                    out[f"{path}.{n}"] = getattr(module, n).detach().to("cpu", copy=True)
        return out

    def _restore(self, layer: MoELayer, saved: dict[str, torch.Tensor]) -> None:
        assign_tensors(layer, saved)


def _gathered(items: list, group) -> list:
    """Every rank's ``items``, concatenated in rank order (``items`` alone without a group)."""
    if group is None:
        return list(items)
    import torch.distributed as dist

    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, list(items), group=group)
    return [item for part in parts for item in part]


class _attached:
    """Context for an already attached overlay (or ``None``): detached on exit."""

    def __init__(self, overlay):
        self.overlay = overlay

    def __enter__(self):
        return self.overlay

    def __exit__(self, *exc):
        if self.overlay is not None:
            self.overlay.detach()
