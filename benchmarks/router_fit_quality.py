"""REAP alone vs REAP + router calibration on the bundled model, per language.

For each calibration mix (``en``: English calibration split only; ``mixed``: en + zh +
code calibration splits) REAP scores are computed once (``oneshot`` with
``scores_path``); at each sparsity the model is cut from those scores twice, once
alone and once with ``calibrate_router`` fitted on the same calibration split. All
models are judged on held-out windows only (the development split by default: ``--split``,
:mod:`window_metrics`), against the unpruned model:
mean next-token NLL and ``KL(unpruned || model)`` per language, and the paired
difference (fit - alone) over the same windows with its standard error, through the
main job's evaluation helpers (:mod:`reap_modifier.evaluation`).

    PYTHONPATH=src python benchmarks/router_fit_quality.py --out out/router_fit_quality.json

Prints a markdown table; ``--quick`` is a smoke run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from window_metrics import add_split_argument, held_out_windows, per_window_metrics

from reap_modifier.demo.config import LANGS


def _oneshot(model, modifier, tokenizer, dataset=None):
    from llmcompressor import oneshot

    kwargs = {}
    if dataset is not None:
        kwargs = dict(dataset=dataset, num_calibration_samples=len(dataset))
    oneshot(model=model, recipe=[modifier], processor=tokenizer, **kwargs)
    return modifier


def main() -> None:
    from transformers import AutoTokenizer

    from reap_modifier import REAPPruningModifier
    from reap_modifier.demo import data as D
    from reap_modifier.demo.config import DEFAULT_MODEL
    from reap_modifier.demo.workspace import load_model
    from reap_modifier.evaluation import paired_difference

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.5, 0.75])
    ap.add_argument("--calib", nargs="+", default=["en", "mixed"], choices=["en", "mixed"])
    ap.add_argument("--tokens-per-lang", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=0.03)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    add_split_argument(ap)
    args = ap.parse_args()
    if args.quick:
        args.tokens_per_lang, args.eval_windows, args.steps, args.seq_len = 512, 4, 5, 64
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    calib = {lang: D.load_split(args.data_dir, lang, "calib") for lang in LANGS}
    windows = held_out_windows(
        tokenizer, args.eval_windows, args.seq_len, args.data_dir, split=args.split
    )

    def fresh():
        return load_model(args.model, packed=False, dtype="float32")

    results, rows = {}, []
    tmp = Path(tempfile.mkdtemp(prefix="router-fit-quality-"))
    for mix in args.calib:
        langs = ("en",) if mix == "en" else LANGS
        dataset = D.calibration_dataset(
            {lang: calib[lang] for lang in langs}, tokenizer, args.tokens_per_lang, args.seq_len
        )
        fit_tokens = int(sum(len(r) for r in dataset["input_ids"]))  # every calibration token
        scores = tmp / f"{mix}.safetensors"
        _oneshot(
            fresh(), REAPPruningModifier(sparsity=0.5, scores_path=str(scores)), tokenizer, dataset
        )
        for sparsity in args.sparsity:
            t0 = time.time()
            alone = _oneshot(
                fresh(), REAPPruningModifier(sparsity=sparsity, scores_in=str(scores)), tokenizer
            )
            t1 = time.time()
            fitted_model = fresh()
            fitted = _oneshot(
                fitted_model,
                REAPPruningModifier(
                    sparsity=sparsity,
                    scores_in=str(scores),
                    calibrate_router=True,
                    router_fit_tokens=fit_tokens,
                    router_fit_steps=args.steps,
                    router_fit_lr=args.lr,
                ),
                tokenizer,
                dataset,
            )
            t2 = time.time()
            assert alone.plan.kept == fitted.plan.kept
            models = {"unpruned": fresh(), "alone": None, "fit": fitted_model}
            models["alone"] = _alone_model(fresh, sparsity, scores, tokenizer)
            key = f"{mix}@{int(sparsity * 100)}"
            results[key] = {"fit": fitted.router_fit, "seconds_fit": t2 - t1, "langs": {}}
            for lang in LANGS:
                pw = per_window_metrics(models, windows[lang], "unpruned", args.chunk)
                rec = {}
                for metric in ("nll", "kl"):
                    a, b = pw["alone"][metric], pw["fit"][metric]
                    rec[metric] = {
                        "alone": sum(a) / len(a),
                        "fit": sum(b) / len(b),
                        "diff": paired_difference(a, b),
                    }
                results[key]["langs"][lang] = rec
                kl, nll = rec["kl"], rec["nll"]
                rows.append(
                    f"| {mix} | {int(sparsity * 100)}% | {lang} | {nll['alone']:.4f} | "
                    f"{nll['fit']:.4f} | {nll['diff']['mean']:+.4f} ± {nll['diff']['se']:.4f} | "
                    f"{kl['alone']:.4f} | {kl['fit']:.4f} | "
                    f"{100 * (kl['fit'] / kl['alone'] - 1):+.1f}% | "
                    f"{kl['diff']['mean']:+.4f} ± {kl['diff']['se']:.4f} |"
                )
                print("row:", rows[-1], flush=True)  # as it comes; the table is printed at the end
            del t0
    print(
        "| calibration | sparsity | language | NLL REAP | NLL REAP+fit | ΔNLL ± SE | "
        "KL REAP | KL REAP+fit | KL change | ΔKL ± SE |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    for key, r in results.items():
        layers = r["fit"]["layers"]
        print(
            f"{key}: fit {r['seconds_fit']:.1f} s; held-out layer-local error "
            + ", ".join(
                f"{n.split('.')[-2]}: {v['holdout_before']:.3f}->{v['holdout_after']:.3f}"
                for n, v in layers.items()
            )
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


def _alone_model(fresh, sparsity, scores, tokenizer):
    from reap_modifier import REAPPruningModifier

    model = fresh()
    _oneshot(model, REAPPruningModifier(sparsity=sparsity, scores_in=str(scores)), tokenizer)
    return model


if __name__ == "__main__":
    main()
