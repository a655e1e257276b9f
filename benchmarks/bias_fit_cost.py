"""Cost of the score-correction bias fit at Kimi K3's routing shape, on a reduced layer.

A Kimi-K3-shaped MoE layer with K3's routing (896 routed experts, top-16, sigmoid +
score-correction bias, routed scaling 2.5, one shared expert, latent MoE) but small
widths (``--hidden``, latent half of it, expert width 64) is cut to the 448 experts with
the largest router rows; its unpruned block outputs on ``--tokens`` random hidden states
are the targets; :func:`reap_modifier.post_cut.bias_fit.fit_bias` fits the kept bias. Reported:
the held-out loss before / after, the work in block evaluations (token rows run through
the block / N; newly computed expert outputs / (N x top-k)) and the wall-clock time
relative to one forward of the pruned block over the N tokens. The routing shape (E, k,
N), not the widths, sets the number of rows and expert outputs; at K3's widths a changed
row costs about a quarter of a full token's block compute (router, latent projections
and shared expert on the row, one new expert output; the other 15 slots are reused).

    PYTHONPATH=src python benchmarks/bias_fit_cost.py [--tokens 2048] [--hidden 256]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
import paths  # noqa: E402,F401  (tests/helpers and tests/oracles by name)


def main() -> None:
    from tiny_models import build_tiny

    from reap_modifier.models import find_moe_architecture
    from reap_modifier.post_cut.bias_fit import fit_bias
    from reap_modifier.post_cut.block_fit import block_output
    from reap_modifier.surgery import prune_layer

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=896)
    ap.add_argument("--keep", type=int, default=448)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--sweeps", type=int, default=4)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, info = build_tiny(
        "kimi_linear",
        seed=0,
        hidden_size=args.hidden,
        routed_expert_hidden_size=args.hidden // 2,
        moe_intermediate_size=64,
        num_experts=args.experts,
        num_experts_per_token=args.top_k,
        num_hidden_layers=2,
    )
    layer = find_moe_architecture(model).layers[0]
    layer.block.to(args.device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(args.device)
    y = block_output(layer, x)
    norms = layer.router.weight.detach().norm(dim=1)
    prune_layer(layer, sorted(norms.argsort(descending=True)[: args.keep].tolist()), args.experts)

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    block_output(layer, x)  # warm-up
    sync()
    t0 = time.perf_counter()
    for _ in range(3):
        block_output(layer, x)
    sync()
    block_s = (time.perf_counter() - t0) / 3
    t0 = time.perf_counter()
    _, r = fit_bias(layer, x, y, sweeps=args.sweeps)
    sync()
    fit_s = time.perf_counter() - t0
    n_fit = r.tokens
    print(
        f"E={args.keep} kept of {args.experts}, top-{args.top_k}, N={args.tokens}, "
        f"hidden {args.hidden}, {args.device}"
    )
    print(
        f"held-out {r.holdout_before:.4f} -> {r.holdout_after:.4f}; fit "
        f"{r.loss_before:.4f} -> {r.loss_after:.4f}; sweeps {r.sweeps}, candidates "
        f"{r.candidates}, moves {r.moves} (best at {r.best_move})"
    )
    print(
        f"block rows / N = {r.block_rows / n_fit:.1f}; new expert outputs / (N k) = "
        f"{r.expert_rows / (n_fit * args.top_k):.2f}; "
        f"time {fit_s:.1f} s = {fit_s / block_s:.0f} x one block forward ({block_s * 1e3:.1f} ms)"
    )


if __name__ == "__main__":
    main()
