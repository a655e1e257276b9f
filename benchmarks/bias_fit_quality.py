"""Cut alone, router fit, router fit + bias fit on the bundled model, per layer and language.

REAP scores are computed once on the en + zh + code calibration splits (``oneshot`` with
``scores_path``); each MoE block's unpruned inputs and outputs on the same calibration
windows are captured with forward hooks on the unpruned model. At each sparsity the model
is cut from the scores, then per layer (on the captured unpruned inputs / outputs, as the
modifier fits): :func:`reap_modifier.post_cut.router_fit.fit_router` (rows written), then
:func:`reap_modifier.post_cut.bias_fit.fit_bias` (bias written). Reported: the held-out
layer-local error per layer (every 8th fitting token, as both fits hold out) after the cut,
after the router fit and after the bias fit, and ``KL(unpruned || model)`` per language on
held-out windows (never used to fit; the development split by default: ``--split``,
:mod:`window_metrics`) for the cut alone, the router
fit and the router fit + bias fit (``--bias-alone`` adds the bias fit without the router
fit), with the paired difference of the last step.

    PYTHONPATH=src python benchmarks/bias_fit_quality.py --out out/bias_fit_quality.json

About 3 minutes of CPU time with the defaults (one thread; measured 3 min 9 s user, 9 min
wall on a shared 2-core machine under load); the results are in
``docs/router-calibration.md``.
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


def capture_block_io(model, dataset) -> dict:
    """``layer name -> (X [N, H], Y [N, H])`` of every MoE block on the dataset's tokens."""
    from reap_modifier.models import find_moe_architecture

    arch = find_moe_architecture(model)
    io = {layer.name: ([], []) for layer in arch.layers}

    def hook(name):
        def fn(module, args, out):
            x = args[0]
            y = out[0] if isinstance(out, tuple) else out
            io[name][0].append(x.detach().reshape(-1, x.shape[-1]))
            io[name][1].append(y.detach().reshape(-1, x.shape[-1]))

        return fn

    hooks = [layer.block.register_forward_hook(hook(layer.name)) for layer in arch.layers]
    with torch.no_grad():
        for ids in dataset["input_ids"]:
            model(input_ids=torch.tensor([ids]), use_cache=False)
    for h in hooks:
        h.remove()
    return {n: (torch.cat(xs), torch.cat(ys)) for n, (xs, ys) in io.items()}


def cut(fresh, sparsity, scores, tokenizer):
    from llmcompressor import oneshot

    from reap_modifier import REAPPruningModifier

    model = fresh()
    oneshot(
        model=model,
        recipe=[REAPPruningModifier(sparsity=sparsity, scores_in=str(scores))],
        processor=tokenizer,
    )
    return model


def fit(model, io, *, router: bool, bias: bool, steps: int, lr: float, sweeps: int) -> dict:
    """Fit each layer in place; ``layer -> {stage: held-out error}`` and the fits' records."""
    from reap_modifier.models import find_moe_architecture
    from reap_modifier.post_cut.bias_fit import BIAS_ATTR, fit_bias
    from reap_modifier.post_cut.router_fit import fit_router

    out = {}
    for layer in find_moe_architecture(model).layers:
        x, y = io[layer.name]
        rec = {}
        t0 = time.perf_counter()
        if router:
            rows, r = fit_router(layer, x, y, steps=steps, lr=lr)
            with torch.no_grad():
                for name, tensor in rows.items():
                    getattr(layer.router, name).copy_(tensor)
            rec["router"] = r.to_dict()
        t1 = time.perf_counter()
        if bias:
            b, r = fit_bias(layer, x, y, sweeps=sweeps)
            with torch.no_grad():
                getattr(layer.router, BIAS_ATTR).copy_(b)
            rec["bias"] = r.to_dict()
        if router:
            rec["seconds_router"] = t1 - t0
        if bias:
            rec["seconds_bias"] = time.perf_counter() - t1
        out[layer.name] = rec
    return out


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
    ap.add_argument("--tokens-per-lang", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=0.03)
    ap.add_argument("--sweeps", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--bias-alone", action="store_true")
    ap.add_argument("--out", default=None)
    add_split_argument(ap)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    calib = {lang: D.load_split(args.data_dir, lang, "calib") for lang in LANGS}
    dataset = D.calibration_dataset(calib, tokenizer, args.tokens_per_lang, args.seq_len)
    windows = held_out_windows(
        tokenizer, args.eval_windows, args.seq_len, args.data_dir, split=args.split
    )

    def fresh():
        return load_model(args.model, packed=False, dtype="float32")

    from llmcompressor import oneshot

    scores = Path(tempfile.mkdtemp(prefix="bias-fit-quality-")) / "scores.safetensors"
    oneshot(
        model=fresh(),
        recipe=[REAPPruningModifier(sparsity=0.5, scores_path=str(scores))],
        processor=tokenizer,
        dataset=dataset,
        num_calibration_samples=len(dataset),
    )
    unpruned = fresh()
    io = capture_block_io(unpruned, dataset)
    print(f"captured {next(iter(io.values()))[0].shape[0]} tokens per block", flush=True)
    # (base model, router fit, bias fit): each variant is a copy of its base, fitted further
    variants = {
        "cut": (None, False, False),
        "router": ("cut", True, False),
        "router+bias": ("router", False, True),
    }
    if args.bias_alone:
        variants["bias"] = ("cut", False, True)
    results, kl_rows, layer_rows = {}, [], []
    for sparsity in args.sparsity:
        key = f"{int(sparsity * 100)}%"
        models, fits = {"unpruned": unpruned}, {}
        for name, (base, router, bias) in variants.items():
            model = cut(fresh, sparsity, scores, tokenizer) if base is None else None
            models[name] = model or copy.deepcopy(models[base])
            fits[name] = fit(
                models[name],
                io,
                router=router,
                bias=bias,
                steps=args.steps,
                lr=args.lr,
                sweeps=args.sweeps,
            )
            if base is not None:  # the records of the fits it inherits
                fits[name] = {n: {**fits[base][n], **r} for n, r in fits[name].items()}
        results[key] = {"fits": fits, "langs": {}}
        for layer, rec in fits["router+bias"].items():
            r, b = rec["router"], rec["bias"]
            alone = fits["bias"][layer]["bias"]["holdout_after"] if "bias" in fits else None
            layer_rows.append(
                f"| {key} | {layer.split('.')[-2]} | {r['holdout_before']:.4f} | "
                f"{r['holdout_after']:.4f} | {b['holdout_after']:.4f} | {alone or float('nan'):.4f} | "
                f"{b['moves']} / {b['best_move']} | {b['block_rows'] / b['tokens']:.1f} | "
                f"{rec['seconds_bias']:.1f} |"
            )
        for lang in LANGS:
            pw = per_window_metrics(models, windows[lang], "unpruned", args.chunk)
            kl = {n: sum(v["kl"]) / len(v["kl"]) for n, v in pw.items() if n != "unpruned"}
            diff = paired_difference(pw["router"]["kl"], pw["router+bias"]["kl"])
            results[key]["langs"][lang] = {"kl": kl, "diff_router_bias_minus_router": diff}
            kl_rows.append(
                f"| {key} | {lang} | {kl['cut']:.4f} | {kl['router']:.4f} | "
                f"{kl['router+bias']:.4f} | {kl.get('bias', float('nan')):.4f} | "
                f"{diff['mean']:+.4f} ± {diff['se']:.4f} |"
            )
            print("row:", kl_rows[-1], flush=True)
    print(
        "\n| sparsity | layer | held-out cut | + router fit | + bias fit | bias fit alone | "
        "bias moves / kept | block rows / N | bias fit s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(layer_rows))
    print(
        "\n| sparsity | language | KL cut | KL router | KL router+bias | KL bias | "
        "ΔKL (router+bias − router) ± SE |"
    )
    print("|---|---|---|---|---|---|---|")
    print("\n".join(kl_rows))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
