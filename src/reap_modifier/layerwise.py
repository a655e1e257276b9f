"""Cutting MoE layers one calibration epoch at a time (``propagate_pruned: true``).

llm-compressor's ``REAPPruningModifier`` prunes each MoE layer at the end of its
sequential calibration epoch, so with ``propagate_error`` (the default) every later
layer is observed on the already-pruned model. :class:`LayerwiseCut` does the same
with this package's statistics, cut and surgery: at each epoch end the layers that
were calibrated in it are cut (:func:`~reap_modifier.scores.plan.cut_plan`) and pruned
in place (:func:`~reap_modifier.surgery.prune_layer`); :meth:`LayerwiseCut.plan`
joins the pieces into one plan. The config counts are updated by the caller once
every layer is cut.

Statistics measured this way hold only for the cut that shaped them, which the scores
file records (:meth:`LayerwiseCut.record`); :func:`~reap_modifier.scores.plan.cut_plan`
refuses to cut such a file at another keep count or criterion.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .calibration import distributed
from .calibration.observer import SaliencyObserver
from .models import MoEArchitecture
from .scores.plan import PruningPlan, cut_plan
from .surgery import prune_layer

__all__ = ["LayerwiseCut"]


class LayerwiseCut:
    """Kept ids of the layers cut so far during calibration.

    :param arch: the model's MoE architecture (its ``num_experts`` is the unpruned count)
    :param observer: the observer whose accumulators hold the statistics
    :param cut_args: keyword arguments of :func:`cut_plan` besides saliency and counts
    :param group: the gloo group of data-parallel calibration (``None`` alone)
    """

    def __init__(
        self,
        arch: MoEArchitecture,
        observer: SaliencyObserver,
        cut_args: dict,
        group=None,
    ):
        self.arch = arch
        self.observer = observer
        self.cut_args = cut_args
        self.group = group
        self.pieces: list[PruningPlan] = []
        self.epochs = 0  # epoch ends that cut at least one layer
        self.local_counts: dict[str, int] | None = None

    @property
    def cut_layers(self) -> set[str]:
        return {name for piece in self.pieces for name in piece.kept}

    def pending(self, modules: Iterable[torch.nn.Module] | None = None) -> list[str]:
        """Layers not cut yet: those among ``modules`` (an epoch's modules), or, without
        ``modules``, those that observed a forward (as upstream decides)."""
        done = self.cut_layers
        if modules is not None:
            ids = {id(m) for m in modules}
            return [
                lay.name
                for lay in self.arch.layers
                if id(lay.block) in ids and lay.name not in done
            ]
        accs = self.observer.accumulators
        return [
            lay.name
            for lay in self.arch.layers
            if lay.name not in done and accs[lay.name].positions > 0
        ]

    def cut(self, model: torch.nn.Module, names: list[str]) -> None:
        """Cut and prune ``names`` now, from the statistics observed so far."""
        if not names:
            return
        if self.local_counts is None:  # every layer sees every batch: the first is whole
            self.local_counts = self.observer.local_counts()
        accs = {name: self.observer.accumulators[name] for name in names}
        distributed.reduce_accumulators(accs, self.group)
        scores = self.observer.to_scores()
        criterion = self.cut_args.get("criterion", "reap")
        saliency = {name: s for name, s in scores.saliency(criterion).items() if name in accs}
        counts = {name: scores.layers[name]["count"] for name in names}
        piece = cut_plan(saliency, counts, log=False, **self.cut_args)
        piece.kept = distributed.broadcast_kept(piece.kept, names, piece.num_kept, self.group)
        by_name = {lay.name: lay for lay in self.arch.layers}
        for name in names:
            prune_layer(by_name[name], piece.kept[name], self.arch.num_experts)
        self.pieces.append(piece)
        self.epochs += 1

    def plan(self) -> PruningPlan:
        """All pieces as one plan (every layer must have been cut)."""
        first = self.pieces[0]
        joined = PruningPlan(
            kept={},
            num_experts=first.num_experts,
            saliency=first.saliency,
            params=dict(first.params),
        )
        for piece in self.pieces:
            joined.kept.update(piece.kept)
            joined.retained.update(piece.retained)
            joined.ties.update(piece.ties)
            joined.never_routed.update(piece.never_routed)
        joined.kept = {lay.name: joined.kept[lay.name] for lay in self.arch.layers}
        return joined.validate()

    def record(self) -> dict | None:
        """What the scores file must say: the cut its statistics depend on (``None``
        when every layer was cut in one epoch, i.e. observed on the unpruned model)."""
        if self.epochs <= 1:
            return None
        plan = self.pieces[0]
        return {"keep": plan.num_kept, "saliency": plan.saliency, "epochs": self.epochs}
