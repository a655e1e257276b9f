"""Compensation after the cut on the bundled model, layer by layer and end to end:
REAP(en+zh+code) alone, + router fit, + the closed-form refit of the output projections
(shared expert ``down_proj`` and ``routed_expert_up_proj`` jointly, ridge chosen on held-out
tokens), + Adam over the shared expert, the up-projection and the router rows, and the
closed form followed by Adam. Prints each layer's held-out layer-local error and the KL to
the unpruned model per language on held-out windows (the development split by default:
``--split``, :mod:`window_metrics`). An
independent implementation of what ``reap_modifier.post_cut.compensation`` does, written to choose
the method; the numbers of docs/router-calibration.md's compensation tables come from it.

    PYTHONPATH=src python benchmarks/compensation_quality.py --sparsity 0.5 0.75 \
        --variants fit fit+ls fit+adam fit+ls+adam --out out/compensation_quality.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
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


def capture(model, dataset, fn_modules):
    """Run model over dataset windows; return per-key list of captured tensors."""
    store = {}
    hooks = []
    for key, (mod, kind) in fn_modules.items():
        store[key] = []

        def hook(m, args, out, key=key, kind=kind):
            t = args[0] if kind == "in" else (out[0] if isinstance(out, tuple) else out)
            store[key].append(t.detach().reshape(-1, t.shape[-1]).clone())

        hooks.append(mod.register_forward_hook(hook))
    with torch.no_grad():
        for ids in dataset["input_ids"]:
            model(input_ids=torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return {k: torch.cat(v) for k, v in store.items()}


def held_mask(n):
    m = torch.zeros(n, dtype=torch.bool)
    m[7::8] = True
    return m


def ridge_refit(block, X, Y, lams=(0.0, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)):
    """Joint LS of routed_expert_up_proj and shared down_proj on features [z, h]."""
    feats = capture_block_feats(block, X)
    z, h = feats["z"], feats["h"]
    F = torch.cat([z, h], dim=1).double()
    T = Y.double()
    held = held_mask(F.shape[0])
    Ff, Tf, Fh, Th = F[~held], T[~held], F[held], T[held]
    G = Ff.T @ Ff
    B = Ff.T @ Tf
    scale = G.diagonal().mean()
    W0 = torch.cat([block.routed_expert_up_proj.weight, block.shared_experts.down_proj.weight], 1)
    W0 = W0.double()
    base = ((Fh @ W0.T - Th).pow(2).sum() / Th.pow(2).sum()).item()
    best = (base, None, None)
    for lam in lams:
        W = torch.linalg.solve(G + lam * scale * torch.eye(G.shape[0], dtype=G.dtype), B).T
        err = ((Fh @ W.T - Th).pow(2).sum() / Th.pow(2).sum()).item()
        if err < best[0]:
            best = (err, lam, W)
    if best[2] is not None:
        W = best[2].float()
        d = z.shape[1]
        block.routed_expert_up_proj.weight.data.copy_(W[:, :d])
        block.shared_experts.down_proj.weight.data.copy_(W[:, d:])
    return {"held_before": base, "held_after": best[0], "lam": best[1]}


def capture_block_feats(block, X):
    out = {}
    h1 = block.routed_expert_up_proj.register_forward_hook(
        lambda m, a, o: out.__setitem__("z", a[0].reshape(-1, a[0].shape[-1]).detach())
    )
    h2 = block.shared_experts.down_proj.register_forward_hook(
        lambda m, a, o: out.__setitem__("h", a[0].reshape(-1, a[0].shape[-1]).detach())
    )
    with torch.no_grad():
        block(X.unsqueeze(0))
    h1.remove()
    h2.remove()
    return out


def adam_dense(layer, X, Y, steps=200, lr=1e-3, with_router=True):
    from reap_modifier.post_cut.block_fit import ExpertCache as _ExpertCache
    from reap_modifier.post_cut.block_fit import differentiable_dispatch, relative_error

    block = layer.block
    params = list(block.routed_expert_up_proj.parameters()) + list(
        block.shared_experts.parameters()
    )
    if with_router:
        params.append(block.gate.weight)
    saved = [p.detach().clone() for p in params]
    for p in params:
        p.requires_grad_(True)
    held = held_mask(X.shape[0])
    xf, yf, xh, yh = X[~held], Y[~held], X[held], Y[held]
    cf, ch = _ExpertCache(), _ExpertCache()

    def loss(x, y, c):
        with differentiable_dispatch(layer, c):
            o = block(x.unsqueeze(0))
        return relative_error(o.reshape(y.shape), y)

    opt = torch.optim.Adam(params, lr=lr)
    with torch.no_grad():
        best = loss(xh, yh, ch).item()
    before = best
    best_state = [p.detach().clone() for p in params]
    for _s in range(steps):
        opt.zero_grad()
        with torch.enable_grad():
            lo = loss(xf, yf, cf)
            lo.backward()
        opt.step()
        with torch.no_grad():
            hl = loss(xh, yh, ch).item()
        if hl < best:
            best = hl
            best_state = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, b in zip(params, best_state):
            p.copy_(b)
            p.requires_grad_(False)
    del saved
    return {"held_before": before, "held_after": best}


def main():
    from transformers import AutoTokenizer

    from reap_modifier import REAPPruningModifier
    from reap_modifier.demo import data as D
    from reap_modifier.demo.config import DEFAULT_MODEL
    from reap_modifier.demo.workspace import load_model
    from reap_modifier.models import find_moe_architecture
    from reap_modifier.post_cut.router_fit import fit_router

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens-per-lang", type=int, default=4096)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.5, 0.75])
    ap.add_argument("--variants", nargs="+", default=["fit", "fit+ls", "fit+adam"])
    ap.add_argument("--out", default=None, help="write the KLs and the arguments here as JSON")
    add_split_argument(ap)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = str(DEFAULT_MODEL)
    tok = AutoTokenizer.from_pretrained(model_dir)
    calib = {lang: D.load_split(None, lang, "calib") for lang in LANGS}
    ds = D.calibration_dataset(calib, tok, args.tokens_per_lang, 256)
    windows = held_out_windows(tok, args.eval_windows, 256, split=args.split)

    def fresh():
        return load_model(model_dir, packed=False, dtype="float32")

    ref = fresh()
    arch = find_moe_architecture(ref)
    io = capture(
        ref,
        ds,
        {
            **{(l.name, "x"): (l.block, "in") for l in arch.layers},
            **{(l.name, "y"): (l.block, "out") for l in arch.layers},
        },
    )
    scores = "/tmp/exp_scores.safetensors"
    t = time.time()
    _oneshot(fresh(), REAPPruningModifier(sparsity=0.5, scores_path=scores), tok, ds)
    print("calibrated", time.time() - t, flush=True)
    out = {}
    for sp in args.sparsity:
        alone = fresh()
        _oneshot(alone, REAPPruningModifier(sparsity=sp, scores_in=scores), tok)
        models = {"unpruned": ref, "alone": alone}
        fitted = copy.deepcopy(alone)
        for layer in find_moe_architecture(fitted).layers:
            X, Y = io[(layer.name, "x")], io[(layer.name, "y")]
            tensors, res = fit_router(layer, X, Y, steps=100, lr=0.03)
            for n, tns in tensors.items():
                getattr(layer.router, n).data.copy_(tns)
        models["fit"] = fitted
        if "fit+ls" in args.variants:
            m = copy.deepcopy(fitted)
            for layer in find_moe_architecture(m).layers:
                X, Y = io[(layer.name, "x")], io[(layer.name, "y")]
                r = ridge_refit(layer.block, X, Y)
                print(sp, "ls", layer.name, r, flush=True)
            models["fit+ls"] = m
        if "fit+adam" in args.variants:
            m = copy.deepcopy(fitted)
            for layer in find_moe_architecture(m).layers:
                X, Y = io[(layer.name, "x")], io[(layer.name, "y")]
                t = time.time()
                r = adam_dense(layer, X, Y)
                print(sp, "adam", layer.name, r, time.time() - t, flush=True)
            models["fit+adam"] = m
        if "fit+ls+adam" in args.variants:
            m = copy.deepcopy(models["fit+ls"])
            for layer in find_moe_architecture(m).layers:
                X, Y = io[(layer.name, "x")], io[(layer.name, "y")]
                r = adam_dense(layer, X, Y)
                print(sp, "ls+adam", layer.name, r, flush=True)
            models["fit+ls+adam"] = m
        for lang in LANGS:
            pw = per_window_metrics(models, windows[lang], "unpruned", 8)
            kl = {n: sum(v["kl"]) / len(v["kl"]) for n, v in pw.items()}
            a = kl["alone"]
            print(
                f"{sp} {lang} "
                + " ".join(f"{n}={v:.4f}({100 * (v / a - 1):+.0f}%)" for n, v in kl.items()),
                flush=True,
            )
            out[f"{sp}-{lang}"] = kl
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": out}, indent=1))
    else:
        json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
