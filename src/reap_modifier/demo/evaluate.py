"""The main job's evaluation metrics live in :mod:`reap_modifier.evaluation` (one
implementation for the main job and ``reap eval``); re-exported here for older imports,
with :func:`evaluate_model`, a one-model convenience the tests use."""

from __future__ import annotations

from typing import Any

from ..evaluation.hf import evaluate_models, greedy_generate, zero_routed_experts
from ..evaluation.metrics import (
    WindowMetrics,
    longest_repeat_run,
    paired_difference,
    repetition_stats,
    token_metrics,
)

__all__ = [
    "WindowMetrics",
    "evaluate_model",
    "evaluate_models",
    "greedy_generate",
    "longest_repeat_run",
    "paired_difference",
    "repetition_stats",
    "token_metrics",
    "zero_routed_experts",
]


def evaluate_model(
    model: Any, windows, reference_model: Any | None = None, *, chunk: int = 8
) -> dict:
    """One model (optionally against a reference model): see :func:`evaluate_models`."""
    models = {"model": model}
    if reference_model is not None:
        models = {"reference": reference_model, "model": model}
    return evaluate_models(
        models, windows, "reference" if reference_model is not None else None, chunk=chunk
    )["model"]
