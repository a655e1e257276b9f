"""The post-cut step: after REAP's cut, re-choose what the cut keeps and fit what it left
behind, keeping each change only where it makes the model better end to end.

Stages, in order (:class:`PostCutStep`; the modifier calls :meth:`~PostCutStep.select`,
applies the plan it returns, then calls :meth:`~PostCutStep.fit`):

1. **gather rows**: each MoE block's captured unpruned inputs and outputs
   (:mod:`reap_modifier.calibration.block_io`), every rank's in one process's order
   (:mod:`.ranks`);
2. **reference**: the unpruned model's next-token distributions on the held-out
   calibration batches (:mod:`.validation`), recorded before anything changes;
3. **select** (``selection: block_error``): the kept experts re-chosen per layer by the
   block's re-routed output error (:mod:`.block_selection`);
4. **cut**: the modifier applies the plan (its surgery);
5. **components**, in order (:mod:`.components`), each fitted layer by layer on the
   model as the components before it left it: ``router`` the kept router rows
   (:mod:`.router_fit`), ``bias`` the score-correction bias, which moves the selection
   only (:mod:`.bias_fit`), ``dense`` the block's dense tensors: shared expert(s), a latent
   MoE's up-projection, with the router rows (:mod:`.compensation`). After each, the whole
   model's ``KL(unpruned || pruned)`` on the held-out batches is measured; a component is
   kept only when it lowers that KL, otherwise its tensors are put back and the record
   says so;
6. **record**: what the manifest (``router_fit``), ``reap verify --source`` and the log
   show: each component, the KL before and after, whether it was kept and the tensors it
   changed.

Routed expert tensors are never touched. Every k-th calibration batch (k =
:data:`~.settings.HOLDOUT_EVERY_BATCH`, or the number of batches when there are fewer) is
held out from every fit.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from loguru import logger

from ..calibration.block_io import BlockIOCapture, join_chunks, row_positions
from ..calibration.sample_groups import SampleGroups, group_names
from ..models import MoEArchitecture
from ..scores.plan import PruningPlan, retained_mass
from . import ranks
from .block_fit import read_tensors, write_tensors
from .components import COMPONENT
from .settings import PostCutSettings
from .validation import ValidationSet

__all__ = ["PostCutStep"]


class PostCutStep:
    """Runs the post-cut stages for one modifier (see the module docstring).

    :param arch: the located MoE architecture (unpruned)
    :param settings: the recipe's choices
    """

    def __init__(self, arch: MoEArchitecture, settings: PostCutSettings):
        self.arch = arch
        self.settings = settings
        self.capture: BlockIOCapture | None = None
        #: the record (manifest ``router_fit``), once :meth:`fit` ran
        self.record: dict | None = None
        self.selection: dict | None = None
        #: the CPU process group under data parallel (``None``: one process)
        self.group = None
        #: the kept tensors by layer, then ``"path.name"`` in the block
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}
        #: each calibrated sample's group (``selection_groups``)
        self.groups: SampleGroups | None = None
        self._rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._validation: ValidationSet | None = None

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
            s.spill_dir = str(Path(s.spill_dir) / f"rank{ranks.rank(group)}")

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

    # -- stages 1-3: rows, reference, selection (on the unpruned model) ---------------

    def choose(
        self,
        model: torch.nn.Module,
        plan: PruningPlan,
        ranking: dict[str, torch.Tensor],
        overlay: Callable[[], object | None],
    ) -> PruningPlan:
        """Gather the captured rows, record the held-out reference, and (``selection:
        block_error``) re-choose ``plan``'s experts, ``ranking`` (the cut's saliency)
        ordering the candidates; returns the plan to cut, the same on every rank. Call
        on the unpruned model, then cut, then :meth:`fit`.

        :param overlay: makes a packed model computable for the duration of a stage
            (returns an attached object with ``detach``, or ``None``)
        """
        rows, held, groups = self._gather()
        if ranks.rank(self.group) != 0:
            return ranks.share(None, self.group)
        self._rows = rows
        self._validation = self._reference(model, held, overlay)
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
        return ranks.share(plan, self.group)

    def _gather(self):
        """Every rank's rows per layer, held-out samples and (``selection_groups``) the
        group names and each row's group index per layer, in one process's order."""
        capture, s = self.capture, self.settings
        capture.detach()
        labels = None
        if self.groups is not None:
            labels = dict(ranks.gathered(list(capture.labels.items()), self.group))
        rows, positions = {}, {}
        for n in self.arch.layer_names:
            chunks = ranks.gathered(capture.chunks(n), self.group)
            rows[n] = join_chunks(chunks, s.tokens)
            if labels is not None:
                positions[n] = row_positions(chunks, s.tokens)
        held = sorted(ranks.gathered(capture.validation_samples(), self.group), key=lambda h: h[0])
        empty = [n for n, (x, _) in rows.items() if x.shape[0] < 2]
        if empty:
            raise RuntimeError(
                f"the post-cut fit captured no calibration tokens for {empty[0]}: no "
                "calibration data reached the MoE layers (num_calibration_samples > 0)"
            )
        groups = self._row_groups(labels, positions) if ranks.rank(self.group) == 0 else None
        return rows, held, groups

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

    def _reference(self, model, held, overlay) -> ValidationSet | None:
        """The held-out batches and the unpruned model's distributions on them (``None``:
        nothing to validate)."""
        s = self.settings
        if not s.components:
            return None
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
        if validation is not None:
            with _attached(overlay()):
                validation.record_reference(model)
        return validation

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
        (:mod:`reap_modifier.post_cut.block_selection`; with ``groups``, the group names and each
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

    # -- stages 5-6: components and record (on the cut model) ------------------------

    def fit(self, model: torch.nn.Module, overlay: Callable[[], object | None]) -> dict:
        """Fit and validate each component on the cut model; returns the record (the same
        on every rank, as are the kept tensors, :attr:`tensors`)."""
        ranks.barrier(self.group)
        if ranks.rank(self.group) != 0:
            self.record, self.tensors = ranks.share(None, self.group)
            ranks.hold_shared_tensors(self.arch, self.tensors)
            return self.record
        s = self.settings
        if not s.components:
            self.record = {
                "method": None,
                "tokens": s.tokens,
                "components": [],
                "selection": self.selection,
                "layers": {},
            }
        else:
            self.record = self._fit_components(model, overlay)
        self._rows = {}
        ranks.share((self.record, self.tensors), self.group)
        return self.record

    def _fit_components(self, model, overlay) -> dict:
        s, validation = self.settings, self._validation
        components, layers = [], {n: {} for n in self.arch.layer_names}
        changed: dict[str, dict[str, torch.Tensor]] = {n: {} for n in self.arch.layer_names}
        with _attached(overlay()):
            kl_now = validation.kl(model) if validation is not None else None
            kl_cut = kl_now
            for component in s.components:
                entry = self._component(component, model, kl_now, layers, changed)
                components.append(entry)
                if entry["kept"] and entry["kl_after"] is not None:
                    kl_now = entry["kl_after"]
        self.tensors = {n: t for n, t in changed.items() if t}
        return {
            "method": " + ".join(COMPONENT[c].method for c in s.components),
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

    def _component(self, name: str, model, kl_now, layers, changed) -> dict:
        """Fit component ``name`` on every layer, then keep it (its tensors join
        ``changed``) when the held-out KL drops below ``kl_now``, else put its tensors
        back; returns the component's entry of the record."""
        from compressed_tensors import align_module_device
        from tqdm.auto import tqdm

        component, s = COMPONENT[name], self.settings
        saved = {
            layer.name: read_tensors(layer, component.params(layer)) for layer in self.arch.layers
        }
        fitted_now: dict[str, dict[str, torch.Tensor]] = {}
        for layer in tqdm(self.arch.layers, desc=f"REAP post-cut fit: {name}"):
            x, y = self._rows[layer.name]
            with align_module_device(layer.block):
                device = layer.router.weight.device
                tensors, rec = component.fit(layer, x.to(device), y.to(device), s)
            write_tensors(layer, tensors)
            logger.debug(f"REAP post-cut fit {name} {layer.name}: {rec}")
            fitted_now[layer.name] = {k: v.detach().to("cpu") for k, v in tensors.items()}
            layers[layer.name][name] = rec
        validation = self._validation
        kl_after = validation.kl(model) if validation is not None else None
        kept = kl_after is None or kl_after < kl_now
        names = sorted({n for t in fitted_now.values() for n in t})
        if kept:
            for layer_name, tensors in fitted_now.items():
                changed[layer_name].update(tensors)
        else:
            for layer in self.arch.layers:
                write_tensors(layer, saved[layer.name])
                for n in fitted_now[layer.name]:
                    changed[layer.name].pop(n, None)
        logger.info(
            f"REAP post-cut fit: {name} "
            + (
                f"{'kept' if kept else 'DROPPED (no better than without it)'}: "
                f"held-out KL {kl_now:.5g} -> {kl_after:.5g} nats/token"
                if kl_after is not None
                else "kept without validation"
            )
            + f"; tensors per layer: {', '.join(names) or 'none'}"
        )
        return {
            "name": name,
            "method": component.method,
            "kept": kept,
            "kl_before": kl_now,
            "kl_after": kl_after,
            "tensors": names,
        }


class _attached:
    """Context for an already attached overlay (or ``None``): detached on exit."""

    def __init__(self, overlay):
        self.overlay = overlay

    def __enter__(self):
        return self.overlay

    def __exit__(self, *exc):
        if self.overlay is not None:
            self.overlay.detach()
