"""Per-window NLL and KL of several models against a reference, for the quality benchmarks
(``propagate_pruned_quality.py``, ``router_fit_quality.py``): their one call site into
:mod:`reap_modifier.evaluation`, whose :func:`token_metrics` computes the sums."""

from __future__ import annotations

import torch

from reap_modifier.evaluation import token_metrics

__all__ = ["per_window_metrics"]


def per_window_metrics(models: dict, windows: torch.Tensor, reference: str, chunk: int) -> dict:
    """``name -> {"nll": [...], "kl": [...]}`` per window (nats per predicted token), every
    model against ``models[reference]``."""
    out = {name: {"nll": [], "kl": []} for name in models}
    with torch.no_grad():
        for i in range(0, windows.shape[0], chunk):
            x = windows[i : i + chunk]
            ref = models[reference](input_ids=x).logits.float()
            for name, model in models.items():
                logits = ref if name == reference else model(input_ids=x).logits.float()
                m = token_metrics(logits, x, ref)
                out[name]["nll"] += (m["nll"] / m["n"]).tolist()
                out[name]["kl"] += (m["kl"] / m["n"]).tolist()
    return out
