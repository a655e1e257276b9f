"""Per-window NLL and KL of several models against a reference, for the quality benchmarks
(``propagate_pruned_quality.py``, ``router_fit_*.py``, ``compensation_quality.py``,
``selection_quality.py``, ``bias_fit_quality.py``): their one call site into
:mod:`reap_modifier.evaluation`, whose :func:`token_metrics` computes the sums, and the
held-out windows they are judged on.

Those windows are the development split's by default (``--split dev``: the eval split's
paragraphs that the main job's evaluation windows never read,
:func:`reap_modifier.demo.data.dev_windows`), so a benchmark that chooses a method or a
setting never sees the windows the main job's final tables report. ``--split eval`` measures
on those evaluation windows instead: for confirming a choice already made, never for making
one."""

from __future__ import annotations

import argparse

import torch

from reap_modifier.evaluation import token_metrics

__all__ = ["add_split_argument", "held_out_windows", "per_window_metrics"]

SPLITS = ("dev", "eval")


def add_split_argument(ap: argparse.ArgumentParser) -> None:
    """The benchmarks' ``--split`` option (default ``dev``)."""
    ap.add_argument(
        "--split",
        choices=SPLITS,
        default="dev",
        help="held-out windows to judge on: dev (the development split, disjoint from the main"
        " job's evaluation windows; default) or eval (those evaluation windows: only to confirm a"
        " choice already made on dev)",
    )


def held_out_windows(
    tokenizer, n_windows: int, seq_len: int, data_dir=None, split: str = "dev"
) -> dict:
    """``lang -> [n_windows, seq_len]`` token ids from the main job's held-out ``eval`` corpus
    split of every language (never used for calibration or fitting): the development split's
    windows (``split="dev"``, disjoint from the main job's evaluation windows) or the first
    ``n_windows`` of those evaluation windows (``split="eval"``)."""
    from reap_modifier.demo import data as D
    from reap_modifier.demo.config import LANGS, DemoConfig

    job = DemoConfig()
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    out = {}
    for lang in LANGS:
        records = D.load_split(data_dir, lang, "eval")
        if split == "eval":
            out[lang] = D.eval_windows(records, tokenizer, n_windows, seq_len, job.eval_seed)
        else:
            out[lang] = D.dev_windows(
                records,
                tokenizer,
                n_windows,
                seq_len,
                job.dev_seed,
                exclude=(job.eval_windows, job.eval_seq_len, job.eval_seed),
            )
    return out


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
