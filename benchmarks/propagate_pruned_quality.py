"""Which cut makes the better model: ``propagate_pruned: true`` (each MoE layer cut as its
calibration epoch ends, later layers observed on the pruned model: llm-compressor's
behaviour) or ``false`` (every layer observed on the unpruned model: the default)?

On the bundled model (``models/tiny-k3-bilingual``) with the main job's data and
evaluation settings (``DemoConfig``): REAP calibrated on the English calibration part
(``en1``, ``tokens_per_part`` tokens), at 50% and 75% sparsity, both modes; then
held-out NLL and KL(unpruned || pruned) per language (en, zh, code; ``eval_windows``
windows of ``eval_seq_len`` tokens of the development split by default, ``--split eval``
for the main job's evaluation windows), and the paired difference true - false per window
with its standard error (windows of one text stream are not fully independent: read
the standard error as a scale, not a test).

    python benchmarks/propagate_pruned_quality.py [--quick] [--out out/propagate_pruned]

Writes ``results.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch
from window_metrics import per_window_metrics

SPARSITIES = (0.5, 0.75)


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean of ``b - a`` and its standard error."""
    from reap_modifier.evaluation import paired_difference

    d = paired_difference(a, b)
    return d["mean"], d["se"]


def prune(model_dir: Path, dataset, tokenizer, sparsity: float, propagate: bool, dtype: str):
    from llmcompressor import oneshot

    from reap_modifier import REAPPruningModifier
    from reap_modifier.demo.workspace import load_model

    model = load_model(model_dir, dtype=dtype)
    modifier = REAPPruningModifier(sparsity=sparsity, propagate_pruned=propagate)
    oneshot(
        model=model,
        recipe=[modifier],
        processor=tokenizer,
        dataset=dataset,
        num_calibration_samples=len(dataset),
    )
    return model.eval(), modifier.plan.kept


def main() -> None:
    from transformers import AutoTokenizer

    from reap_modifier.demo import data as D
    from reap_modifier.demo.config import LANGS, QUICK, DemoConfig
    from reap_modifier.demo.inputs import calibration_sets, quality_windows
    from reap_modifier.demo.workspace import load_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the job's --quick sizes")
    parser.add_argument("--out", default="out/propagate_pruned")
    parser.add_argument(
        "--split",
        choices=("dev", "eval"),
        default="dev",
        help="windows: the development split's (default) or the main job's evaluation windows",
    )
    args = parser.parse_args()
    cfg = DemoConfig(
        **{**asdict(DemoConfig()), **(QUICK if args.quick else {}), "split": args.split}
    )
    torch.set_num_threads(cfg.threads)
    model_dir = Path(cfg.model)
    data_dir = D.default_data_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    calib = {lang: D.load_split(data_dir, lang, "calib") for lang in LANGS}
    evals = {lang: D.load_split(data_dir, lang, "eval") for lang in LANGS}
    dataset = calibration_sets(calib, tokenizer, cfg)["en1"]
    windows = {lang: quality_windows(evals[lang], tokenizer, cfg) for lang in LANGS}

    models = {"unpruned": load_model(model_dir, dtype=cfg.dtype)}
    kept = {}
    for s in SPARSITIES:
        for propagate in (False, True):
            name = f"{round(100 * s)}% propagate_pruned={str(propagate).lower()}"
            models[name], kept[name] = prune(model_dir, dataset, tokenizer, s, propagate, cfg.dtype)
    metrics = {
        lang: per_window_metrics(models, windows[lang], "unpruned", cfg.eval_chunk)
        for lang in LANGS
    }

    rows = []
    for s in SPARSITIES:
        pct = round(100 * s)
        off, on = f"{pct}% propagate_pruned=false", f"{pct}% propagate_pruned=true"
        layers_differ = sum(kept[off][k] != kept[on][k] for k in kept[off])
        for lang in LANGS:
            m = metrics[lang]
            row = {"sparsity": s, "lang": lang, "layers_with_other_experts": layers_differ}
            for stat in ("nll", "kl"):
                a, b = m[off][stat], m[on][stat]
                row[f"{stat}_false"] = sum(a) / len(a)
                row[f"{stat}_true"] = sum(b) / len(b)
                row[f"{stat}_diff"], row[f"{stat}_se"] = paired(a, b)
            row["nll_unpruned"] = sum(m["unpruned"]["nll"]) / len(m["unpruned"]["nll"])
            rows.append(row)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps({"config": asdict(cfg), "rows": rows, "kept": kept}, indent=1)
    )
    print(
        f"\n{cfg.eval_windows} windows x {cfg.eval_seq_len} tokens per language; REAP on "
        f"{cfg.tokens_per_part} English calibration tokens; diff = true - false (paired, +- SE)\n"
    )
    print(
        "| sparsity | lang | NLL unpruned | NLL false | NLL true | NLL diff | KL false | KL true "
        "| KL diff | layers cut differently |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {round(100 * r['sparsity'])}% | {r['lang']} | {r['nll_unpruned']:.3f} | "
            f"{r['nll_false']:.3f} | {r['nll_true']:.3f} | {r['nll_diff']:+.3f} +- "
            f"{r['nll_se']:.3f} | {r['kl_false']:.3f} | {r['kl_true']:.3f} | "
            f"{r['kl_diff']:+.3f} +- {r['kl_se']:.3f} | {r['layers_with_other_experts']} |"
        )


if __name__ == "__main__":
    main()
