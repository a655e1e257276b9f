"""Bias fit methods compared: coordinate search (:func:`reap_modifier.post_cut.bias_fit.fit_bias`) vs a
straight-through estimator, on tiny models and on the bundled model.

Straight-through estimator: Adam on the bias (float32 master), forward with the hard top-k
selection the router makes, backward through a soft selection mask
``sigmoid((scores + bias - boundary) / T)`` (``boundary``: per token, midway between the
k-th selected and the best unselected ``scores + bias``; ``T``: a multiple of the median
gap), the weights ``scores * mask`` renormalised and scaled as the router does, the
gradient's mean removed (a uniform shift of the bias never changes the selection); every
kept expert's output on every token is cached (the surrogate needs the unselected ones).
Held-out early stopping as the fits do (every 8th token; the lowest held-out loss, with
the block's own router, over the steps).

    PYTHONPATH=src python benchmarks/bias_fit_methods.py            # tiny models
    PYTHONPATH=src python benchmarks/bias_fit_methods.py --bundled  # + the bundled model
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
import paths  # noqa: E402,F401  (tests/helpers and tests/oracles by name)

from reap_modifier.post_cut.bias_fit import BIAS_ATTR, _real_loss, fit_bias  # noqa: E402
from reap_modifier.post_cut.block_fit import HOLDOUT_EVERY, relative_error  # noqa: E402
from reap_modifier.post_cut.dispatch import block_tensor as _output  # noqa: E402
from reap_modifier.post_cut.dispatch import one_slot as _one_slot  # noqa: E402
from reap_modifier.post_cut.dispatch import routed_dispatch as _dispatch  # noqa: E402
from reap_modifier.post_cut.routing import read_rule as routing_rule  # noqa: E402
from reap_modifier.post_cut.routing import route_scores as routing  # noqa: E402
from reap_modifier.post_cut.routing import router_scores  # noqa: E402


def ste(layer, x, y, *, steps=100, temperature=1.0, lr=0.1):
    """Held-out loss before / after and the number of block evaluations (fit tokens)."""
    held = torch.zeros(x.shape[0], dtype=torch.bool)
    held[HOLDOUT_EVERY - 1 :: HOLDOUT_EVERY] = True
    xf, yf, xh, yh = x[~held], y[~held], x[held], y[held]
    router = layer.router
    rule = routing_rule(router)
    cut = getattr(router, BIAS_ATTR).detach()
    scores = router_scores(router, xf, rule)
    E = scores.shape[-1]
    one = _one_slot(layer)
    cache = {}

    @torch.no_grad()
    def all_experts(h):
        ones = torch.ones(h.shape[0], 1)
        return torch.stack(
            [one(h, torch.full((h.shape[0], 1), e), ones) for e in range(E)], dim=1
        ).float()

    def gap(v, ids):
        sel = torch.zeros_like(v, dtype=torch.bool).scatter_(-1, ids, True)
        inside = v.masked_fill(~sel, float("inf")).min(-1)[0]
        outside = v.masked_fill(sel, float("-inf")).max(-1)[0]
        return sel, inside, outside

    v0 = scores + cut.float()
    _, inside, outside = gap(v0, routing(scores, cut.float(), rule)[0])
    T = temperature * (inside - outside).abs().median().clamp_min(1e-6).item()
    bias = torch.nn.Parameter(cut.float().clone())
    opt = torch.optim.Adam([bias], lr=lr * T)
    best_held = _real_loss(layer, cut, xh, yh)
    before = best_held
    for _ in range(steps):
        v = scores + bias
        ids = routing(scores, bias.detach(), rule)[0]
        sel, inside, outside = gap(v.detach(), ids)
        boundary = ((inside + outside) / 2).unsqueeze(-1)
        soft = torch.sigmoid((v - boundary) / T)
        mask = sel.float() + soft - soft.detach()
        g = scores * mask
        if rule.renormalize:
            g = g / (g.sum(-1, keepdim=True) + 1e-20)
        g = g * rule.scaling

        def dispatch(h, _ids, _w, g=g):
            if "A" not in cache:
                cache["A"] = all_experts(h.detach())
            return torch.einsum("ne,neh->nh", g, cache["A"]).to(h.dtype)

        with torch.enable_grad(), _dispatch(layer, dispatch):
            out = _output(layer.block(xf.unsqueeze(0))).reshape(yf.shape)
            loss = relative_error(out, yf)
        opt.zero_grad()
        loss.backward()
        # a uniform shift of every bias never changes the selection: drop that direction
        # (without this Adam moves every entry by the same step while the gradient's
        # entries share a sign, and the selection never changes)
        bias.grad -= bias.grad.mean()
        opt.step()
        now = bias.detach().to(cut.dtype)
        h = _real_loss(layer, now, xh, yh)
        if h < best_held:
            best_held = h
    for p in layer.block.parameters():
        p.grad = None
    return before, best_held


def capture(model, arch, ids):
    io = {}

    def hook(name):
        def fn(module, args, out):
            y = out[0] if isinstance(out, tuple) else out
            xs, ys = io.setdefault(name, ([], []))
            xs.append(args[0].detach().reshape(-1, args[0].shape[-1]))
            ys.append(y.detach().reshape(-1, args[0].shape[-1]))

        return fn

    hooks = [layer.block.register_forward_hook(hook(layer.name)) for layer in arch.layers]
    with torch.no_grad():
        for row in ids:
            model(input_ids=row.unsqueeze(0), use_cache=False)
    for h in hooks:
        h.remove()
    return {n: (torch.cat(a), torch.cat(b)) for n, (a, b) in io.items()}


def compare(label, arch, io, args):
    for layer in arch.layers:
        x, y = io[layer.name]
        t0 = time.perf_counter()
        _, r = fit_bias(layer, x, y, sweeps=args.sweeps)
        t1 = time.perf_counter()
        rows = [
            f"| {label} | {layer.name.split('.')[-2]} | coordinate search | "
            f"{r.holdout_before:.4f} | {r.holdout_after:.4f} | "
            f"{r.block_rows / r.tokens:.1f} | {t1 - t0:.1f} |"
        ]
        for temperature in args.temperature:
            t0 = time.perf_counter()
            before, after = ste(layer, x, y, steps=args.steps, temperature=temperature, lr=args.lr)
            rows.append(
                f"| {label} | {layer.name.split('.')[-2]} | STE T={temperature}, {args.steps} steps | "
                f"{before:.4f} | {after:.4f} | {args.steps} + E/k | "
                f"{time.perf_counter() - t0:.1f} |"
            )
        print("\n".join(rows), flush=True)


def main() -> None:
    from tiny_models import build_tiny, sample_input_ids

    from reap_modifier.models import find_moe_architecture
    from reap_modifier.surgery import prune_layer

    ap = argparse.ArgumentParser()
    ap.add_argument("--sweeps", type=int, default=4)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.3, 1.0])
    ap.add_argument("--bundled", action="store_true")
    ap.add_argument("--sparsity", type=float, default=0.5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| model | layer | method | held-out cut | held-out fitted | block evals | s |")
    print("|---|---|---|---|---|---|---|")
    for label, family, over in (
        ("tiny kimi_k3 grouped", "kimi_k3", {"grouped": True}),
        ("tiny deepseek_v3", "deepseek_v3", {}),
    ):
        model, info = build_tiny(family, seed=3, **over)
        arch = find_moe_architecture(model)
        io = capture(model, arch, sample_input_ids(info.vocab_size, batch=8, seq=64, seed=1))
        E = arch.num_experts
        per = E // (arch.n_group if arch.group_limited else 1)
        for layer in arch.layers:
            norms = layer.router.weight.detach().norm(dim=1)
            kept = []
            for g in range(E // per):
                order = norms[g * per : (g + 1) * per].argsort(descending=True)
                kept += (order[: per // 2] + g * per).tolist()
            prune_layer(layer, sorted(kept), E)
        compare(label, arch, io, args)
    if args.bundled:
        bundled(args, compare)


def bundled(args, compare) -> None:
    """The bundled model cut by REAP on en + zh + code (as ``bias_fit_quality.py``)."""
    import tempfile

    from bias_fit_quality import capture_block_io, cut
    from llmcompressor import oneshot
    from transformers import AutoTokenizer

    from reap_modifier import REAPPruningModifier
    from reap_modifier.demo import data as D
    from reap_modifier.demo.config import DEFAULT_MODEL, LANGS
    from reap_modifier.demo.workspace import load_model
    from reap_modifier.models import find_moe_architecture

    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL))
    calib = {lang: D.load_split(None, lang, "calib") for lang in LANGS}
    dataset = D.calibration_dataset(calib, tokenizer, 2048, 256)

    def fresh():
        return load_model(str(DEFAULT_MODEL), packed=False, dtype="float32")

    scores = Path(tempfile.mkdtemp(prefix="bias-fit-methods-")) / "scores.safetensors"
    oneshot(
        model=fresh(),
        recipe=[REAPPruningModifier(sparsity=0.5, scores_path=str(scores))],
        processor=tokenizer,
        dataset=dataset,
        num_calibration_samples=len(dataset),
    )
    io = capture_block_io(fresh(), dataset)
    model = cut(fresh, args.sparsity, scores, tokenizer)
    compare(f"bundled {int(args.sparsity * 100)}%", find_moe_architecture(model), io, args)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
