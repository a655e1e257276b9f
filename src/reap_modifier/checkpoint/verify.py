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

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..models.moe_fields import moe_fields
from .binding import ExpertRemap, resolve_block
from .byte_copy import new_hasher
from .destination import work_dir_kind
from .errors import CheckpointError
from .layout import (
    MODULE_EXPERT_RE,
    check_block,
    check_packed_scales,
    config_count,
    find_count_keys,
    left_behind_in,
    quant_configs,
    read_weight_map,
    scan_moe_blocks,
)
from .manifest import MANIFEST_FORMAT, MANIFEST_NAME
from .safetensors_header import ShardHeader, read_safetensors_header

__all__ = ["VerifyError", "VerifyReport", "verify_checkpoint"]

_CHUNK = 16 << 20


class VerifyError(RuntimeError):
    """A checkpoint failed verification; ``.report`` holds every failure."""

    def __init__(self, report: VerifyReport):
        self.report = report
        super().__init__(report.summary())


@dataclass
class VerifyReport:
    path: str
    source: str | None = None
    failures: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    info: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures

    def fail(self, msg: str) -> None:
        self.failures.append(msg)

    def warn(self, msg: str) -> None:
        self.warnings.append(msg)

    def raise_if_failed(self) -> VerifyReport:
        if self.failures:
            raise VerifyError(self)
        return self

    def summary(self, limit: int = 50) -> str:
        head = f"{self.path}: " + ("OK" if self.ok else f"{len(self.failures)} failure(s)")
        lines = [head]
        lines += [f"  FAIL {m}" for m in self.failures[:limit]]
        if len(self.failures) > limit:
            lines.append(f"  ... {len(self.failures) - limit} more failure(s)")
        lines += [f"  warn {m}" for m in self.warnings[:limit]]
        return "\n".join(lines)


def _hash_ranges(
    path: Path,
    size: int,
    requests: dict[str, list[tuple[int, int]]],
    *,
    whole: str | None,
    progress: Callable[[int], None] | None = None,
) -> tuple[str | None, dict[str, str]]:
    """Checksum ``whole`` (``sha256`` / ``xxh3_128``) of the whole file, and sha256 of
    each request's byte ranges, in one sequential pass (only the requested ranges are
    read when ``whole`` is None)."""
    hashers = {k: hashlib.sha256() for k in requests}
    segs = sorted((b, e, k) for k, ranges in requests.items() for b, e in ranges if e > b)
    file_h = new_hasher(whole) if whole else None
    if whole:
        windows: Iterable[tuple[int, int]] = [(0, size)]
    else:
        merged: list[tuple[int, int]] = []
        for b, e, _ in segs:
            if merged and merged[-1][1] == b:
                merged[-1] = (merged[-1][0], e)
            else:
                merged.append((b, e))
        windows = merged
    buf = memoryview(bytearray(_CHUNK))
    i = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        for w_begin, w_end in windows:
            pos = w_begin
            while pos < w_end:
                want = min(_CHUNK, w_end - pos)
                n = os.preadv(fd, [buf[:want]], pos)
                if n <= 0:
                    raise CheckpointError(f"{path}: unexpected end of file at byte {pos}")
                chunk = buf[:n]
                end = pos + n
                if file_h is not None:
                    file_h.update(chunk)
                while i < len(segs) and segs[i][0] < end:
                    b, e, k = segs[i]
                    lo, hi = max(b, pos), min(e, end)
                    if lo < hi:
                        hashers[k].update(chunk[lo - pos : hi - pos])
                    if e <= end:
                        i += 1
                    else:
                        break
                if progress is not None:
                    progress(n)
                pos = end
    finally:
        os.close(fd)
    return (file_h.hexdigest() if file_h else None, {k: h.hexdigest() for k, h in hashers.items()})


def _load_structure(path: Path, report: VerifyReport, label: str):
    """Config, weight map, headers; failures go to ``report``. Returns None if unusable."""
    if not path.is_dir():
        report.fail(f"{label} {path} is not a directory")
        return None
    cfg_file = path / "config.json"
    try:
        config = json.loads(cfg_file.read_text())
    except FileNotFoundError:
        report.fail(f"{label}: no config.json in {path}")
        return None
    except json.JSONDecodeError as exc:
        report.fail(f"{label}: config.json is not valid JSON: {exc}")
        return None
    try:
        index_file, weight_map = read_weight_map(path)
    except CheckpointError as exc:
        report.fail(f"{label}: {exc}")
        return None
    shards: dict[str, ShardHeader] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = path / shard
        if not shard_path.is_file():
            report.fail(f"{label}: shard {shard} (named by the index) does not exist")
            continue
        try:
            shards[shard] = read_safetensors_header(shard_path, shard)
        except CheckpointError as exc:
            report.fail(f"{label}: {exc}")
    entries = {}
    for name, shard in weight_map.items():
        if shard not in shards:
            continue
        if name not in shards[shard].entries:
            report.fail(f"{label}: index puts {name} in {shard}, which lacks it")
            continue
        entries[name] = shards[shard].entries[name]
    for shard, header in shards.items():
        orphans = sorted(set(header.entries) - {n for n, s in weight_map.items() if s == shard})
        for name in orphans:
            report.fail(f"{label}: tensor {name} is in {shard} but not in the index")
    indexed = set(weight_map.values())
    for p in sorted(path.rglob("*.safetensors")):
        rel = p.relative_to(path).as_posix()
        if p.is_file() and rel not in indexed:
            report.fail(f"{label}: safetensors file {rel} is not referenced by the index")
    return config, index_file, weight_map, shards, entries


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
    loaded = _load_structure(dst, report, "output")
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
    manifest = _read_manifest(mpath, source, report)
    if E is not None:
        _check_experts(config, blocks, entries, E, report, _recorded_cuts(manifest))
    block_kept, out_hashes_expected = None, {}
    if manifest is not None:
        block_kept, out_hashes_expected = _check_manifest_or_report(
            manifest, report, blocks, E, shards
        )
    _check_whole(blocks, entries, manifest, report)
    dst_tensor_sha = _hash_output_shards(shards, out_hashes_expected, source, report, progress)
    if source is not None and block_kept is not None:
        try:
            _compare_with_source(
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


def _recorded_cuts(manifest) -> dict[str, int] | None:
    """The manifest's cut tensors (name -> dimension), when it records them."""
    try:
        cuts = manifest["checkpoint"]["cut_tensors"]
        return {str(name): int(dim) for name, dim in cuts.items()}
    except (TypeError, KeyError, ValueError, AttributeError):
        return None


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


def _read_manifest(mpath: Path, source, report: VerifyReport) -> dict | None:
    """The manifest as a dict; a missing one fails only when comparing with a source."""
    manifest = None
    if mpath.is_file():
        try:
            manifest = json.loads(mpath.read_text())
        except json.JSONDecodeError as exc:
            report.fail(f"{MANIFEST_NAME} is not valid JSON: {exc}")
    else:
        (report.fail if source is not None else report.warn)(
            f"no {MANIFEST_NAME}: structural checks only"
            + (" (needed to compare with --source)" if source is not None else "")
        )
    if manifest is not None and not isinstance(manifest, dict):
        report.fail(f"{MANIFEST_NAME} is not a JSON object")
        manifest = None
    return manifest


def _check_manifest_or_report(manifest: dict, report: VerifyReport, blocks, E, shards):
    """:func:`_check_manifest`, with a hand-edited or damaged manifest reported as a failure,
    never a crash; returns ``(block_kept, expected output shard checksums)``."""
    out_hashes_expected: dict[str, tuple[str, str]] = {}
    try:
        block_kept = _check_manifest(manifest, report, blocks, E, shards, out_hashes_expected)
    except CheckpointError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        report.fail(
            f"{MANIFEST_NAME} is malformed ({type(exc).__name__}: {exc}); checkpoint.block_kept, "
            "layers and output_shards must be as reap prune writes them"
        )
        return None, {}
    return block_kept, out_hashes_expected


def _hash_output_shards(shards, out_hashes_expected, source, report, progress) -> dict[str, str]:
    """Each output shard's checksum against the manifest's; with ``source``, also every
    tensor's sha256 (returned, by tensor name)."""
    bar = _bar(progress, sum(h.file_size for h in shards.values()), "verify output")
    dst_tensor_sha: dict[str, str] = {}
    for shard, header in shards.items():
        kind, expect = out_hashes_expected.get(shard, (None, None))
        requests = (
            {n: [(e.begin, e.end)] for n, e in header.entries.items()} if source is not None else {}
        )
        if kind is None and not requests:
            continue
        whole, per = _hash_ranges(
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


def _bar(progress: bool, total: int, desc: str):
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(
        total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, dynamic_ncols=True
    )


def _check_manifest(
    manifest, report, blocks, E, shards, out_hashes_expected
) -> dict[str, list[int]] | None:
    if manifest.get("format") != MANIFEST_FORMAT:
        report.fail(
            f"{MANIFEST_NAME}: format {manifest.get('format')!r} is not {MANIFEST_FORMAT!r}"
        )
        return None
    after = manifest.get("num_experts_after")
    before = manifest.get("num_experts_before")
    if E is not None and after != E:
        report.fail(f"{MANIFEST_NAME}: num_experts_after={after} but config.json says {E}")
    ck = manifest.get("checkpoint") or {}
    block_kept = ck.get("block_kept")
    if not isinstance(block_kept, dict):
        report.fail(
            f"{MANIFEST_NAME}: no checkpoint.block_kept (not written by the checkpoint rewriter)"
        )
        return None
    if not all(isinstance(ids, list) for ids in block_kept.values()):
        report.fail(f"{MANIFEST_NAME}: checkpoint.block_kept must map layers to lists of ids")
        return None
    block_kept = {p: [int(i) for i in ids] for p, ids in block_kept.items()}
    for p in sorted(set(blocks) - set(block_kept)):
        report.fail(f"{MANIFEST_NAME}: MoE layer {p} of the checkpoint is not in the manifest")
    for p in sorted(set(block_kept) - set(blocks)):
        report.fail(f"{MANIFEST_NAME}: names MoE layer {p}, which the checkpoint lacks")
    for p, ids in block_kept.items():
        if after is not None and len(ids) != after:
            report.fail(
                f"{MANIFEST_NAME}: {p} keeps {len(ids)} experts, not num_experts_after={after}"
            )
        if ids != sorted(set(ids)) or (
            ids and (ids[0] < 0 or (before is not None and ids[-1] >= before))
        ):
            report.fail(
                f"{MANIFEST_NAME}: {p} kept ids are not ascending unique ids below {before}"
            )
    layers = manifest.get("layers") or {}
    for layer, prefix in (ck.get("layer_map") or {}).items():
        kept = (layers.get(layer) or {}).get("kept_original_ids")
        if kept is None:
            report.fail(f"{MANIFEST_NAME}: layer_map names plan layer {layer}, absent from layers")
        elif block_kept.get(prefix) != kept:
            report.fail(
                f"{MANIFEST_NAME}: kept ids of {layer} and of checkpoint block {prefix} disagree"
            )
    out = ck.get("output_shards") or {}
    for shard in sorted(set(shards) - set(out)):
        report.fail(f"{MANIFEST_NAME}: shard {shard} is not among the manifest's output shards")
    for shard, info in out.items():
        if shard not in shards:
            report.fail(f"{MANIFEST_NAME}: output shard {shard} is missing from the checkpoint")
            continue
        if info.get("bytes") is not None and info["bytes"] != shards[shard].file_size:
            report.fail(
                f"{shard}: {shards[shard].file_size} bytes, the manifest says {info['bytes']}"
            )
        for kind in ("sha256", "xxh3_128"):
            if info.get(kind):
                try:
                    new_hasher(kind)
                except (CheckpointError, ImportError):
                    report.warn(f"{shard}: cannot check its {kind} here (xxhash not installed)")
                    continue
                out_hashes_expected[shard] = (kind, info[kind])
                break
    return block_kept


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


def _compare_with_source(
    src: Path, manifest, block_kept, dst_entries, dst_tensor_sha, report, progress
) -> None:
    sub = VerifyReport(path=str(src))
    loaded = _load_structure(src, sub, "source")
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
    # expected output tensor -> (source name, byte ranges, dtype, shape)
    expected: dict[str, tuple[str, list[tuple[int, int]], str, tuple[int, ...]]] = {}
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
    bar = _bar(progress, sum(h.file_size for h in shards.values()), "verify source")
    src_sha: dict[str, str] = {}
    for shard, header in shards.items():
        requests = {
            out: ranges
            for out, (name, ranges, _, _) in expected.items()
            if weight_map[name] == shard
        }
        whole, per = _hash_ranges(
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
