"""The selection stage of the post-cut step (``selection: block_error``): the block-error
selection run on every layer (:func:`select_per_layer`, on the captured rows), then scored
against REAP's own cut end to end (:func:`choose`): both plans are applied as views of the
unpruned model (:mod:`.plan_view`), their KL to the unpruned model measured on the held-out
samples, and the selection kept only where it is lower by more than its paired standard
error (:func:`~.validation.keeps`), else REAP's cut is applied. The record says which plan
was applied, by how much, and per group when the samples have one.

Why end to end: the search minimises each layer's output error on the rows it searched
(the unpruned model's inputs to that layer), which says nothing of how the errors of all
layers compound; on the bundled model the selection won layer by layer yet lost to REAP's
cut on English at keep 32 (``docs/selection.md``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from loguru import logger

from ..models import MoEArchitecture, MoELayer
from ..scores.plan import PruningPlan, retained_mass
from .plan_view import routed_as, view_problem
from .resume import StageLog
from .rows import RowStore
from .validation import HeldOutKL, keeps

__all__ = ["choose", "select_layers", "selection_plan"]


def select_layers(
    layers: list[MoELayer],
    plan: PruningPlan,
    ranking: dict[str, torch.Tensor],
    rows: RowStore,
    *,
    candidates: int | None,
    drops: int,
    groups: tuple[list[str], dict[str, torch.Tensor]] | None = None,
    log: StageLog | None = None,
    index: Callable[[str], int] | None = None,
) -> dict[str, tuple[list[int], dict]]:
    """``{layer: (kept ids, record)}``: for each of ``layers``, the same keep count as
    ``plan``, the kept experts chosen by greedy elimination on the block's re-routed output
    error (:mod:`.block_selection`; with ``groups``, the group names and each row's group
    index per layer, the worst group's error), ``ranking`` (the cut's saliency) ordering the
    candidates. Call on the unpruned model; one layer's rows read at a time. ``log``: each
    layer's result taken from, or written to, the post-cut resume (``index``: a layer's
    position, for its pause point)."""
    from compressed_tensors import align_module_device
    from tqdm.auto import tqdm

    from .block_selection import select_by_block_error

    names, row_groups = groups if groups is not None else (None, {})
    out = {}
    for layer in tqdm(layers, desc="REAP block-error selection"):
        done = log.load("selection", layer.name) if log is not None else None
        if done is not None:  # an earlier run chose it (checkpoint_dir)
            out[layer.name] = done
            continue
        x, y = rows.rows(layer.name)
        ids_of = row_groups.get(layer.name)
        with align_module_device(layer.block):
            device = layer.router.weight.device
            ids, record = select_by_block_error(
                layer,
                x.to(device),
                y.to(device),
                plan.num_kept,
                ranking=ranking.get(layer.name),
                groups=ids_of.to(device) if ids_of is not None else None,
                candidates=candidates,
                drops_per_step=drops,
                baseline=plan.kept[layer.name],
            )
        rec = record.to_dict()
        if names is not None:
            rec["group_errors"] = {names[int(g)]: v for g, v in rec["group_errors"].items()}
        out[layer.name] = (ids, rec)
        del x, y
        if log is not None:
            log.save("selection", layer.name, index(layer.name), out[layer.name])
    return out


def selection_plan(
    arch: MoEArchitecture,
    plan: PruningPlan,
    ranking: dict[str, torch.Tensor],
    results: dict[str, tuple[list[int], dict]],
    *,
    candidates: int | None,
    drops: int,
    groups: dict | None = None,
) -> tuple[PruningPlan, dict]:
    """The selected plan of every layer's ``results`` (:func:`select_layers`) and the
    selection's record (``groups``: the group column, names and captured tokens)."""
    kept = {n: results[n][0] for n in arch.layer_names}
    records = {n: results[n][1] for n in arch.layer_names}
    retained = {n: retained_mass(ranking[n], ids) for n, ids in kept.items() if n in ranking}
    changed = sum(len(set(kept[n]) - set(plan.kept[n])) for n in kept)
    kept_cut = sorted(n for n, r in records.items() if r["kept_baseline"])
    logger.info(
        f"REAP block-error selection: {plan.num_kept} experts per layer; {changed} of "
        f"{plan.num_kept * len(kept)} kept experts differ from {plan.saliency}'s cut"
        + (f"; {len(kept_cut)} layer(s) keep that cut (no lower error)" if kept_cut else "")
    )
    record = {
        "method": "block_error",
        "candidate_order": plan.saliency,
        "candidates": candidates,
        "drops_per_step": drops,
        "differs_from_ranking": changed,
        "layers_keeping_ranking_cut": kept_cut,
        "objective": "pooled" if groups is None else "worst_group",
        "groups": groups,
        "layers": records,
    }
    selected = PruningPlan(
        kept=kept,
        num_experts=plan.num_experts,
        saliency="block_error",
        params={**plan.params, "selection": "block_error", "candidate_order": plan.saliency},
        retained=retained,
    )
    return selected, record


def choose(
    arch: MoEArchitecture,
    cut: PruningPlan,
    selected: PruningPlan,
    record: dict,
    kl: Callable[[], HeldOutKL] | None,
) -> PruningPlan:
    """REAP's ``cut`` or the ``selected`` plan, whichever is better end to end on the
    held-out samples (the selection only when it is lower beyond its standard error);
    ``record`` (the selection's) gains ``end_to_end``. ``kl``: the model's held-out KL
    (every rank's samples joined; ``None``: no held-out set). Without a held-out set, or
    for a layer no view can route, the selection is applied unscored and the record says
    so. Call on the unpruned model (with any packed overlay attached)."""
    problems = [p for layer in arch.layers if (p := view_problem(layer, cut.num_experts))]
    if kl is None or problems:
        why = "no held-out samples" if kl is None else problems[0]
        logger.warning(
            f"REAP block-error selection applied without an end-to-end check ({why}): it is "
            "chosen layer by layer on the rows it searched"
        )
        record["end_to_end"] = {"checked": False, "reason": why, "applied": "block_error"}
        return selected
    with routed_as(arch, cut):
        kl_cut = kl()
    with routed_as(arch, selected):
        kl_sel = kl()
    better = keeps(kl_cut, kl_sel)
    change, se = kl_sel.change_from(kl_cut)
    record["end_to_end"] = {
        "checked": True,
        "applied": "block_error" if better else cut.saliency,
        "kl_ranking_cut": kl_cut.mean,
        "kl_selection": kl_sel.mean,
        "change": change,
        "se": se,
        "by_group": None
        if kl_cut.groups is None
        else {"ranking_cut": kl_cut.by_group(), "selection": kl_sel.by_group()},
    }
    logger.info(
        f"REAP block-error selection, end to end on the held-out samples: KL "
        f"{kl_cut.mean:.5g} ({cut.saliency}'s cut) -> {kl_sel.mean:.5g} (selection), change "
        f"{change:+.3g}"
        + (f" +- {se:.2g}" if se is not None else "")
        + ": "
        + ("the selection is applied" if better else f"{cut.saliency}'s cut is kept")
    )
    return selected if better else cut
