"""Calibration-free baselines from a GGUF model: ``reap scores from-weights model.gguf``.

The router rows are ``blk.<L>.ffn_gate_inp.weight`` (GGUF dims ``[hidden, experts]``, so one
row per expert as in transformers); llama.cpp's converter stores them in f32, which holds the
transformers weights exactly, so the scores' fingerprints match those of the safetensors
model. Layers are named ``model.layers.<L>.mlp``, like calibrated scores and plans."""

from __future__ import annotations

import os
from pathlib import Path

from ..scores.baselines import baseline_scores
from ..scores.scores_file import BASELINE_METHODS, ExpertScores, ScoresError
from .binding import ROUTER
from .errors import GGUFError
from .layout import GGUFLayout, inspect_gguf

__all__ = ["gguf_router_weights", "gguf_scores_from_weights"]

_FLOAT_TYPES = {0: "float32", 1: "float16", 30: "bfloat16"}


def gguf_router_weights(path: str | os.PathLike) -> tuple[dict, GGUFLayout]:
    """``model.layers.<L>.mlp`` -> the router weight ``[experts, hidden]`` (float32), read
    from the file's byte ranges; and the file's layout."""
    import numpy as np
    import torch

    try:
        layout = inspect_gguf(path)
    except GGUFError as exc:
        raise ScoresError(str(exc)) from exc
    out = {}
    for name, (part, t) in sorted(layout.tensors.items(), key=lambda kv: _layer(kv[0])):
        if not name.endswith("." + ROUTER):
            continue
        dtype = _FLOAT_TYPES.get(t.ggml_type)
        if dtype is None:
            raise ScoresError(
                f"{name} is quantized (ggml type {t.ggml_type}); compute the baseline from the "
                "safetensors model or an f32/bf16/f16 GGUF"
            )
        with open(part.path, "rb") as f:
            f.seek(t.offset)
            raw = f.read(t.nbytes)
        if dtype == "bfloat16":
            w = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).float()
        else:
            w = torch.from_numpy(np.frombuffer(raw, dtype=dtype).astype(np.float32))
        out[f"model.layers.{_layer(name)}.mlp"] = w.reshape(t.dims[-1], t.dims[0])
    if not out:
        raise ScoresError(f"{path}: no router ({ROUTER}) in the file: not a MoE model")
    return out, layout


def _layer(name: str) -> int:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blk" and parts[1].isdigit() else -1


def gguf_scores_from_weights(path: str | os.PathLike, method: str, seed: int = 0) -> ExpertScores:
    """A baseline scores file (:func:`reap_modifier.scores.baselines.baseline_scores`) for a
    GGUF model; top-k and groups from its keys."""
    if method not in BASELINE_METHODS:
        raise ScoresError(
            f"unknown baseline {method!r}; choose one of {', '.join(BASELINE_METHODS)}"
        )
    weights, layout = gguf_router_weights(path)
    n_group, group_used = layout.groups
    meta = {
        "top_k": layout.top_k,
        "n_group": n_group,
        "topk_group": group_used,
        "gguf_architecture": layout.arch,
        "source_checkpoint": str(Path(path).resolve()),
    }
    return baseline_scores(
        method, weights, seed=seed, metadata={k: v for k, v in meta.items() if v is not None}
    )
