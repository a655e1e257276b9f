"""Helpers only the tests use: a split's texts, a batch's mean next-token NLL, and one model's
metrics through ``evaluate_models``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from reap_modifier.demo.data import load_split
from reap_modifier.evaluation import evaluate_models


def load_texts(data_dir: str | Path | None, lang: str, split: str) -> list[str]:
    return [r["text"] for r in load_split(data_dir, lang, split)]


def mean_nll(model: Any, batch, chunk: int = 8) -> tuple[float, int]:
    """Mean next-token NLL (nats) of a causal LM over a [n, seq_len] batch of ids and the number of
    predicted tokens. Runs under ``torch.no_grad`` in chunks of ``chunk`` rows."""
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, batch.shape[0], chunk):
            x = batch[i : i + chunk]
            logits = model(input_ids=x).logits.float()
            nll = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
            )
            total += float(nll)
            count += x[:, 1:].numel()
    return total / max(1, count), count


def evaluate_model(
    model: Any, windows: torch.Tensor, reference_model: Any | None = None, *, chunk: int = 8
) -> dict:
    """One model (optionally against a reference model): see ``evaluate_models``."""
    models = {"model": model}
    if reference_model is not None:
        models = {"reference": reference_model, "model": model}
    return evaluate_models(
        models, windows, "reference" if reference_model is not None else None, chunk=chunk
    )["model"]
