"""Cost of block-error expert selection on ONE Kimi-K3-shaped MoE layer.

The routing problem is K3's (896 experts, top-16, sigmoid router with score-correction
bias, renormalised, routed scaling 2.5, hidden 7168, latent 3584, one shared expert);
the weights are random and, to fit this machine's memory, every expert's intermediate
size is ``--intermediate`` (default 32, K3: 2048): that shrinks only the expert forwards
of the cache set-up (``expert_calls``), never the evaluations, which see the experts
only through their cached ``[hidden]`` outputs. The token count is reduced
(``--tokens``, default 256); every part of the cost is linear in it (the routing of an
evaluation ``O(N E)``, its quadratic form ``O(N k^2)``, the cache ``O(N S H)``), so the
script also prints the time extrapolated linearly to ``--extrapolate`` tokens.

Prints the search's evaluations against the cost formula of
:mod:`reap_modifier.post_cut.block_selection`
(``sum_s min(C, eligible_s) + [d > 1] steps + 1``) and the wall time split into
the cache set-up and the search.

    PYTHONPATH=src python benchmarks/selection_cost.py [--tokens 256] [--candidates 64] [--drops 8]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch


def k3_layer(intermediate: int, n_group: int, topk_group: int):
    """One K3-shaped MoE block with random weights, as a located :class:`MoELayer`."""
    from llmcompressor.modeling.kimi_k3.configuration_kimi_k3 import KimiK3Config
    from llmcompressor.modeling.kimi_k3.modeling_kimi_linear import KimiSparseMoeBlock

    from reap_modifier.models import MoELayer

    text = dict(
        vocab_size=512,
        hidden_size=7168,
        intermediate_size=2 * intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        moe_intermediate_size=intermediate,
        num_experts=896,
        num_experts_per_token=16,
        num_shared_experts=1,
        routed_scaling_factor=2.5,
        routed_expert_hidden_size=3584,
        num_expert_group=n_group,
        topk_group=topk_group,
        first_k_dense_replace=1,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        linear_attn_config=None,
        mla_use_nope=True,
    )
    config = KimiK3Config(text_config=text).text_config
    torch.manual_seed(0)
    block = KimiSparseMoeBlock(config).eval()
    with torch.no_grad():
        block.gate.weight.normal_(0, 7168**-0.5)
        block.gate.e_score_correction_bias.normal_(0, 0.02)
    return MoELayer(name="k3.layer", block=block, router_attr="gate", kind="kimi")


def main() -> None:
    from reap_modifier.post_cut.block_selection import select_by_block_error

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--keep", type=int, default=448)
    ap.add_argument("--candidates", type=int, default=64)
    ap.add_argument("--drops", type=int, default=8)
    ap.add_argument("--extra-slots", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=32)
    ap.add_argument("--n-group", type=int, default=1)
    ap.add_argument("--topk-group", type=int, default=1)
    ap.add_argument("--extrapolate", type=int, default=8192)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    layer = k3_layer(args.intermediate, args.n_group, args.topk_group)
    x = torch.randn(args.tokens, 7168)
    t0 = time.perf_counter()
    with torch.no_grad():
        y = layer.block(x[None])[0]
    t_target = time.perf_counter() - t0
    ranking = torch.rand(896, generator=torch.Generator().manual_seed(0))
    kept, rec = select_by_block_error(
        layer,
        x,
        y,
        args.keep,
        ranking=ranking,
        candidates=args.candidates,
        drops_per_step=args.drops,
        extra_slots=args.extra_slots,
    )
    E, keep, C, d = 896, args.keep, args.candidates, args.drops
    steps = math.ceil((E - keep) / d)
    formula = (
        sum(min(C, E - s * d) for s in range(steps)) + (steps if d > 1 else 0) + 1
    )  # eligible_s = kept experts before step s (flat router)
    scale = args.extrapolate / args.tokens
    result = {
        "args": vars(args),
        "kept": len(kept),
        "steps": len(rec.steps),
        "evaluations": rec.evaluations,
        "evaluations_formula": formula,
        "expert_calls": rec.expert_calls,
        "seconds": rec.seconds,
        "setup_seconds": rec.setup_seconds,
        "seconds_unpruned_block_forward": t_target,
        f"seconds_extrapolated_to_{args.extrapolate}_tokens": rec.seconds * scale,
        "objective": rec.objective,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
