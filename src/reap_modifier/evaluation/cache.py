"""The reference cache: the reference's output on the evaluation windows, written once and
reused, so several candidates (pruned tiers) compare against one reference run and a source
model that only fits a whole node is served once, not once per candidate.

A cache directory holds ``reference.json`` (what it was computed from: the reference's
identity, backend, dtype, top-N, generation length, and per label the sha256 of the windows and
prompts) and ``reference.safetensors`` (per label: per-window NLL sums and predicted positions,
top-N token ids and log-probs at every predicted position, and the greedy generations).

It is reused only when all of that agrees; otherwise the reference is computed again and the
cache rewritten (atomically), and :func:`load_cache` says why. The reference's identity
(:func:`reference_identity`) is its ``config.json`` and a fingerprint of its weight files that
costs no more than reading their headers: per file its size, modification time, the sha256 of
its safetensors header (names, dtypes, shapes, offsets) and, when ``reap prune`` wrote it, the
checksum its manifest records. Two checkpoints of one model (the source and a tier, or a tier
and its router-fitted copy) never share one.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch

from ..fileio import atomic_path, sha256_file, write_json_atomic
from .hf import ReferenceTopN

__all__ = ["CACHE_FORMAT", "identity_difference", "load_cache", "reference_identity", "save_cache"]

CACHE_FORMAT = "reap-eval-reference"

#: weight files a checkpoint directory may hold
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")

#: what must agree besides the reference's identity, in the order the reason names them
_SETTINGS = ("backend", "dtype", "top_n", "gen_tokens")


def _header_sha256(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 512 << 20:
                return None
            return hashlib.sha256(f.read(n)).hexdigest()
    except (OSError, struct.error):
        return None


def _manifest_checksums(d: Path) -> dict[str, str]:
    """Per output shard, the checksum ``reap prune``'s manifest records (``algo:hex``)."""
    try:
        m = json.loads((d / "pruning_manifest.json").read_text())
        shards = m["checkpoint"]["output_shards"]
        algo = m["checkpoint"].get("output_checksum") or "sha256"
        return {name: f"{algo}:{e[algo]}" for name, e in shards.items() if e.get(algo)}
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
        return {}


def reference_identity(checkpoint: str | os.PathLike) -> dict:
    """What identifies a checkpoint to the cache: ``config_sha256`` and per weight file
    ``bytes``, ``mtime_ns``, ``header_sha256`` (safetensors) and ``checksum`` (when the
    ``reap prune`` manifest records one). Reads headers only, never the weights."""
    d = Path(checkpoint)
    sums = _manifest_checksums(d)
    weights = {}
    for f in sorted(d.iterdir()):
        if not f.is_file() or not f.name.endswith(WEIGHT_SUFFIXES):
            continue
        st = f.stat()
        entry: dict = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
        if f.name.endswith(".safetensors"):
            entry["header_sha256"] = _header_sha256(f)
        if f.name in sums:
            entry["checksum"] = sums[f.name]
        weights[f.name] = entry
    return {"config_sha256": sha256_file(d / "config.json"), "weights": weights}


_FIELD_WORDS = {
    "bytes": "size",
    "mtime_ns": "modification time",
    "header_sha256": "tensor header (names, dtypes, shapes)",
    "checksum": "checksum in its pruning manifest",
}


def identity_difference(cached: dict | None, now: dict) -> str | None:
    """Which field of two :func:`reference_identity` records differs first, in words
    (``None`` when they are equal)."""
    if not cached:
        return "the cache does not record which reference it holds"
    if cached.get("config_sha256") != now["config_sha256"]:
        return "the reference's config.json differs"
    a, b = cached.get("weights") or {}, now["weights"]
    if sorted(a) != sorted(b):
        return f"the reference's weight files differ ({sorted(a)} cached, {sorted(b)} now)"
    for name in sorted(b):
        for key in sorted(set(a[name]) | set(b[name])):
            if a[name].get(key) != b[name].get(key):
                return f"the {_FIELD_WORDS.get(key, key)} of the reference's {name} differs"
    return None


def cache_mismatch(stored: dict, meta: dict) -> str | None:
    """Why the stored cache metadata does not answer for ``meta`` (``None`` when it does)."""
    if stored.get("format") != CACHE_FORMAT:
        return "not a reap eval reference cache"
    why = identity_difference(stored.get("reference_identity"), meta["reference_identity"])
    if why:
        return why
    for key in _SETTINGS:
        if stored.get(key) != meta.get(key):
            return f"{key} differs ({stored.get(key)!r} cached, {meta.get(key)!r} now)"
    if sorted(stored.get("labels") or {}) != sorted(meta["labels"]):
        return f"the text labels differ ({sorted(stored.get('labels') or {})} cached)"
    for label, hashes in meta["labels"].items():
        if stored["labels"][label] != hashes:
            return f"the windows or prompts of {label!r} differ"
    if meta.get("lm_eval") and (stored.get("lm_eval") or {}).get("spec") != meta["lm_eval"]["spec"]:
        return "the lm-eval tasks differ"
    return None


def load_cache(
    directory: str | os.PathLike, meta: dict
) -> tuple[tuple[dict[str, ReferenceTopN], dict[str, list[list[int]]], dict] | None, str]:
    """The cached reference and a word on it: ``((refs, generations, stored), "reused")`` when
    ``directory`` holds one computed for ``meta`` (see the module docstring), else
    ``(None, why not)``. ``refs`` / ``generations`` are per label; ``stored`` is the stored
    metadata, which carries the reference's lm-eval results when that ran (``meta`` asking
    for lm-eval results (``lm_eval``) needs them for the same tasks)."""
    d = Path(directory)
    if not (d / "reference.json").exists():
        return None, "absent"
    try:
        stored = json.loads((d / "reference.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        return None, f"reference.json is unreadable ({exc})"
    why = cache_mismatch(stored, meta) if isinstance(stored, dict) else "not a cache"
    if why:
        return None, why
    from safetensors.torch import load_file

    try:
        t = load_file(str(d / "reference.safetensors"))
        refs, gens = {}, {}
        for label in meta["labels"]:
            refs[label] = ReferenceTopN(
                t[f"{label}/nll"].tolist(),
                t[f"{label}/n"].tolist(),
                t[f"{label}/top_ids"],
                t[f"{label}/top_lp"],
            )
            g = t.get(f"{label}/generations")
            gens[label] = g.tolist() if g is not None else []
    except Exception as exc:  # noqa: BLE001 - a torn or foreign file: recompute
        return None, f"reference.safetensors is unreadable ({type(exc).__name__})"
    return (refs, gens, stored), "reused"


def save_cache(
    directory: str | os.PathLike,
    meta: dict,
    refs: dict[str, ReferenceTopN],
    generations: dict[str, list[list[int]]],
) -> Path:
    """Write the cache (both files replaced atomically; the JSON, which makes it valid, last)."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for label, r in refs.items():
        tensors[f"{label}/nll"] = torch.tensor(r.nll, dtype=torch.float64)
        tensors[f"{label}/n"] = torch.tensor(r.n, dtype=torch.float64)
        tensors[f"{label}/top_ids"] = r.top_ids.to("cpu", torch.int32).contiguous()
        tensors[f"{label}/top_lp"] = r.top_lp.to("cpu", torch.float32).contiguous()
        if generations.get(label):
            tensors[f"{label}/generations"] = torch.tensor(generations[label], dtype=torch.int64)
    (d / "reference.json").unlink(missing_ok=True)  # never an old key over new tensors
    with atomic_path(d / "reference.safetensors") as tmp:
        save_file(tensors, str(tmp))
    write_json_atomic(d / "reference.json", {"format": CACHE_FORMAT, **meta})  # last: the key
    return d
