"""Cost of one optimizer step of the post-cut fits at Kimi K3's routing counts, beside the
calibration forward of the same tokens through the same block, measured in one run.

Builds one Kimi-K3-shaped MoE block with K3's counts (896 routed experts, top-16, one shared
expert, a latent MoE) and tiny widths (hidden 32, latent 16, expert width 16; ``--hidden`` etc.
change them), then times on the same ``--tokens`` calibration rows:

- ``forward``: the block's own forward (``moe_infer``: every expert that received tokens, in
  turn), what calibration runs per batch;
- ``router step`` and ``dense step``: one Adam step of the router fit and of compensation's
  gradient fit (``post_cut.block_fit.fit_block``), from the difference of runs with
  ``--steps`` + 1 and 1 steps, so set-up and the final evaluations are not counted.

Prints each and its ratio to the forward (the target: a step costs at most 3x the forward).

    PYTHONPATH=src python benchmarks/fit_step_cost.py [--tokens 2048] [--steps 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
import paths  # noqa: E402,F401  (tests/helpers and tests/oracles by name)
from tiny_models import build_tiny  # noqa: E402

from reap_modifier.models import find_moe_architecture  # noqa: E402
from reap_modifier.post_cut.block_fit import block_output, fit_block  # noqa: E402
from reap_modifier.post_cut.compensation import dense_params  # noqa: E402
from reap_modifier.post_cut.router_fit import router_params  # noqa: E402


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=896)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--latent", type=int, default=16)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = build_tiny(
        "kimi_k3",
        seed=0,
        num_hidden_layers=2,
        num_experts=args.experts,
        num_experts_per_token=args.top_k,
        hidden_size=args.hidden,
        routed_expert_hidden_size=args.latent,
        moe_intermediate_size=args.width,
    )
    layer = find_moe_architecture(model).layers[0]
    x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(1))
    y = block_output(layer, x) * 1.01  # a target the fit can move towards
    forward = _best(lambda: block_output(layer, x), args.repeat)
    rows = [("forward (moe_infer)", forward)]
    for name, params in (
        ("router step", router_params(layer)),
        ("dense step", dense_params(layer)),
    ):
        one = _best(lambda p=params: fit_block(layer, x, y, p, steps=1), args.repeat)
        more = _best(lambda p=params: fit_block(layer, x, y, p, steps=1 + args.steps), args.repeat)
        rows.append((name, max(more - one, 0.0) / args.steps))
    print(
        f"one Kimi-K3-shaped block: {args.experts} experts, top-{args.top_k}, hidden "
        f"{args.hidden}, latent {args.latent}, width {args.width}, {args.tokens} tokens, "
        f"{args.threads} thread(s)"
    )
    print("| what | seconds | x forward |\n|---|---:|---:|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.3f} | {seconds / forward:.2f} |")


if __name__ == "__main__":
    main()
