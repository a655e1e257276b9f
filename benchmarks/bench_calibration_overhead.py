"""Calibration cost of REAP observation, measured side by side in one run.

Variants over the same model and the same batches (interleaved, median of repeats):

- ``plain``: forward passes with no hooks
- ``ours``: forward passes with this package's observer hooks
- ``upstream``: forward passes with llm-compressor 0.14.0.1's REAP hooks
  (only where upstream runs: ``LinearExperts2D`` experts)

Models: a Qwen3-MoE-shaped model with 256 experts / top-16 (linearized, so upstream
runs) and a Kimi-K3-shaped latent MoE (native, routed ``moe_infer``).

Usage: ``python benchmarks/bench_calibration_overhead.py [--repeats 5] [--tokens 2048]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

torch.set_num_threads(1)


def _register(handles):
    def register(module, fn, hook_type, **kwargs):
        handles.append(getattr(module, f"register_{hook_type}_hook")(fn, **kwargs))

    return register


def attach_ours(model):
    from reap_modifier.calibration.observer import SaliencyObserver
    from reap_modifier.models import find_moe_architecture

    handles: list = []
    observer = SaliencyObserver(find_moe_architecture(model), _register(handles))
    observer.attach()
    return handles


def attach_upstream(model):
    from llmcompressor.core import State
    from llmcompressor.modifiers.pruning.reap import REAPPruningModifier as Upstream

    modifier = Upstream(sparsity=0.25)
    state = State(model=model)
    modifier.on_initialize(state)
    modifier.on_calibration_start(state, None)
    return modifier


def detach(obj):
    if isinstance(obj, list):
        for h in obj:
            h.remove()
    elif obj is not None:
        obj.remove_hooks()


def run(model, batches):
    start = time.perf_counter()
    with torch.no_grad():
        for ids in batches:
            model(input_ids=ids, use_cache=False)
    return time.perf_counter() - start


def measure(model, batches, variants, repeats):
    run(model, batches[:1])  # warm-up
    times = {name: [] for name in variants}
    for _ in range(repeats):
        for name, attach in variants.items():
            handle = attach(model) if attach else None
            try:
                times[name].append(run(model, batches))
            finally:
                detach(handle)
    return {name: statistics.median(ts) for name, ts in times.items()}


def qwen3_256(hidden: int):
    from llmcompressor.modeling.moe.linearize import linearize_moe
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=hidden // 4,
        num_experts=256,
        num_experts_per_tok=16,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()
    linearize_moe(model)
    return model


def k3_shaped(hidden: int, experts: int):
    from llmcompressor.modeling.kimi_k3.configuration_kimi_k3 import KimiK3Config
    from llmcompressor.modeling.kimi_k3.modeling_kimi_k3 import KimiK3ForConditionalGeneration

    from reap_modifier.models.loading import register_kimi_auto_classes

    register_kimi_auto_classes()

    text = dict(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        moe_intermediate_size=64,
        num_experts=experts,
        num_experts_per_token=16,
        num_shared_experts=1,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        routed_expert_hidden_size=hidden // 2,
        linear_attn_config=None,
        max_position_embeddings=4096,
        mla_use_nope=True,
    )
    vision = dict(
        vt_num_attention_heads=2,
        vt_num_hidden_layers=1,
        vt_hidden_size=16,
        vt_intermediate_size=32,
        text_hidden_size=hidden,
        mm_hidden_size=16,
        qkv_hidden_size=16,
        _attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = KimiK3ForConditionalGeneration(KimiK3Config(text_config=text, vision_config=vision))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=2048, help="calibration tokens per run")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--k3-experts", type=int, default=256)
    args = parser.parse_args()

    gen = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, 512, (1, args.seq), generator=gen)
        for _ in range(max(1, args.tokens // args.seq))
    ]
    rows = []

    model = qwen3_256(args.hidden)
    t = measure(
        model,
        batches,
        {"plain": None, "ours": attach_ours, "upstream": attach_upstream},
        args.repeats,
    )
    rows.append(("Qwen3-MoE 256 experts, top-16 (linearized)", t))
    del model

    model = k3_shaped(args.hidden, args.k3_experts)
    t = measure(model, batches, {"plain": None, "ours": attach_ours}, args.repeats)
    rows.append((f"Kimi-K3-shaped latent MoE, {args.k3_experts} experts, top-16", t))

    print(
        f"\n{len(batches)} batches x {args.seq} tokens, median of {args.repeats} interleaved repeats, 1 thread"
    )
    print(
        f"{'model':<50} {'plain s':>8} {'ours s':>8} {'upstream s':>10} {'ours/plain':>10} {'upstream/plain':>14}"
    )
    for name, t in rows:
        up = t.get("upstream")
        up_s = f"{up:10.3f}" if up else f"{'n/a':>10}"
        up_r = f"{up / t['plain']:13.3f}x" if up else f"{'n/a':>14}"
        print(
            f"{name:<50} {t['plain']:8.3f} {t['ours']:8.3f} {up_s} "
            f"{t['ours'] / t['plain']:10.3f}x {up_r}"
        )


if __name__ == "__main__":
    main()
