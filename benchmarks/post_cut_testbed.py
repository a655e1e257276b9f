"""The post-cut step on test-bed models whose shared expert carries a realistic share of
the block's output, and with tiny calibration: cut alone vs router fit vs compensation.

The bundled model's shared expert is nearly idle (removing every routed expert leaves
99.8% of the block's output error), so a refit there may overstate what Kimi K3 sees.
Here a tiny random Kimi K3 (sigmoid router, score-correction bias, latent MoE,
one shared expert; tests/helpers/tiny_models.py) has its shared expert's output projection
scaled so that the shared expert carries ``--shared-share`` of the block output's energy
(measured, printed). REAP calibrates through ``oneshot`` on random token windows, the
model is cut at each sparsity with the post-cut components on (each validated on
held-out calibration batches, the product's default), and every model is judged on
other random windows: ``KL(unpruned || pruned)`` per token, with the paired standard
error over windows. ``--tokens`` sets the calibration size (1,024: the tiny case where
an unvalidated router fit was measured 3% worse than the cut alone).

    PYTHONPATH=src python benchmarks/post_cut_testbed.py --tokens 8192 1024
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
import paths  # noqa: E402,F401  (tests/helpers and tests/oracles by name)
from conftest import make_dataset, make_tokenizer, save_and_reload  # noqa: E402
from tiny_models import build_tiny, sample_input_ids  # noqa: E402

VARIANTS = {
    "cut alone": {},
    "router fit (unvalidated)": {"calibrate_router": True, "validate_fit": False},
    "router fit": {"calibrate_router": True},
    "router fit + compensation": {"calibrate_router": True, "compensate": True},
}


def shared_share(model, ids) -> float:
    """Energy of the shared expert's output over the block output's, mean over layers."""
    from reap_modifier.models import find_moe_architecture

    shares, hooks, seen = [], [], {}
    for layer in find_moe_architecture(model).layers:
        block = layer.block
        hooks.append(
            block.shared_experts.register_forward_hook(
                lambda m, a, o, n=layer.name: seen.__setitem__((n, "s"), o.pow(2).sum().item())
            )
        )
        hooks.append(
            block.register_forward_hook(
                lambda m, a, o, n=layer.name: seen.__setitem__((n, "b"), o.pow(2).sum().item())
            )
        )
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    for (name, kind), value in seen.items():
        if kind == "s":
            shares.append(value / seen[(name, "b")])
    return sum(shares) / len(shares)


def build(seed: int, share: float | None, tokens_probe):
    from reap_modifier.models import find_moe_architecture

    model, info = build_tiny("kimi_k3", seed=seed)
    if share is not None:
        # scale the shared expert's output until it carries ~share of the block's energy
        for _ in range(20):
            now = shared_share(model, tokens_probe)
            if abs(now - share) < 0.02:
                break
            factor = (share / (1 - share) * (1 - now) / max(now, 1e-6)) ** 0.5
            for layer in find_moe_architecture(model).layers:
                layer.block.shared_experts.down_proj.weight.data *= factor
    return model, info


def kl_per_window(reference, model, windows) -> list[float]:
    out = []
    with torch.no_grad():
        for ids in windows:
            ref = reference(input_ids=ids, use_cache=False).logits.float().log_softmax(-1)
            now = model(input_ids=ids, use_cache=False).logits.float().log_softmax(-1)
            out.append((ref.exp() * (ref - now)).sum(-1).mean().item())
    return out


def main() -> None:
    from llmcompressor import oneshot

    from reap_modifier import REAPPruningModifier

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 1024])
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.5, 0.75])
    ap.add_argument("--shared-share", type=float, nargs="+", default=[0.5])
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--seed", type=int, default=21)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tokenizer = make_tokenizer()
    print("| shared share | calibration tokens | sparsity | method | KL | vs cut alone |")
    print("|---|---:|---:|---|---:|---:|")
    for share in args.shared_share:
        probe = sample_input_ids(128, batch=4, seq=args.seq, seed=99)
        base, info = build(args.seed, share, probe)
        base = save_and_reload(base, "kimi_k3", Path(tempfile.mkdtemp()) / "base")
        measured = shared_share(base, probe)
        windows = [
            sample_input_ids(info.vocab_size, batch=1, seq=args.seq, seed=1000 + i)
            for i in range(args.eval_windows)
        ]
        for tokens in args.tokens:
            n = max(2, tokens // args.seq)
            samples = [
                sample_input_ids(info.vocab_size, batch=1, seq=args.seq, seed=i)[0]
                for i in range(n)
            ]
            for sparsity in args.sparsity:
                kls = {}
                for label, extra in VARIANTS.items():
                    model = copy.deepcopy(base)
                    modifier = REAPPruningModifier(
                        sparsity=sparsity,
                        **({"router_fit_tokens": n * args.seq} if extra else {}),
                        **extra,
                    )
                    oneshot(
                        model=model,
                        recipe=[modifier],
                        processor=tokenizer,
                        dataset=make_dataset(samples),
                        num_calibration_samples=n,
                        shuffle_calibration_samples=False,
                    )
                    kls[label] = kl_per_window(base, model, windows)
                    fit = modifier.router_fit
                    note = ""
                    if fit:
                        note = (
                            " ("
                            + ", ".join(
                                f"{c['name']} {'kept' if c['kept'] else 'dropped'}"
                                for c in fit["components"]
                            )
                            + ")"
                        )
                    alone = kls["cut alone"]
                    mean = sum(kls[label]) / len(kls[label])
                    diff = [b - a for a, b in zip(alone, kls[label], strict=True)]
                    d = sum(diff) / len(diff)
                    se = (sum((x - d) ** 2 for x in diff) / (len(diff) - 1) / len(diff)) ** 0.5
                    print(
                        f"| {measured:.2f} | {n * args.seq:,} | {int(sparsity * 100)}% | "
                        f"{label}{note} | {mean:.4f} | "
                        + (
                            ""
                            if label == "cut alone"
                            else f"{100 * d / (sum(alone) / len(alone)):+.1f}% (±{100 * 2 * se / (sum(alone) / len(alone)):.1f})"
                        )
                        + " |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
