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
   changed, and this rank's wall time of each stage (``seconds``, the one entry that
   differs between ranks).

Routed expert tensors are never touched. Every k-th calibration batch (k =
:data:`~.settings.HOLDOUT_EVERY_BATCH`, or the number of batches when there are fewer) is
held out from every fit.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from loguru import logger

from ..calibration.block_io import BlockIOCapture
from ..calibration.sample_groups import SampleGroups
from ..models import MoEArchitecture, MoELayer
from ..scores.plan import PruningPlan
from . import ranks
from .block_fit import read_tensors, write_tensors
from .components import COMPONENT
from .gather import gather
from .resume import StageLog
from .rows import RowStore
from .selection import choose, select_layers, selection_plan
from .settings import PostCutSettings
from .validation import HeldOutKL, ValidationSet, keeps

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
        self._rows = RowStore()
        self._validation: ValidationSet | None = None
        #: the held-out samples this rank owns (indices into one process's order), and all
        #: of them: ``(position, inputs, group or None)``
        self._mine: list[int] = []
        self._held: list[tuple] = []
        #: with groups: their names, each owned layer's row group ids, tokens per group
        self._groups: tuple[list[str], dict[str, torch.Tensor]] | None = None
        self._group_record: dict | None = None
        #: each stage's per-layer results on disk (``checkpoint_dir``; else a no-op)
        self.log = StageLog(None)
        #: this rank's wall time of each stage, in seconds (the record's ``seconds``):
        #: ``total`` from :meth:`choose` to the end of :meth:`fit`, the cut included; under
        #: data parallel ``<stage>_wait``, the part spent exchanging results with the other
        #: ranks (waiting for the slowest)
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self._start: float | None = None
        self._stage = ""

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
        if group is not None and s.resume_dir is not None:
            s.resume_dir = str(Path(s.resume_dir) / f"rank{ranks.rank(group)}")
        self.log = StageLog(s.resume_dir)

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
            keep_files=s.resume_dir is not None,
        )
        return self.capture

    def restored(self, done: set[str]) -> None:
        """The calibration checkpoint restored the MoE layers ``done`` (``checkpoint_dir``):
        their captured rows come from disk; a fresh start (none) forgets every earlier
        result of this step."""
        self.capture.resume(done)
        if not done:
            self.log.clear()

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
        ordering the candidates, then keep whichever of the two plans is better end to end
        (:mod:`.selection`); returns the plan to cut, the same on every rank. Call on the
        unpruned model, then cut, then :meth:`fit`; under data parallel every rank calls
        both, and each works on the layers and held-out samples it owns (:mod:`.ranks`).

        :param overlay: makes a packed model computable for the duration of a stage
            (returns an attached object with ``detach``, or ``None``)
        """
        self._start = time.perf_counter()
        with self._timed("gather"):
            gathered = gather(
                self.capture, self.arch, self.settings, self.group, self.groups is not None
            )
        self._rows, self._held, self._mine = gathered.rows, gathered.held, gathered.mine
        self._groups, self._group_record = gathered.groups, gathered.group_record
        s = self.settings
        with _attached(overlay()):
            with self._timed("reference"):
                self._validation = self._reference(model)
            if s.selection == "block_error":
                with self._timed("selection"):
                    results = self._shared(
                        "selection",
                        lambda layers: select_layers(
                            layers,
                            plan,
                            ranking,
                            self._rows,
                            candidates=s.selection_candidates,
                            drops=s.selection_drops,
                            groups=self._groups,
                            log=self.log,
                            index=self.arch.layer_names.index,
                        ),
                    )
                selected, self.selection = selection_plan(
                    self.arch,
                    plan,
                    ranking,
                    results,
                    candidates=s.selection_candidates,
                    drops=s.selection_drops,
                    groups=self._group_record,
                )
                kl = (lambda: self._kl(model)) if self._validation is not None else None
                with self._timed("selection_check"):
                    plan = choose(self.arch, plan, selected, self.selection, kl)
        return plan

    @contextmanager
    def _timed(self, stage: str):
        """Add the block's wall time to :attr:`seconds` ``[stage]``."""
        start, self._stage = time.perf_counter(), stage
        try:
            yield
        finally:
            self.seconds[stage] += time.perf_counter() - start

    @contextmanager
    def _exchanging(self):
        """Add the block's wall time to the current stage's ``_wait`` (data parallel)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.group is not None:
                self.seconds[f"{self._stage}_wait"] += time.perf_counter() - start

    def _owned(self) -> list[MoELayer]:
        me = ranks.rank(self.group)
        return [x for i, x in enumerate(self.arch.layers) if ranks.owner(i, self.group) == me]

    def _shared(self, what: str, work: Callable[[list[MoELayer]], dict]) -> dict:
        """``work`` on the layers this rank owns, every rank's results merged by layer; a
        failure on any rank is raised on every rank (no rank is left waiting)."""
        try:
            mine, failed = work(self._owned()), None
        except Exception as exc:  # noqa: BLE001 - raised below, on every rank
            mine, failed = {}, f"{type(exc).__name__}: {exc}"
        with self._exchanging():
            merged = ranks.exchange(
                {**mine, "__failed__" + str(ranks.rank(self.group)): failed}, self.group, what
            )
        errors = [
            f"rank {k[10:]}: {v}" for k, v in merged.items() if k.startswith("__failed__") and v
        ]
        if errors:
            raise RuntimeError(f"the post-cut {what} failed ({'; '.join(errors)})")
        return {k: v for k, v in merged.items() if not k.startswith("__failed__")}

    def _reference(self, model) -> ValidationSet | None:
        """This rank's held-out samples and the unpruned model's distributions on them
        (``None`` on every rank: nothing to validate)."""
        s, held = self.settings, self._held
        if not s.components and s.selection != "block_error":
            return None
        if s.components and ranks.rank(self.group) == 0:
            logger.warning(
                "REAP post-cut fit: the fitted tensors follow the calibration text, and the "
                "held-out check uses the same text: a language absent from it can get worse "
                "(fitted on English only, Chinese KL rose 38% on the bundled model); "
                "calibrate on every language the model serves"
            )
        if not s.validate:
            return None
        if not held:
            logger.warning(
                "REAP post-cut step: no held-out calibration sample reached the model "
                "(too few batches, or the model takes no input_ids): the fitted components "
                "are kept without an end-to-end check"
            )
            return None
        samples = s.samples or len(held)
        if len(held) / max(samples, 1) > 1 / s.holdout_every + 1e-9 or len(held) < 2:
            logger.warning(
                f"REAP post-cut step: {len(held)} of {samples} calibration samples held out "
                f"({len(held) / max(samples, 1):.0%}): a small calibration gives the held-out "
                "check few samples and the fits few rows"
            )
        groups = self._held_groups()
        validation = ValidationSet(
            [held[j][1] for j in self._mine],
            None if groups is None else [groups[j] for j in self._mine],
        )
        validation.record_reference(model)
        return validation

    def _held_groups(self) -> list[str] | None:
        """Each held-out sample's group, in one process's order (``None``: no groups)."""
        held = self._held
        return [h[2] for h in held] if held and held[0][2] is not None else None

    def _kl(self, model) -> HeldOutKL:
        """The model's held-out KL on every held-out sample (each rank's joined)."""
        local = self._validation.kl(model)
        with self._exchanging():
            return ranks.joined_kl(
                local, self._mine, len(self._held), self._held_groups(), self.group
            )

    # -- stages 5-6: components and record (on the cut model) ------------------------

    def fit(self, model: torch.nn.Module, overlay: Callable[[], object | None]) -> dict:
        """Fit and validate each component on the cut model; returns the record (the same
        on every rank but its ``seconds``; the kept tensors, :attr:`tensors`, are the same)."""
        s = self.settings
        try:
            if not s.components:
                self.record = {
                    "method": None,
                    "tokens": s.tokens,
                    "components": [],
                    "selection": self.selection,
                    "validation": self._validation_record(None, None),
                    "layers": {},
                }
            else:
                self.record = self._fit_components(model, overlay)
        finally:
            self.close()
        if self._start is not None:
            self.seconds["total"] = time.perf_counter() - self._start
        self.record["seconds"] = {k: round(v, 4) for k, v in self.seconds.items()}
        return self.record

    def close(self) -> None:
        """Release the captured rows and remove their spilled files (also on failure)."""
        self._rows.close()

    def _validation_record(self, cut: HeldOutKL | None, final: HeldOutKL | None) -> dict | None:
        if self._validation is None:
            return None
        s, held, groups = self.settings, self._held, self._held_groups()
        return {
            "holdout_every_batch": s.holdout_every,
            "batches": len(held),
            "samples": s.samples,
            "tokens": None if final is None else int(final.tokens.sum()),
            "groups": None if groups is None else {g: groups.count(g) for g in sorted(set(groups))},
            "kl_cut": None if cut is None else cut.mean,
            "kl_final": None if final is None else final.mean,
        }

    def _fit_components(self, model, overlay) -> dict:
        s, validation = self.settings, self._validation
        components, layers = [], {n: {} for n in self.arch.layer_names}
        kept: dict[str, dict[str, torch.Tensor]] = {n: {} for n in self.arch.layer_names}
        with _attached(overlay()):
            with self._timed("cut_check"):
                now = self._kl(model) if validation is not None else None
            cut = now
            for name in s.components:
                entry, after = self._component(name, model, now, layers, kept)
                components.append(entry)
                if entry["kept"] and after is not None:
                    now = after
        self.tensors = {n: t for n, t in kept.items() if t}
        return {
            "method": " + ".join(COMPONENT[c].method for c in s.components),
            "tokens": s.tokens,
            "steps": s.router_steps,
            "lr": s.router_lr,
            "dense_steps": s.dense_steps if "dense" in s.components else None,
            "dense_lr": s.dense_lr if "dense" in s.components else None,
            "validation": self._validation_record(cut, now),
            "components": components,
            "selection": self.selection,
            "layers": {n: rec.get("router", {}) for n, rec in layers.items()},
            "component_layers": layers,
        }

    def _component(self, name: str, model, before: HeldOutKL | None, layers, kept):
        """Fit component ``name`` on every layer (each rank its own, the results shared),
        its tensors rounded to the dtype they are saved in; keep it (its tensors join
        ``kept``, the tensors every kept component changed, by layer) when the held-out KL
        drops beyond its standard error (:func:`~.validation.keeps`), else put back the
        state before it, in the model and in ``kept``. A failure puts back the state
        before it too. Returns the record's entry and the KL after it."""
        component = COMPONENT[name]
        saved = {
            layer.name: read_tensors(layer, component.params(layer)) for layer in self.arch.layers
        }
        try:
            with self._timed(name):
                results = self._shared(
                    f"{name} fits", lambda owned: self._fit_layers(component, owned)
                )
                fitted = {n: results[n][0] for n in self.arch.layer_names}
                ranks.hold_tensors(self.arch, fitted)
        except BaseException:
            for layer in self.arch.layers:  # no half-fitted model is left behind
                write_tensors(layer, saved[layer.name])
            raise
        for n in self.arch.layer_names:
            layers[n][name] = results[n][1]
        with self._timed(f"{name}_check"):
            after = self._kl(model) if self._validation is not None else None
        keep = after is None or keeps(before, after)
        if keep:
            for layer_name, tensors in fitted.items():
                kept[layer_name].update(tensors)
        else:
            for layer in self.arch.layers:
                write_tensors(layer, saved[layer.name])
                # a tensor an earlier kept component changed is back to that component's
                # value (in the model above, and in what is saved)
                for n in fitted[layer.name]:
                    if n in kept[layer.name]:
                        kept[layer.name][n] = saved[layer.name][n]
        change, se = after.change_from(before) if after is not None else (None, None)
        names = sorted({n for t in fitted.values() for n in t})
        logger.info(
            f"REAP post-cut fit: {name} "
            + (
                f"{'kept' if keep else 'DROPPED (not better beyond its standard error)'}: "
                f"held-out KL {before.mean:.5g} -> {after.mean:.5g} nats/token ("
                + (f"{change:+.3g} +- {se:.2g}" if se is not None else f"{change:+.3g}")
                + ")"
                if after is not None
                else "kept without validation"
            )
            + f"; tensors per layer: {', '.join(names) or 'none'}"
        )
        return {
            "name": name,
            "method": component.method,
            "kept": keep,
            "kl_before": None if before is None else before.mean,
            "kl_after": None if after is None else after.mean,
            "change": change,
            "se": se,
            "by_group": None
            if after is None or after.groups is None
            else {"before": before.by_group(), "after": after.by_group()},
            "tensors": names,
        }, after

    def _fit_layers(self, component, owned: list[MoELayer]) -> dict:
        """Fit ``component`` on the ``owned`` layers and write each layer's tensors, rounded
        to the dtype they are saved in (:attr:`PostCutSettings.saved_dtype`), so that what
        is validated is what is saved; returns ``{layer: (tensors on CPU, record)}``."""
        from compressed_tensors import align_module_device
        from tqdm.auto import tqdm

        s, out = self.settings, {}
        for layer in tqdm(owned, desc=f"REAP post-cut fit: {component.name}"):
            done = self.log.load(component.name, layer.name)
            if done is not None:  # an earlier run fitted it (checkpoint_dir)
                tensors, rec = done
            else:
                x, y = self._rows.rows(layer.name)
                with align_module_device(layer.block):
                    device = layer.router.weight.device
                    tensors, rec = component.fit(layer, x.to(device), y.to(device), s)
                del x, y
                tensors = {
                    n: _as_saved(t, s.saved_dtype, layer.name, n) for n, t in tensors.items()
                }
                tensors = {k: v.detach().to("cpu") for k, v in tensors.items()}
                self.log.save(
                    component.name,
                    layer.name,
                    self.arch.layer_names.index(layer.name),
                    (tensors, rec),
                )
            write_tensors(layer, tensors)
            logger.debug(f"REAP post-cut fit {component.name} {layer.name}: {rec}")
            out[layer.name] = (tensors, rec)
        return out


def _as_saved(tensor: torch.Tensor, saved_dtype, layer: str, name: str) -> torch.Tensor:
    """``tensor`` rounded to the dtype it is saved in (``saved_dtype(layer, name)``; as it
    is when that is unknown), in its own dtype."""
    dtype = saved_dtype(layer, name) if saved_dtype is not None else None
    if dtype is None or dtype == tensor.dtype:
        return tensor
    return tensor.to(dtype).to(tensor.dtype)


class _attached:
    """Context for an already attached overlay (or ``None``): detached on exit."""

    def __init__(self, overlay):
        self.overlay = overlay

    def __enter__(self):
        return self.overlay

    def __exit__(self, *exc):
        if self.overlay is not None:
            self.overlay.detach()
