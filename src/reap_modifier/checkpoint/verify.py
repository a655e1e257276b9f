"""``reap verify``: check a pruned checkpoint against itself, its manifest and its source.

Without a source (headers, config and manifest; the shards are read once to hash them):

- every shard in the index exists, its header is well formed and its tensors tile
  the file exactly (a truncated or padded file fails); index and headers agree
  (no tensor missing from its shard, no tensor in a shard that the index omits, no
  safetensors file the index does not reference);
- the config's expert count equals the experts present in every MoE layer: no
  missing or orphan expert index, every expert has the same parameters, every cut
  tensor (router rows, fused experts, per-expert vectors of any name) has that many
  entries; per-expert names in ``quantization_config`` are within range;
- the pruned MoE blocks are whole: no tensor still has the count before pruning
  (the manifest's), no token -> expert table;
- ``pruning_manifest.json`` agrees with the files: counts after pruning, the kept
  ids of every MoE layer, and the size and checksum (xxh3-128 or sha256) of every
  output shard (a flipped byte fails here).

With ``source``: every source shard's sha256 equals the manifest's (the source is
what was pruned), and every tensor of the output has the sha256 of the bytes it came
from (the kept source expert, the kept router rows, or the unchanged tensor), with
the same dtype and shape; nothing is missing and nothing is extra. A non-expert tensor
the manifest records as written from memory (``checkpoint.replaced_tensors``: router
rows fitted after the cut) must instead have the recorded sha256; it is listed in
``info["differs_from_source"]`` with the recorded reason. Expert bytes always come
from the source.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..models.moe_fields import moe_fields
from .binding import resolve_block
from .destination import work_dir_kind
from .errors import CheckpointError
from .layout import config_count, find_count_keys
from .manifest import MANIFEST_NAME
from .moe_blocks import MODULE_EXPERT_RE, check_block, left_behind_in, scan_moe_blocks
from .quantization import check_packed_scales, quant_configs
from .range_hashes import hash_ranges, progress_bar
from .verify_files import load_structure
from .verify_manifest import (
    check_manifest_or_report,
    post_cut_lines,
    read_manifest,
    recorded_cuts,
)
from .verify_report import VerifyError, VerifyReport
from .verify_source import compare_with_source

__all__ = ["VerifyError", "VerifyReport", "verify_checkpoint"]


def verify_checkpoint(
    dst: str | os.PathLike,
    source: str | os.PathLike | None = None,
    *,
    progress: bool = False,
) -> VerifyReport:
    """Verify a (pruned) checkpoint; returns a :class:`VerifyReport` (``.ok``,
    ``.failures``; ``.raise_if_failed()`` raises :class:`VerifyError`).

    Stages: the files' structure, the expert counts, each MoE block's experts and the
    names in ``quantization_config``, the manifest, the output shards' checksums, and with
    ``source`` every tensor's sha256 against the bytes it came from."""
    dst = Path(dst)
    report = VerifyReport(path=str(dst), source=str(source) if source is not None else None)
    if work_dir_kind(dst) is not None:
        report.fail(
            f"{dst} is a work directory of an interrupted (or running) `reap prune`, not a "
            "finished output; rerun reap prune (it removes such directories)"
        )
    loaded = load_structure(dst, report, "output")
    if loaded is None:
        return report
    config, index_file, weight_map, shards, entries = loaded
    blocks = scan_moe_blocks(entries, config_count(config))
    report.info["moe_layers"] = len(blocks)
    report.info["tensors"] = len(entries)
    report.info["shards"] = len(shards)
    report.info["quantization_format"] = [
        qc["format"] for qc in quant_configs(config) if qc.get("format")
    ]
    mpath = dst / MANIFEST_NAME
    E = _check_counts(config, mpath, report)
    if not blocks:
        report.fail("no MoE layer (no '.experts.' tensors) in the checkpoint")
    for problem in check_packed_scales(entries, config):
        report.fail(problem)
    manifest = read_manifest(mpath, source, report)
    if E is not None:
        _check_experts(config, blocks, entries, E, report, recorded_cuts(manifest))
    block_kept, out_hashes_expected = None, {}
    if manifest is not None:
        block_kept, out_hashes_expected = check_manifest_or_report(
            manifest, report, blocks, E, shards
        )
        report.info["post_cut_fit"] = post_cut_lines(manifest)
    _check_whole(blocks, entries, manifest, report)
    dst_tensor_sha = _hash_output_shards(shards, out_hashes_expected, source, report, progress)
    if source is not None and block_kept is not None:
        try:
            compare_with_source(
                Path(source), manifest, block_kept, entries, dst_tensor_sha, report, progress
            )
        except CheckpointError as exc:
            report.fail(f"source: {exc}")
        except (TypeError, ValueError, AttributeError, KeyError) as exc:
            report.fail(
                f"{MANIFEST_NAME} is malformed ({type(exc).__name__}: {exc}); cannot compare with the source"
            )
    report.info["checked_against_source"] = source is not None and block_kept is not None
    return report


def _check_counts(config: dict, mpath: Path, report: VerifyReport) -> int | None:
    """The config's expert count (the keys the rewriter set, when the manifest says);
    ``None`` when missing or the keys disagree."""
    counts = find_count_keys(config)
    try:
        recorded = (
            (json.loads(mpath.read_text()).get("checkpoint") or {}).get("count_keys")
            if mpath.is_file()
            else None
        )
    except (json.JSONDecodeError, AttributeError):
        recorded = None
    if recorded:
        counts = {k: v for k, v in counts.items() if k in recorded}
        for k in sorted(set(recorded) - set(counts)):
            report.fail(f"config.json lacks the expert-count key {k} (set by the rewriter)")
    if not counts:
        report.fail(
            "config.json has no expert-count key (num_experts / num_local_experts / n_routed_experts / moe_num_experts)"
        )
        return None
    values = set(counts.values())
    if len(values) > 1:
        report.fail(f"config.json expert-count keys disagree: {counts}")
    E = min(values) if len(values) == 1 else None
    report.info["num_experts"] = E
    return E


def _check_experts(
    config: dict, blocks, entries, E: int, report: VerifyReport, cuts: dict | None = None
) -> None:
    """Every MoE block holds experts ``0..E-1`` and ``E`` entries in every cut tensor (the
    manifest's ``cut_tensors`` when recorded, else those the rule finds); per-expert names
    in ``quantization_config`` stay below ``E``; top-k does not exceed ``E``."""
    for block in blocks.values():
        for problem in check_block(block, entries, E, cuts):
            report.fail(problem)
    for qc in quant_configs(config):
        for key, names in (("ignore", qc.get("ignore")),) + tuple(
            (f"config_groups.{g}.targets", grp.get("targets"))
            for g, grp in (qc.get("config_groups") or {}).items()
            if isinstance(grp, dict)
        ):
            for item in names or []:
                m = (
                    MODULE_EXPERT_RE.match(item)
                    if isinstance(item, str) and not item.startswith("re:")
                    else None
                )
                if not m:
                    continue
                try:
                    resolve_block(m["block"], blocks)
                except CheckpointError:
                    continue
                if int(m["idx"]) >= E:
                    report.fail(f"quantization_config.{key} names {item}, expert index >= {E}")
    top_k = moe_fields(config).top_k
    if top_k is not None and top_k > E:
        report.fail(f"top-k {top_k} exceeds the expert count {E}")


def _check_whole(blocks, entries, manifest, report: VerifyReport) -> None:
    """The wholeness rule (:mod:`reap_modifier.models.expert_tensors`): no token -> expert
    table in a MoE block (``reap prune`` refuses hash-routed models), and, with the
    manifest's count before pruning, no tensor of a MoE block that still has it."""
    for block in blocks.values():
        for name in block.tables:
            report.fail(
                f"{name}: a token -> expert table in a pruned MoE block (hash routing); "
                "reap prune refuses hash-routed models"
            )
    before = manifest.get("num_experts_before") if isinstance(manifest, dict) else None
    after = manifest.get("num_experts_after") if isinstance(manifest, dict) else None
    if not isinstance(before, int) or before == after:
        return
    shapes = {n: tuple(e.shape) for n, e in entries.items()}
    for block in blocks.values():
        for problem in left_behind_in(block, shapes, before):
            report.fail(problem)


def _hash_output_shards(shards, out_hashes_expected, source, report, progress) -> dict[str, str]:
    """Each output shard's checksum against the manifest's; with ``source``, also every
    tensor's sha256 (returned, by tensor name)."""
    bar = progress_bar(progress, sum(h.file_size for h in shards.values()), "verify output")
    dst_tensor_sha: dict[str, str] = {}
    for shard, header in shards.items():
        kind, expect = out_hashes_expected.get(shard, (None, None))
        requests = (
            {n: [(e.begin, e.end)] for n, e in header.entries.items()} if source is not None else {}
        )
        if kind is None and not requests:
            continue
        whole, per = hash_ranges(
            header.path,
            header.file_size,
            requests,
            whole=kind,
            progress=bar.update if bar else None,
        )
        if kind is not None and whole != expect:
            report.fail(
                f"{shard}: {kind} {whole[:16]}... differs from the manifest's "
                f"{expect[:16]}... (the file changed after pruning)"
            )
        dst_tensor_sha.update(per)
    if bar:
        bar.close()
    return dst_tensor_sha
