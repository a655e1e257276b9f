"""``reap verify --source``: every tensor of the output against the source bytes it came
from (the kept source expert, the kept router rows, or the unchanged tensor), the source
shards against the manifest's hashes, and tensors the manifest records as written from
memory (fitted routers) against their recorded sha256."""

from __future__ import annotations

from pathlib import Path

from .binding import ExpertRemap
from .errors import CheckpointError
from .layout import config_count
from .moe_blocks import scan_moe_blocks
from .range_hashes import hash_ranges, progress_bar
from .verify_files import load_structure
from .verify_report import VerifyReport

__all__ = ["compare_with_source"]


def _recorded_replacement(manifest, out_name: str, source_name: str, got, report) -> bool:
    """Whether ``out_name``, which differs from the source, is a tensor the manifest
    records as written from memory (``checkpoint.replaced_tensors``: a fitted router)
    with exactly these bytes; adds it to ``report.info["differs_from_source"]`` with the
    recorded reason. Expert tensors are never accepted."""
    record = ((manifest.get("checkpoint") or {}).get("replaced_tensors") or {}).get(out_name)
    if not isinstance(record, dict) or ".experts." in out_name:
        return False
    if record.get("source") != source_name or record.get("sha256") != got:
        report.fail(
            f"{out_name}: sha256 {str(got)[:16]}... is neither source {source_name}'s nor the "
            f"manifest's recorded replacement {str(record.get('sha256'))[:16]}..."
        )
        return True
    report.info.setdefault("differs_from_source", {})[out_name] = record.get("reason", "")
    return True


#: expected output tensor -> (source name, byte ranges, dtype, shape)
Expected = dict[str, tuple[str, list[tuple[int, int]], str, tuple[int, ...]]]


def compare_with_source(
    src: Path, manifest, block_kept, dst_entries, dst_tensor_sha, report, progress
) -> None:
    """Every output tensor (``dst_entries``, their sha256 in ``dst_tensor_sha``) against the
    source bytes the manifest's ``block_kept`` says it came from; failures go to ``report``."""
    sub = VerifyReport(path=str(src))
    loaded = load_structure(src, sub, "source")
    report.failures.extend(sub.failures)
    if loaded is None:
        return
    src_config, _, weight_map, shards, entries = loaded
    blocks = scan_moe_blocks(entries, config_count(src_config))
    missing_blocks = sorted(set(block_kept) - set(blocks))
    for p in missing_blocks:
        report.fail(f"source has no MoE layer {p} (named by the manifest)")
    remap = ExpertRemap(blocks, {p: k for p, k in block_kept.items() if p in blocks})
    src_shards = (manifest.get("source") or {}).get("shards")
    if src_shards is None:
        report.warn("the manifest holds no source shard hashes; source identity not checked")
        src_shards = {}
    for shard in sorted(set(src_shards) - set(shards)):
        report.fail(f"source shard {shard} (in the manifest) is missing from {src}")
    expected = _expected_outputs(entries, remap, report)
    src_sha = _hash_source(shards, weight_map, expected, src_shards, report, progress)
    _match_outputs(expected, src_sha, dst_entries, dst_tensor_sha, manifest, report)


def _expected_outputs(entries, remap: ExpertRemap, report) -> Expected:
    """What the remap makes of each source tensor: its output name, the source byte ranges
    it is copied from, its dtype and its output shape."""
    expected: Expected = {}
    for name, entry in entries.items():
        act = remap.action(name)
        if act is None:
            continue
        out_name, rows = act
        if rows is None:
            expected[out_name] = (name, [(entry.begin, entry.end)], entry.dtype, entry.shape)
        else:
            try:
                ranges = entry.index_ranges(rows, remap.dim(name))
            except CheckpointError as exc:
                report.fail(str(exc))
                continue
            expected[out_name] = (
                name,
                ranges,
                entry.dtype,
                remap.out_shape(name, entry.shape, rows),
            )
    return expected


def _hash_source(
    shards, weight_map, expected: Expected, src_shards, report, progress
) -> dict[str, str]:
    """The sha256 of each expected output's source bytes (by output name); each source
    shard the manifest hashed is checked against that hash on the same pass."""
    bar = progress_bar(progress, sum(h.file_size for h in shards.values()), "verify source")
    src_sha: dict[str, str] = {}
    for shard, header in shards.items():
        requests = {
            out: ranges
            for out, (name, ranges, _, _) in expected.items()
            if weight_map[name] == shard
        }
        whole, per = hash_ranges(
            header.path,
            header.file_size,
            requests,
            whole="sha256" if shard in src_shards else None,
            progress=bar.update if bar else None,
        )
        if shard in src_shards and whole != src_shards[shard]:
            report.fail(
                f"source shard {shard}: sha256 {whole[:16]}... differs from the manifest's "
                f"{src_shards[shard][:16]}... (not the checkpoint that was pruned, or it changed)"
            )
        src_sha.update(per)
    if bar:
        bar.close()
    return src_sha


def _match_outputs(
    expected: Expected, src_sha, dst_entries, dst_tensor_sha, manifest, report
) -> None:
    """Each output tensor has the dtype, shape and sha256 its source bytes give (or the
    manifest's recorded replacement); nothing is missing or extra."""
    matched = 0
    for out_name, (name, _, dtype, shape) in sorted(expected.items()):
        d = dst_entries.get(out_name)
        if d is None:
            report.fail(f"{out_name} (from source {name}) is missing from the output")
            continue
        if d.dtype != dtype or tuple(d.shape) != tuple(shape):
            report.fail(
                f"{out_name}: {d.dtype}{list(d.shape)}, expected {dtype}{list(shape)} from source {name}"
            )
            continue
        got, want = dst_tensor_sha.get(out_name), src_sha.get(out_name)
        if got != want and _recorded_replacement(manifest, out_name, name, got, report):
            continue
        if got != want:
            report.fail(
                f"{out_name}: sha256 {str(got)[:16]}... differs from source {name} {str(want)[:16]}..."
            )
            continue
        matched += 1
    for out_name in sorted(set(dst_entries) - set(expected)):
        report.fail(
            f"{out_name}: in the output but produced by no source tensor under the manifest's remap"
        )
    report.info["tensors_matching_source"] = matched
