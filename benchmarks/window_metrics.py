"""Per-window NLL and KL of several models against a reference, for the quality benchmarks
(``propagate_pruned_quality.py``, ``router_fit_*.py``): their one call site into
:mod:`reap_modifier.evaluation`, whose :func:`token_metrics` computes the sums, and the
main job's held-out windows they are judged on."""

from __future__ import annotations

import torch

from reap_modifier.evaluation import token_metrics

__all__ = ["held_out_windows", "per_window_metrics"]


def held_out_windows(tokenizer, n_windows: int, seq_len: int, data_dir=None) -> dict:
    """``lang -> [n_windows, seq_len]`` token ids from the main job's held-out ``eval``
    split of every language (never used for calibration or fitting)."""
    from reap_modifier.demo import data as D
    from reap_modifier.demo.config import LANGS

    return {
        lang: D.eval_windows(D.load_split(data_dir, lang, "eval"), tokenizer, n_windows, seq_len)
        for lang in LANGS
    }


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
