"""``reap verify``'s checks of ``pruning_manifest.json`` against the checkpoint: format,
counts, the kept ids of every MoE layer, and the output shards' sizes and checksums. A
hand-edited or damaged manifest is a failure in the report, never a crash."""

from __future__ import annotations

import json
from pathlib import Path

from .byte_copy import new_hasher
from .errors import CheckpointError
from .manifest import MANIFEST_FORMAT, MANIFEST_NAME
from .verify_report import VerifyReport

__all__ = ["check_manifest_or_report", "read_manifest", "recorded_cuts"]


def recorded_cuts(manifest) -> dict[str, int] | None:
    """The manifest's cut tensors (name -> dimension), when it records them."""
    try:
        cuts = manifest["checkpoint"]["cut_tensors"]
        return {str(name): int(dim) for name, dim in cuts.items()}
    except (TypeError, KeyError, ValueError, AttributeError):
        return None


def read_manifest(mpath: Path, source, report: VerifyReport) -> dict | None:
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


def check_manifest_or_report(manifest: dict, report: VerifyReport, blocks, E, shards):
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


def post_cut_lines(manifest: dict) -> list[str]:
    """One line per post-cut component the manifest records (``router_fit.components``):
    kept or dropped, the held-out KL before and after, the tensors it changed; first, a
    line for a block-error selection (its objective, how far it moved from the cut)."""
    fit = manifest.get("router_fit") if isinstance(manifest, dict) else None
    components = fit.get("components") if isinstance(fit, dict) else None
    lines = []
    selection = fit.get("selection") if isinstance(fit, dict) else None
    if isinstance(selection, dict) and selection.get("method") == "block_error":
        groups = selection.get("groups")
        objective = (
            f"worst {groups.get('column')} of {', '.join(groups.get('names') or [])}"
            if isinstance(groups, dict)
            else "pooled"
        )
        kept_cut = selection.get("layers_keeping_ranking_cut") or []
        order = selection.get("candidate_order")
        lines.append(
            f"selection: block_error ({objective} error); {selection.get('differs_from_ranking')} "
            f"kept experts differ from {order}'s cut"
            + (f"; {len(kept_cut)} layer(s) keep that cut" if kept_cut else "")
            + _end_to_end(selection.get("end_to_end"), order)
        )
    for c in components if isinstance(components, list) else []:
        if not isinstance(c, dict):
            continue
        before, after = c.get("kl_before"), c.get("kl_after")
        kl = (
            f"held-out KL {before:.5g} -> {after:.5g}"
            if isinstance(before, int | float) and isinstance(after, int | float)
            else "not validated"
        )
        status = "kept" if c.get("kept") else "dropped (not better beyond its standard error)"
        tensors = ", ".join(c.get("tensors") or []) or "none"
        lines.append(f"{c.get('name')}: {status}; {kl}; tensors per layer: {tensors}")
    return lines


def _end_to_end(e2e, order) -> str:
    """The end-to-end check of a block-error selection against the ranking's cut."""
    if not isinstance(e2e, dict):
        return ""
    if not e2e.get("checked"):
        return f"; applied unchecked end to end ({e2e.get('reason')})"
    applied = (
        "the selection applied" if e2e.get("applied") == "block_error" else f"{order}'s cut applied"
    )
    cut, sel = e2e.get("kl_ranking_cut"), e2e.get("kl_selection")
    if isinstance(cut, int | float) and isinstance(sel, int | float):
        return f"; held-out KL {order}'s cut {cut:.5g}, selection {sel:.5g}: {applied}"
    return f"; {applied}"
