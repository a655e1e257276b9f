"""Which experts to keep: REAP's saliency vs cheap variants vs block-error selection, on
the bundled model calibrated on en + zh + code.

One calibration set (``--tokens-per-lang`` of each language's ``calib`` split): REAP's
statistics come from ``oneshot`` (``scores_path``), the MoE blocks' inputs and outputs
of the unpruned model from forward hooks, each token labelled with its language. At
each sparsity every layer is cut by:

- ``reap``: REAP saliency (mean gate x output norm over routed tokens);
- ``reap_x_freq``: REAP x routed count (the sum of gate x norm);
- ``man``: Mean Activation Norm (arXiv 2606.15716: mean output norm over routed tokens,
  gate-free; the scores file's ``ean_mean``);
- ``block_error``: :func:`reap_modifier.post_cut.block_selection.select_by_block_error` on 7 of
  every 8 calibration tokens, the worst language's error as the objective (``--pooled``
  adds ``block_pooled``: the pooled error).

Judged by (1) the held-out layer-local error (every 8th calibration token, never used
by the block-error search; REAP's statistics saw all tokens), pooled and worst language,
per layer; (2) ``KL(unpruned || pruned)`` per language on held-out windows (the
development split by default: ``--split``, :mod:`window_metrics`), each layer cut with the
layer's choice.

    PYTHONPATH=src python benchmarks/selection_quality.py --out out/selection_quality.json
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

import torch
from window_metrics import add_split_argument, held_out_windows, per_window_metrics

from reap_modifier.demo.config import LANGS

HOLDOUT_EVERY = 8


def _capture(model, layers, rows):
    """Per layer: block inputs and outputs ``[N, H]`` of the unpruned model on ``rows``."""
    store = {layer.name: ([], []) for layer in layers}
    hooks = []
    for layer in layers:

        def hook(module, args, output, name=layer.name):
            out = output[0] if isinstance(output, tuple) else output
            store[name][0].append(args[0].detach().reshape(-1, args[0].shape[-1]).float())
            store[name][1].append(out.detach().reshape(-1, out.shape[-1]).float())

        hooks.append(layer.block.register_forward_hook(hook))
    with torch.no_grad():
        for ids in rows:
            model(input_ids=torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return {n: (torch.cat(x), torch.cat(y)) for n, (x, y) in store.items()}


def main() -> None:
    from llmcompressor import oneshot
    from transformers import AutoTokenizer

    from reap_modifier import REAPPruningModifier
    from reap_modifier.demo import data as D
    from reap_modifier.demo.config import DEFAULT_MODEL
    from reap_modifier.demo.workspace import load_model
    from reap_modifier.evaluation import paired_difference
    from reap_modifier.models import find_moe_architecture
    from reap_modifier.post_cut.block_selection import BlockErrorEvaluator, select_by_block_error
    from reap_modifier.scores import ExpertScores
    from reap_modifier.scores.keep_count import compute_keep_count
    from reap_modifier.scores.plan import PruningPlan, select_experts
    from reap_modifier.surgery import apply_plan

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.5, 0.75])
    ap.add_argument("--tokens-per-lang", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--pooled", action="store_true", help="also the pooled objective")
    ap.add_argument("--out", default=None)
    add_split_argument(ap)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t_start = time.time()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    calib = {lang: D.load_split(args.data_dir, lang, "calib") for lang in LANGS}
    dataset = D.calibration_dataset(
        calib, tokenizer, args.tokens_per_lang, args.seq_len, with_meta=True
    )
    rows, row_langs = dataset["input_ids"], dataset["lang"]
    labels = torch.cat(
        [torch.full((len(r),), LANGS.index(lang)) for r, lang in zip(rows, row_langs)]
    )
    windows = held_out_windows(
        tokenizer, args.eval_windows, args.seq_len, args.data_dir, split=args.split
    )

    def fresh():
        return load_model(args.model, packed=False, dtype="float32")

    # 1. REAP statistics on the calibration set; the blocks' unpruned inputs / outputs
    scores_path = Path(tempfile.mkdtemp(prefix="selection-quality-")) / "scores.safetensors"
    plain = dataset.remove_columns(["lang", "source_tokens"])
    oneshot(
        model=fresh(),
        recipe=[REAPPruningModifier(sparsity=0.5, scores_path=str(scores_path))],
        processor=tokenizer,
        dataset=plain,
        num_calibration_samples=len(plain),
    )
    scores = ExpertScores.load(scores_path)
    reap, man = scores.saliency("reap"), scores.saliency("ean_mean")
    count = scores.saliency("frequency")
    unpruned = fresh()
    arch = find_moe_architecture(unpruned)
    io = _capture(unpruned, arch.layers, rows)
    held = torch.zeros(labels.numel(), dtype=torch.bool)
    held[HOLDOUT_EVERY - 1 :: HOLDOUT_EVERY] = True
    t_setup = time.time() - t_start

    results: dict = {"args": vars(args), "setup_seconds": t_setup, "sparsity": {}}
    methods = ("reap", "reap_x_freq", "man", "block_error")
    methods = methods[:3] + ("block_pooled",) + methods[3:] if args.pooled else methods
    for sparsity in args.sparsity:
        kc = compute_keep_count(
            arch.num_experts,
            arch.top_k,
            sparsity=sparsity,
            n_group=arch.n_group,
            topk_group=arch.topk_group,
        )
        keep = kc.keep
        kept = {m: {} for m in methods}
        layer_rec: dict = {}
        for layer in arch.layers:
            n = layer.name
            x, y = io[n]
            kept["reap"][n] = select_experts(reap[n], keep)
            kept["reap_x_freq"][n] = select_experts(reap[n] * count[n], keep)
            kept["man"][n] = select_experts(man[n], keep)
            t0 = time.time()
            if args.pooled:
                kept["block_pooled"][n], _ = select_by_block_error(
                    layer, x[~held], y[~held], keep, ranking=reap[n]
                )
            kept["block_error"][n], rec = select_by_block_error(
                layer, x[~held], y[~held], keep, ranking=reap[n], groups=labels[~held]
            )
            ev = BlockErrorEvaluator(layer, x[held], y[held], labels[held])
            masks = torch.zeros(len(methods), arch.num_experts, dtype=torch.bool)
            for i, m in enumerate(methods):
                masks[i, kept[m][n]] = True
            per_lang = ev.errors(masks)
            tok = ev.token_errors(masks).sum(-1) / y[held].double().pow(2).sum()
            layer_rec[n] = {
                m: {
                    "pooled": float(tok[i]),
                    "worst": float(per_lang[i].max()),
                    "per_lang": dict(zip(LANGS, per_lang[i].tolist())),
                }
                for i, m in enumerate(methods)
            }
            print(
                f"{sparsity} {n}: searched in {time.time() - t0:.1f} s "
                f"({rec.evaluations} evaluations)",
                flush=True,
            )
            layer_rec[n]["search"] = {
                "seconds": time.time() - t0,
                "evaluations": rec.evaluations,
                "expert_calls": rec.expert_calls,
                "fit_objective": rec.objective,
            }
        models = {"unpruned": unpruned}
        for m in methods:
            model = copy.deepcopy(unpruned)
            plan = PruningPlan(kept=kept[m], num_experts=arch.num_experts, saliency=m)
            apply_plan(model, find_moe_architecture(model), plan)
            models[m] = model
        kl = {}
        for lang in LANGS:
            pw = per_window_metrics(models, windows[lang], "unpruned", args.chunk)
            kl[lang] = {m: sum(pw[m]["kl"]) / len(pw[m]["kl"]) for m in methods}
            kl[lang]["vs_reap"] = {
                m: paired_difference(pw["reap"]["kl"], pw[m]["kl"]) for m in methods[1:]
            }
        results["sparsity"][str(sparsity)] = {
            "keep": keep,
            "layers": layer_rec,
            "kl": kl,
            "kept": kept,
        }
        del models
    results["seconds"] = time.time() - t_start
    _print(results, methods)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))


def _print(results: dict, methods) -> None:
    for sp, r in results["sparsity"].items():
        print(f"\n## sparsity {sp} (keep {r['keep']})\n")
        print("held-out layer-local error, pooled / worst language:\n")
        print("| layer | " + " | ".join(methods) + " |")
        print("|---|" + "---|" * len(methods))
        for n, rec in r["layers"].items():
            cells = [f"{rec[m]['pooled']:.4f} / {rec[m]['worst']:.4f}" for m in methods]
            print(f"| {n.split('.')[-2]} | " + " | ".join(cells) + " |")
        print("\nKL(unpruned || pruned) per language, held-out windows (method - reap ± SE):\n")
        print("| language | " + " | ".join(methods) + " |")
        print("|---|" + "---|" * len(methods))
        for lang, row in r["kl"].items():
            cells = [f"{row['reap']:.4f}"] + [
                f"{row[m]:.4f} ({row['vs_reap'][m]['mean']:+.4f} ± {row['vs_reap'][m]['se']:.4f})"
                for m in methods[1:]
            ]
            print(f"| {lang} | " + " | ".join(cells) + " |")
        secs = [rec["search"]["seconds"] for rec in r["layers"].values()]
        print(f"\nsearch (both objectives) per layer: {max(secs):.1f} s at most")
    print(f"\ntotal {results['seconds']:.0f} s (setup {results['setup_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
