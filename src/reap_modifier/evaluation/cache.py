"""The reference cache: the reference's output on the evaluation windows, written once and
reused, so several candidates (pruned tiers) compare against one reference run and a source
model that only fits a whole node is served once, not once per candidate.

A cache directory holds ``reference.json`` (what it was computed from: the reference as given,
backend, dtype, top-N, generation length, and per label the sha256 of the windows and prompts)
and ``reference.safetensors`` (per label: per-window NLL sums and predicted positions, top-N
token ids and log-probs at every predicted position, and the greedy generations). It is reused
when every label's windows and prompts hash equal and backend, dtype, top-N and generation
length agree; otherwise the reference is computed again and the cache rewritten (atomically).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from .hf import ReferenceTopN

__all__ = ["CACHE_FORMAT", "load_cache", "save_cache"]

CACHE_FORMAT = "reap-eval-reference"


def _key(meta: dict) -> dict:
    return {k: meta.get(k) for k in ("backend", "dtype", "top_n", "gen_tokens", "labels")}


def load_cache(
    directory: str | os.PathLike, meta: dict
) -> tuple[dict[str, ReferenceTopN], dict[str, list[list[int]]], dict] | None:
    """The cached reference (per label: :class:`ReferenceTopN`, generations; and the stored
    metadata, which carries the reference's lm-eval results when that ran) when ``directory``
    holds one computed for ``meta`` (see the module docstring), else ``None``. When ``meta``
    asks for lm-eval results (``lm_eval``), the cache must hold them for the same tasks."""
    d = Path(directory)
    try:
        stored = json.loads((d / "reference.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if stored.get("format") != CACHE_FORMAT or _key(stored) != _key(meta):
        return None
    if meta.get("lm_eval") and (stored.get("lm_eval") or {}).get("spec") != meta["lm_eval"]["spec"]:
        return None
    from safetensors.torch import load_file

    try:
        t = load_file(str(d / "reference.safetensors"))
    except Exception:  # noqa: BLE001 - a torn or foreign file: recompute
        return None
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
    return refs, gens, stored


def save_cache(
    directory: str | os.PathLike,
    meta: dict,
    refs: dict[str, ReferenceTopN],
    generations: dict[str, list[list[int]]],
) -> Path:
    """Write the cache (both files replaced atomically, the JSON last)."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for label, r in refs.items():
        tensors[f"{label}/nll"] = torch.tensor(r.nll, dtype=torch.float64)
        tensors[f"{label}/n"] = torch.tensor(r.n, dtype=torch.float64)
        tensors[f"{label}/top_ids"] = r.top_ids.to(torch.int32).contiguous()
        tensors[f"{label}/top_lp"] = r.top_lp.float().contiguous()
        if generations.get(label):
            tensors[f"{label}/generations"] = torch.tensor(generations[label], dtype=torch.int64)
    for name, write in (
        ("reference.safetensors", lambda p: save_file(tensors, p)),
        (
            "reference.json",
            lambda p: Path(p).write_text(json.dumps({"format": CACHE_FORMAT, **meta}, indent=1)),
        ),
    ):
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=d)
        os.close(fd)
        try:
            write(tmp)
            os.replace(tmp, d / name)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return d
