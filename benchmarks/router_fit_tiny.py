"""Router fit on tiny models: layer-local relative error before/after, per router kind.

Runs the tiny test models (tests/helpers/tiny_models.py) through a forward pass, captures every
MoE block's input and output, cuts each layer to half its experts (lowest router-row
norm dropped), fits the router with :func:`reap_modifier.post_cut.router_fit.fit_router` and
prints the losses; ``--lr`` / ``--steps`` compare settings side by side, and
``--lbfgs`` adds a quasi-Newton alternative (torch's L-BFGS with strong-Wolfe line
search on the same loss and parametrisation, ``steps`` iterations, selection
recomputed at each evaluation), the second-order candidate the fit was compared with.

    PYTHONPATH=src python benchmarks/router_fit_tiny.py --steps 50 100 --lr 0.003 0.01 0.03
    PYTHONPATH=src python benchmarks/router_fit_tiny.py --steps 20 100 --lbfgs
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
import paths  # noqa: E402,F401  (tests/helpers and tests/oracles by name)

from reap_modifier.models import find_moe_architecture  # noqa: E402
from reap_modifier.post_cut.block_fit import (  # noqa: E402
    HOLDOUT_EVERY,
    differentiable_dispatch,
    relative_error,
)
from reap_modifier.post_cut.router_fit import fit_router  # noqa: E402
from reap_modifier.surgery import prune_layer  # noqa: E402

CASES = {
    "qwen3_moe (softmax top-k, renormalised)": ("qwen3_moe", {}),
    "kimi_k3 (sigmoid + bias, groups, scaling)": ("kimi_k3", {"grouped": True}),
    "deepseek_v3 (sigmoid + bias, groups)": ("deepseek_v3", {}),
}


def capture(model, arch, ids):
    io = {}
    hooks = [
        layer.block.register_forward_hook(
            lambda m, a, o, n=layer.name: io.__setitem__(
                n,
                (
                    a[0].detach().reshape(-1, a[0].shape[-1]),
                    (o[0] if isinstance(o, tuple) else o).detach().reshape(-1, a[0].shape[-1]),
                ),
            )
        )
        for layer in arch.layers
    ]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    return io


def lbfgs(layer, x, y, steps):
    """L-BFGS on the same layer-local loss; returns (fit loss, held-out loss) after
    ``steps`` iterations (no early stopping: its final rows)."""
    held = torch.zeros(x.shape[0], dtype=torch.bool)
    held[HOLDOUT_EVERY - 1 :: HOLDOUT_EVERY] = True
    router = layer.router
    original = router.weight
    master = torch.nn.Parameter(original.detach().float().clone())
    del router.weight
    router.weight = master

    def loss_on(rows):
        with differentiable_dispatch(layer):
            out = layer.block(x[rows].unsqueeze(0))
            out = out[0] if isinstance(out, tuple) else out
            return relative_error(out.reshape(y[rows].shape), y[rows])

    opt = torch.optim.LBFGS([master], max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = loss_on(~held)
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    with torch.no_grad():
        result = loss_on(~held).item(), loss_on(held).item()
    del router.weight
    router.weight = original
    return result


def main() -> None:
    from tiny_models import build_tiny, sample_input_ids

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, nargs="+", default=[100])
    ap.add_argument("--lr", type=float, nargs="+", default=[0.01])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--keep", type=float, default=0.5)
    ap.add_argument("--lbfgs", action="store_true")
    args = ap.parse_args()
    print(
        "| router kind | layer | steps | lr | fit before | fit after | held-out before | held-out after | s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for label, (family, over) in CASES.items():
        for steps in args.steps:
            for lr in args.lr:
                model, info = build_tiny(family, seed=3, **over)
                arch = find_moe_architecture(model)
                ids = sample_input_ids(info.vocab_size, batch=args.tokens // 64, seq=64, seed=1)
                io = capture(model, arch, ids)
                E = arch.num_experts
                for layer in arch.layers:
                    norms = layer.router.weight.detach().norm(dim=1)
                    groups = arch.n_group if arch.group_limited else 1
                    per = E // groups
                    kept = []
                    for g in range(groups):
                        order = norms[g * per : (g + 1) * per].argsort(descending=True)
                        kept += sorted((order[: int(per * args.keep)] + g * per).tolist())
                    prune_layer(layer, sorted(kept), E)
                for layer in arch.layers:
                    x, y = io[layer.name]
                    t0 = time.perf_counter()
                    _, r = fit_router(layer, x, y, steps=steps, lr=lr)
                    dt = time.perf_counter() - t0
                    print(
                        f"| {label} | {layer.name} | {steps} | {lr} | {r.loss_before:.4f} | "
                        f"{r.loss_after:.4f} | {r.holdout_before:.4f} | {r.holdout_after:.4f} | {dt:.1f} |"
                    )
                    if args.lbfgs and lr == args.lr[0]:
                        t0 = time.perf_counter()
                        fit, held = lbfgs(layer, x, y, steps)
                        dt = time.perf_counter() - t0
                        print(
                            f"| {label} | {layer.name} | {steps} | L-BFGS | {r.loss_before:.4f} | "
                            f"{fit:.4f} | {r.holdout_before:.4f} | {held:.4f} | {dt:.1f} |"
                        )


if __name__ == "__main__":
    main()
