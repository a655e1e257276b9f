"""Cost of the post-cut compensation (:mod:`reap_modifier.post_cut.compensation`) on one Kimi-K3-shaped
MoE layer: capture memory, the closed form, one gradient step, and ``compensate``.

One ``KimiSparseMoeBlock`` (llm-compressor's Kimi K3 modeling, random weights): hidden
7168, latent (``routed_expert_hidden_size``) 3584, 896 routed experts cut to 448 by
``surgery.prune_layer``, top-16, one shared expert of intermediate 2048 (K3's
``moe_intermediate_size`` x ``num_shared_experts`` as ``benchmarks/k3_scale.py`` assumes;
the model cards do not state it). The routed experts' intermediate is reduced (default
64, not K3's): 896 experts at 2048 would take 79 GB in float32. They are frozen and only
their outputs enter the fits (the closed form's features are the shared expert's and the
up-projection's inputs; the gradient fit caches the selected experts' outputs), so their
size enters the cost only through expert forwards, which are counted separately.

Float32 on CPU, ``--tokens`` tokens of random block inputs (targets: the unpruned block's
outputs). Per token count: the closed form (wall time, its eigendecomposition, peak RSS
above the start), ``fit_block`` over ``compensation.dense_params`` (time per steady step:
``(t(1 + s) - t(1)) / s``, expert cache hits counted) and optionally ``compensate`` with a
few steps. Prints a markdown table and the extrapolation to ``--target-tokens`` (from the
largest token count: the fit step in proportion to N, the closed form as a fixed part plus
its probe in proportion; peak memory linear through the first and last token counts), to
200 steps, and to a GPU by FLOP count (``--gpu-tflops``) and by kernel launches of the
experts' dispatch loop (``--launch-us``), both ASSUMPTIONS: no GPU here. Results:
``docs/router-calibration.md``.

    OMP_NUM_THREADS=1 python benchmarks/compensation_cost.py --tokens 256 512
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))  # tiny_models: how a K3 config is made
import paths  # noqa: E402,F401  (tests/helpers and tests/oracles by name)

H, LATENT, EXPERTS, KEPT, TOP_K = 7168, 3584, 896, 448, 16
HOLDOUT_EVERY = 8  # router_fit.HOLDOUT_EVERY: every 8th fitting token is held out


def rss() -> tuple[int, int]:
    """(current, peak) resident set size of this process, bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    kib = {k: int(v.split()[0]) * 1024 for k, v in fields.items() if k in ("VmRSS", "VmHWM")}
    return kib["VmRSS"], kib["VmHWM"]


@contextmanager
def peak_above_start(record: dict, key: str):
    """Peak RSS above the RSS at entry, for the context (resets the kernel's high-water mark)."""
    Path("/proc/self/clear_refs").write_text("5")
    start, _ = rss()
    t0 = time.perf_counter()
    yield
    record[key + "_s"] = time.perf_counter() - t0
    record[key + "_peak"] = rss()[1] - start


def build_layer(shared_intermediate: int, routed_intermediate: int):
    from llmcompressor.modeling.kimi_k3.modeling_kimi_linear import KimiSparseMoeBlock
    from tiny_models import tiny_config

    from reap_modifier.models import MoELayer

    cfg = tiny_config(
        "kimi_k3",
        hidden_size=H,
        routed_expert_hidden_size=LATENT,
        num_experts=EXPERTS,
        num_experts_per_token=TOP_K,
        moe_intermediate_size=routed_intermediate,
        num_shared_experts=1,
        num_hidden_layers=1,
    ).text_config
    torch.manual_seed(0)
    block = KimiSparseMoeBlock(cfg).eval()
    block.requires_grad_(False)
    with torch.no_grad():
        block.gate.e_score_correction_bias.normal_(0, 0.01)
        # the shared expert at its own width (the config ties it to the routed experts')
        from llmcompressor.modeling.kimi_k3.modeling_kimi_linear import KimiMLP

        block.shared_experts = KimiMLP(cfg, intermediate_size=shared_intermediate).requires_grad_(
            False
        )
    return MoELayer(name="model.layers.1.mlp", block=block, router_attr="gate", kind="kimi")


def dense_state(layer) -> dict[str, torch.Tensor]:
    from reap_modifier.post_cut.compensation import dense_params

    return {
        f"{p}.{n}": getattr(layer.block.get_submodule(p), n).detach().clone()
        for p, names in dense_params(layer).items()
        for n in names
    }


def restore(layer, state: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, t in state.items():
            path, _, attr = name.rpartition(".")
            getattr(layer.block.get_submodule(path), attr).copy_(t)


@contextmanager
def timed_eigh(record: dict):
    original = torch.linalg.eigh

    def eigh(a, *args, **kwargs):
        t0 = time.perf_counter()
        out = original(a, *args, **kwargs)
        record["eigh_s"] = record.get("eigh_s", 0.0) + time.perf_counter() - t0
        record["gram_n"] = a.shape[0]
        return out

    torch.linalg.eigh = eigh
    try:
        yield
    finally:
        torch.linalg.eigh = original


@contextmanager
def timed_probe(record: dict):
    """Time the closed form's probe (the block's forwards that read off its features)."""
    from reap_modifier import compensation

    original = compensation._probe

    def probe(*args, **kwargs):
        t0 = time.perf_counter()
        out = original(*args, **kwargs)
        record["probe_s"] = time.perf_counter() - t0
        return out

    compensation._probe = probe
    try:
        yield
    finally:
        compensation._probe = original


@contextmanager
def counted_expert_rows(record: dict):
    """Count the (token) rows whose experts the gradient fit's cache recomputes."""
    from reap_modifier import router_fit

    original = router_fit._ExpertCache.get

    def get(self, x, ids, one_slot):
        if self.ids is None or self.ids.shape != ids.shape:
            moved = ids.shape[0]
        else:
            moved = int((self.ids != ids).any(dim=1).sum())
        record["expert_rows"] = record.get("expert_rows", 0) + moved
        record["rows_seen"] = record.get("rows_seen", 0) + ids.shape[0]
        return original(self, x, ids, one_slot)

    router_fit._ExpertCache.get = get
    try:
        yield
    finally:
        router_fit._ExpertCache.get = original


def trained_params(layer) -> int:
    from reap_modifier.post_cut.compensation import dense_params

    return sum(
        getattr(layer.block.get_submodule(p), n).numel()
        for p, names in dense_params(layer).items()
        for n in names
    )


def step_flops(tokens: int, params: int, shared_i: int) -> float:
    """Dense FLOPs of one gradient step of ``fit_block`` on ``tokens`` fitting rows
    (experts excluded): on the 7/8 fitting rows forward ``2 (P + H L)`` (the trained
    tensors and the frozen down-projection), backward ``2 P`` (weight gradients) ``+ 2 (H
    I_s + L H)`` (input gradients of the shared down-projection and the up-projection);
    on the 1/8 held-out rows a forward."""
    fit = tokens - tokens // HOLDOUT_EVERY
    held = tokens // HOLDOUT_EVERY
    return 2 * fit * (2 * params + 2 * H * LATENT + H * shared_i) + 2 * held * (params + H * LATENT)


def expert_flops_per_row(routed_i: int) -> float:
    """One token's top-16 expert forwards (three projections each, latent space)."""
    return 2 * TOP_K * 3 * LATENT * routed_i


def measure(layer, x, y, args) -> dict:
    from reap_modifier.post_cut.block_fit import fit_block
    from reap_modifier.post_cut.compensation import closed_form, compensate, dense_params

    n = x.shape[0]
    rec: dict = {"tokens": n}
    log = lambda what: print(f"  [{n} tokens] {what}", file=sys.stderr, flush=True)  # noqa: E731
    log("closed form")
    start = dense_state(layer)
    with timed_eigh(rec), timed_probe(rec), peak_above_start(rec, "closed"), torch.no_grad():
        closed_form(layer, x, y)
    params = dense_params(layer)
    times = {}
    for steps in (1, 1 + args.grad_steps):
        log(f"fit_block, {steps} step(s)")
        count: dict = {}
        with counted_expert_rows(count), peak_above_start(times, f"fit{steps}"):
            fit_block(layer, x, y, params, steps=steps, lr=0.003)
        times[f"rows{steps}"] = count["expert_rows"]
    rec["step_s"] = (times[f"fit{1 + args.grad_steps}_s"] - times["fit1_s"]) / args.grad_steps
    rec["fit1_s"] = times["fit1_s"]
    rec["fit_peak"] = max(times["fit1_peak"], times[f"fit{1 + args.grad_steps}_peak"])
    # rows recomputed per steady step (fit + held-out caches)
    rec["moved_rows"] = (times[f"rows{1 + args.grad_steps}"] - times["rows1"]) / args.grad_steps
    if args.compensate_steps:
        log(f"compensate, {args.compensate_steps} step(s)")
        eigh_before = rec["eigh_s"]
        with timed_eigh(rec), peak_above_start(rec, "comp"):
            compensate(layer, x, y, steps=args.compensate_steps)
        rec["comp_eigh_s"] = rec["eigh_s"] - eigh_before
        rec["eigh_s"] = eigh_before
        restore(layer, start)
    return rec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--grad-steps", type=int, default=2, help="steady steps timed")
    parser.add_argument(
        "--compensate-steps", type=int, default=2, help="compensate(steps=S); 0 skips it"
    )
    parser.add_argument("--shared-intermediate", type=int, default=2048)
    parser.add_argument(
        "--routed-intermediate", type=int, default=64, help="reduced (K3's is not stated)"
    )
    parser.add_argument(
        "--k3-routed-intermediate",
        type=int,
        default=2048,
        help="routed intermediate assumed for K3 in the expert FLOPs",
    )
    parser.add_argument("--target-tokens", type=int, default=4096)
    parser.add_argument("--target-steps", type=int, default=200)
    parser.add_argument(
        "--launch-us",
        type=float,
        default=8.0,
        help="ASSUMED GPU time per kernel of the per-expert dispatch loop",
    )
    parser.add_argument(
        "--gpu-tflops",
        type=float,
        default=300.0,
        help="ASSUMED achieved bf16 TFLOP/s of an H100/H200 (dense peak 989)",
    )
    args = parser.parse_args()
    from reap_modifier.post_cut.compensation import RIDGE_GRID
    from reap_modifier.surgery import prune_layer

    threads = torch.get_num_threads()
    t0 = time.perf_counter()
    layer = build_layer(args.shared_intermediate, args.routed_intermediate)
    gen = torch.Generator().manual_seed(1)
    n_max = max(args.tokens)
    x_all = torch.randn(n_max, H, generator=gen)
    with torch.no_grad():
        y_all = layer.block(x_all.unsqueeze(0)).reshape(n_max, H)
    kept = sorted(torch.randperm(EXPERTS, generator=gen)[:KEPT].tolist())
    prune_layer(layer, kept, EXPERTS)
    setup_s = time.perf_counter() - t0
    params = trained_params(layer)
    print(
        f"one K3-shaped layer: hidden {H}, latent {LATENT}, {EXPERTS} -> {KEPT} experts, "
        f"top-{TOP_K}, shared intermediate {args.shared_intermediate}, routed intermediate "
        f"{args.routed_intermediate} (reduced); float32, {threads} thread(s); setup "
        f"{setup_s:.0f} s; dense parameters fitted: {params / 1e6:.2f} M"
    )
    records = [measure(layer, x_all[:n], y_all[:n], args) for n in args.tokens]

    mib = 2**20
    gram = records[0]["gram_n"]
    print()
    print(
        "| tokens N | capture bf16 (2 N H 2 B) | closed form s | eigh s (n) | closed-form peak MiB"
        " | fit step s | GFLOP/step (dense) | GFLOP/s | expert rows/step | fit peak MiB"
        " | compensate s (S) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in records:
        n = r["tokens"]
        flops = step_flops(n, params, args.shared_intermediate)
        comp = (
            f"{r['comp_s']:.1f} ({args.compensate_steps}; eigh {r['comp_eigh_s']:.1f})"
            if "comp_s" in r
            else "-"
        )
        print(
            f"| {n} | {2 * n * H * 2 / mib:.1f} MiB | {r['closed_s']:.1f} | {r['eigh_s']:.1f}"
            f" ({gram}) | {r['closed_peak'] / mib:.0f} | {r['step_s']:.2f} | {flops / 1e9:.0f}"
            f" | {flops / r['step_s'] / 1e9:.1f} | {r['moved_rows']:.0f} of {n}"
            f" | {r['fit_peak'] / mib:.0f} | {comp} |"
        )

    # Extrapolation to --target-tokens. On a shared machine two token counts' timings
    # differ by contention more than by N, so times are scaled from the largest N: the
    # fit step in proportion to N (its dense FLOPs are), the closed form as a part that
    # does not grow with N (eigh, the per-regulariser solves: measured as the closed form
    # less its probe) plus the probe's block forwards in proportion to N. Peak memory is
    # linear through the two token counts.
    lo, hi = records[0], records[-1]
    n_t = args.target_tokens
    ratio = n_t / hi["tokens"]

    def linear(key: str) -> float:
        if hi["tokens"] == lo["tokens"]:  # needs two token counts
            return float("nan")
        slope = (hi[key] - lo[key]) / (hi["tokens"] - lo["tokens"])
        return lo[key] + slope * (n_t - lo["tokens"])

    step_t = hi["step_s"] * ratio
    fixed = hi["closed_s"] - hi["probe_s"]
    closed_t = fixed + hi["probe_s"] * ratio
    gram_flops = 2 * (n_t - n_t // HOLDOUT_EVERY) * gram * (gram + H)
    adam = 4 * 4 * params
    flops_t = step_flops(n_t, params, args.shared_intermediate)
    expert_row = expert_flops_per_row(args.k3_routed_intermediate)
    moved_frac = hi["moved_rows"] / hi["tokens"]
    print()
    print(
        f"EXTRAPOLATED from {hi['tokens']} tokens to N = {n_t} (x{ratio:.0f}), this CPU, "
        f"{threads} thread(s):"
    )
    print(f"- capture per layer: {2 * n_t * H * 2 / mib:.0f} MiB bf16 (spill_dir writes the same)")
    print(
        f"- closed form: {closed_t:.0f} s = {fixed:.0f} s not growing with N (eigh of the "
        f"{gram} x {gram} float64 Gram, {gram * gram * 8 / mib:.0f} MiB: {hi['eigh_s']:.0f} s; "
        f"the rest: the solves for {len(RIDGE_GRID)} regularisers) + the probe's block "
        f"forwards {hi['probe_s']:.0f} s x {ratio:.0f}; the Gram and cross products add "
        f"{gram_flops / 1e12:.2f} TFLOP float64; peak {linear('closed_peak') / mib:.0f} MiB "
        "(linear through the two token counts)"
    )
    print(
        f"- fit step: {step_t:.0f} s ({flops_t / 1e12:.2f} TFLOP dense at the "
        f"{step_flops(hi['tokens'], params, args.shared_intermediate) / hi['step_s'] / 1e9:.0f}"
        f" GFLOP/s measured); {args.target_steps} steps: {step_t * args.target_steps / 3600:.1f} h;"
        f" masters + grads + Adam moments {adam / mib:.0f} MiB (+ {params * 4 / mib:.0f} MiB "
        f"best copy); fit peak {linear('fit_peak') / mib:.0f} MiB (linear)"
    )
    gpu = args.gpu_tflops * 1e12
    steps_flops = flops_t + moved_frac * n_t * expert_row
    print(
        f"- GPU at an ASSUMED {args.gpu_tflops:.0f} TFLOP/s: {flops_t / 1e12:.2f} TFLOP/step "
        f"dense + experts {expert_row / 1e9:.2f} GFLOP per recomputed row (routed "
        f"intermediate {args.k3_routed_intermediate}; {moved_frac:.0%} of rows recomputed per "
        f"step here) -> {steps_flops / gpu * 1e3:.1f} ms/step, "
        f"{steps_flops * args.target_steps / gpu:.1f} s for {args.target_steps} steps per layer"
    )
    # the fit's expert cache calls moe_infer once per top-k slot: a Python loop over the
    # kept experts, ~5 kernels each (gate, up, activation, product, down), for the fitting
    # and the held-out cache in every step
    kernels = 2 * TOP_K * KEPT * 5
    print(
        f"- GPU dispatch bound: ~{kernels:,} expert kernels per step (2 caches x {TOP_K} slots x "
        f"{KEPT} experts x 5) at an ASSUMED {args.launch_us:.0f} us -> "
        f"{kernels * args.launch_us / 1e3:.0f} ms/step, "
        f"{kernels * args.launch_us * args.target_steps / 1e6:.0f} s for {args.target_steps} "
        "steps per layer while most rows change their selection every step"
    )


if __name__ == "__main__":
    main()
