"""``reap verify`` on a pruned GGUF: its keys and shapes agree with each other (the expert
count, every per-expert tensor's expert axis, top-k, groups, the ``reap.*`` kept ids), and,
with the source, every tensor is its source's bytes (the kept slabs of a per-expert tensor,
the whole tensor otherwise; sha256 of each) and every key the source's but those pruning
sets."""

from __future__ import annotations

import os
from pathlib import Path

from ..checkpoint.range_hashes import hash_ranges, progress_bar
from ..checkpoint.verify_report import VerifyReport
from ..scores.plan import PruningPlan
from .binding import GGUFSpec, bind_gguf_plan, moe_layers
from .errors import GGUFError
from .layout import GGUFLayout, inspect_gguf
from .provenance import PROVENANCE_PREFIX, kept_from_values

__all__ = ["verify_gguf"]

#: keys pruning sets: the expert count (``{arch}.``) and the converter's size label
_SET_BY_PRUNING = ("expert_count", "general.size_label")


def verify_gguf(
    dst: str | os.PathLike, *, source: str | os.PathLike | None = None, progress: bool = False
) -> VerifyReport:
    """Check the pruned GGUF ``dst`` (a file, or the directory of a split), against
    ``source`` when given; every problem goes into the report (``report.ok``)."""
    layout = inspect_gguf(dst)
    report = VerifyReport(path=str(dst), source=str(source) if source else None)
    n = layout.num_experts
    layers = moe_layers(layout)
    report.info.update(
        moe_layers=len(layers),
        num_experts=n,
        tensors=sum(len(p.tensors) for p in layout.parts),
        shards=len(layout.parts),
    )
    if n is None:
        report.fail(f"no {layout.key('expert_count')} key: not a MoE model")
        return report
    _check_shapes(layout, layers, report)
    source_count, kept = kept_from_values(layout.values)
    if not kept:
        report.warn("no reap.* provenance keys: not written by reap prune; checked its shapes only")
        if source is not None:
            report.fail("without the reap.kept_experts.* keys the kept slabs cannot be compared")
        return report
    _check_kept(layout, layers, source_count, kept, report)
    if source is not None and report.ok:
        _check_against_source(layout, inspect_gguf(source), source_count, kept, report, progress)
    return report


def _check_shapes(layout: GGUFLayout, layers: dict[int, list[str]], report: VerifyReport) -> None:
    n, top_k = layout.num_experts, layout.top_k
    tensors = layout.tensors
    for names in layers.values():
        for name in names:
            rows = tensors[name][1].dims[-1]
            if rows != n:
                report.fail(f"{name} has {rows} experts, {layout.key('expert_count')} says {n}")
    if top_k is not None and top_k > n:
        report.fail(f"{layout.key('expert_used_count')} = {top_k} exceeds the {n} experts")
    n_group, _ = layout.groups
    if n_group and n_group > 1 and n % n_group:
        report.fail(f"{layout.key('expert_group_count')} = {n_group} does not divide {n} experts")


def _check_kept(layout, layers, source_count, kept, report: VerifyReport) -> None:
    n = layout.num_experts
    if sorted(kept) != sorted(layers):
        report.fail(
            f"reap.kept_experts.* name layers {sorted(kept)}, the MoE layers are {sorted(layers)}"
        )
    for L, ids in kept.items():
        if (
            len(ids) != n
            or ids != sorted(set(ids))
            or not all(0 <= i < (source_count or 0) for i in ids)
        ):
            report.fail(
                f"reap.kept_experts.{L} = {ids[:8]}...: not {n} ascending ids below the source's "
                f"{source_count} experts"
            )


def _check_against_source(
    layout: GGUFLayout, src: GGUFLayout, source_count, kept, report: VerifyReport, progress: bool
) -> None:
    if src.num_experts != source_count:
        report.fail(
            f"the source has {src.num_experts} experts, the pruned file says it came from "
            f"{source_count}: is --source the file it was pruned from?"
        )
        return
    plan = PruningPlan(kept={f"blk.{L}": ids for L, ids in kept.items()}, num_experts=source_count)
    try:
        spec = bind_gguf_plan(src, plan)
    except GGUFError as exc:
        report.fail(f"the kept ids do not bind to the source: {exc}")
        return
    if [p.path.name for p in layout.parts] != [p.path.name for p in src.parts] and len(
        src.parts
    ) > 1:
        report.fail("the split parts are not the source's")
        return
    if len(layout.parts) != len(src.parts):
        report.fail(f"{len(layout.parts)} part(s), the source has {len(src.parts)}")
        return
    _check_fields(layout, src, report)
    total = sum(t.nbytes for p in layout.parts for t in p.tensors) * 2
    bar = progress_bar(progress, total, "reap verify")
    matching = 0
    try:
        for out_part, src_part in zip(layout.parts, src.parts):
            matching += _check_part_tensors(out_part, src_part, spec, report, bar)
    finally:
        if bar is not None:
            bar.close()
    report.info.update(checked_against_source=True, tensors_matching_source=matching)


def _check_fields(layout: GGUFLayout, src: GGUFLayout, report: VerifyReport) -> None:
    set_by_pruning = {src.key(_SET_BY_PRUNING[0]), _SET_BY_PRUNING[1]}
    for out_part, src_part in zip(layout.parts, src.parts):
        theirs = {f.key: f.raw for f in src_part.fields if not f.key.startswith(PROVENANCE_PREFIX)}
        ours = {f.key: f.raw for f in out_part.fields if not f.key.startswith(PROVENANCE_PREFIX)}
        if list(ours) != list(theirs):
            report.fail(
                f"{out_part.path.name}: its keys are not the source's ({sorted(set(ours) ^ set(theirs))[:6]})"
            )
            continue
        for key, raw in ours.items():
            if key not in set_by_pruning and raw != theirs[key]:
                report.fail(f"{out_part.path.name}: key {key} differs from the source")


def _check_part_tensors(out_part, src_part, spec: GGUFSpec, report: VerifyReport, bar) -> int:
    names = [t.name for t in out_part.tensors]
    if names != [t.name for t in src_part.tensors]:
        report.fail(f"{out_part.path.name}: its tensors are not the source's, in its order")
        return 0
    want, got = {}, {}
    for s, o in zip(src_part.tensors, out_part.tensors):
        dims, ranges = spec.output_tensor(s)
        if (o.dims, o.ggml_type) != (tuple(dims), s.ggml_type):
            report.fail(
                f"{o.name}: dims {o.dims} type {o.ggml_type}, expected {tuple(dims)} type {s.ggml_type}"
            )
            continue
        want[o.name] = ranges
        got[o.name] = [(o.offset, o.offset + o.nbytes)]
    update = bar.update if bar is not None else None
    _, src_hashes = hash_ranges(
        src_part.path, _size(src_part.path), want, whole=None, progress=update
    )
    _, out_hashes = hash_ranges(
        out_part.path, _size(out_part.path), got, whole=None, progress=update
    )
    matching = 0
    for name in got:
        if out_hashes[name] == src_hashes[name]:
            matching += 1
        else:
            what = "its kept experts' slabs" if name in spec.per_expert else "the tensor"
            report.fail(f"{name}: sha256 differs from the source's ({what})")
    return matching


def _size(path: Path) -> int:
    return path.stat().st_size
