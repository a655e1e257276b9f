"""Sizing a Kimi-K3-class REAP run: memory per rank and time per million tokens.

1. Measures calibration throughput (forward passes with this package's observer,
   and without) on the largest Kimi-K3-shaped model that runs comfortably here.
2. Extrapolates seconds per million calibration tokens to a K3-class model by the
   ratio of active (per-token) parameters — an *extrapolation*, labelled as such.
3. Estimates per-rank memory of a sequential-onloading run from a config's shape.

The K3-class shape below is an assumption (896 experts, top-16, 92 MoE layers,
latent 3584 from the model card; other sizes are typical of the class); pass
``--config path/to/config.json`` to size a real checkpoint.

    python benchmarks/k3_scale.py [--config CONFIG] [--tokens 4096] [--seq 512]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from bench_calibration_overhead import attach_ours, k3_shaped, measure

from reap_modifier.models.moe_fields import text_section

torch.set_num_threads(1)

ASSUMED_K3 = {
    "hidden_size": 7168,
    "routed_expert_hidden_size": 3584,
    "moe_intermediate_size": 2048,
    "num_experts": 896,
    "num_experts_per_token": 16,
    "num_hidden_layers": 93,
    "first_k_dense_replace": 1,
    "num_shared_experts": 1,
    "intermediate_size": 18432,
    "vocab_size": 163840,
    "attention_params_per_layer": 200_000_000,
}


def active_params(c: dict) -> float:
    """Parameters touched per token (router + top-k experts + shared + latent + attention)."""
    latent = c.get("routed_expert_hidden_size") or c["hidden_size"]
    expert = 3 * latent * c["moe_intermediate_size"]
    moe_layers = c["num_hidden_layers"] - c.get("first_k_dense_replace", 0)
    per_moe = (
        c["num_experts"] * c["hidden_size"]  # router
        + c["num_experts_per_token"] * expert
        + c.get("num_shared_experts", 0) * 3 * c["hidden_size"] * c["moe_intermediate_size"]
        + (2 * c["hidden_size"] * latent if latent != c["hidden_size"] else 0)
    )
    dense = c.get("first_k_dense_replace", 0) * 3 * c["hidden_size"] * c["intermediate_size"]
    attention = (
        c.get("attention_params_per_layer", 4 * c["hidden_size"] ** 2) * c["num_hidden_layers"]
    )
    return moe_layers * per_moe + dense + attention + c["vocab_size"] * c["hidden_size"]


def memory_per_rank(c: dict, seq: int, bytes_per_param: int = 2) -> dict[str, float]:
    """GiB held on one rank's accelerator in a sequential-onloading run (one layer onloaded)."""
    gib = 1024**3
    latent = c.get("routed_expert_hidden_size") or c["hidden_size"]
    experts = c["num_experts"] * 3 * latent * c["moe_intermediate_size"] * bytes_per_param
    attention = c.get("attention_params_per_layer", 4 * c["hidden_size"] ** 2) * bytes_per_param
    router = c["num_experts"] * c["hidden_size"] * 4
    slots = seq * c["num_experts_per_token"]
    # observer: the layer's routed expert outputs (latent) held until one norm kernel,
    # as large again as moe_infer's own buffer of them, plus float64 norms
    observer = slots * latent * bytes_per_param + slots * 8
    activations = 4 * seq * c["hidden_size"] * bytes_per_param
    stats = (c["num_hidden_layers"]) * (c["num_experts"] + 1) * 5 * 8
    return {
        "layer weights (bf16, dequantized)": (experts + attention + router) / gib,
        "activations (one sample)": activations / gib,
        "observer expert-output buffer": observer / gib,
        "statistics (all layers, float64)": stats / gib,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--config",
        help="config.json of the target checkpoint (its text section is used: the nested "
        "text config of a multimodal wrapper, else the top level)",
    )
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--target-seq", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    target = dict(ASSUMED_K3)
    label = "assumed K3-class shape"
    if args.config:
        cfg = json.loads(Path(args.config).read_text())
        target.update({k: v for k, v in text_section(cfg).items() if k in target})
        label = args.config

    hidden, experts = 512, 128
    model = k3_shaped(hidden, experts)
    gen = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, 512, (1, args.seq), generator=gen)
        for _ in range(max(1, args.tokens // args.seq))
    ]
    t = measure(model, batches, {"plain": None, "ours": attach_ours}, args.repeats)
    tokens = sum(b.numel() for b in batches)
    here_cfg = {
        "hidden_size": hidden,
        "routed_expert_hidden_size": hidden // 2,
        "moe_intermediate_size": 64,
        "num_experts": experts,
        "num_experts_per_token": 16,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "num_shared_experts": 1,
        "intermediate_size": 2 * hidden,
        "vocab_size": 512,
        "attention_params_per_layer": 4 * hidden * hidden,
    }
    ratio = active_params(target) / active_params(here_cfg)
    sec_per_m = t["ours"] / tokens * 1e6
    print(
        f"\nmeasured here (CPU, 1 thread): K3-shaped latent MoE, hidden {hidden}, {experts} experts, top-16, "
        f"{tokens} tokens in batches of {args.seq}"
    )
    print(
        f"  plain forward {t['plain']:.3f} s, with REAP observer {t['ours']:.3f} s "
        f"({t['ours'] / t['plain']:.3f}x); {sec_per_m:,.0f} s per million tokens"
    )
    print(f"extrapolated to {label} by active parameters per token (x{ratio:,.0f}):")
    print(
        f"  {sec_per_m * ratio / 3600:,.1f} CPU-thread-hours per million tokens (EXTRAPOLATION, not measured)"
    )
    print(f"memory per rank, sequential onloading, one {args.target_seq}-token sample ({label}):")
    total = 0.0
    for name, gib in memory_per_rank(target, args.target_seq).items():
        total += gib
        print(f"  {name:<36} {gib:8.2f} GiB")
    print(f"  {'total':<36} {total:8.2f} GiB")


if __name__ == "__main__":
    main()
