"""Input-side gating (Llama-4: the router's sigmoid score scales each expert's input):
the observer's statistics equal a float64 brute force written from the weights, for the
native fused experts and llm-compressor's linearized ones, with calibrate-all on and off;
the hooks leave the model's output unchanged."""

from __future__ import annotations

import pytest
import torch
from family_routing import moe_blocks, router_and_biases
from family_zoo import build_family
from test_saliency_oracle import _assert_stats_equal, _batches, observe

from reap_modifier.models import find_moe_architecture


def _tiny_llama4():
    model, vocab = build_family("llama4", seed=7)
    return model.double(), vocab


@torch.no_grad()
def _brute_force(model, batches) -> dict[str, dict[str, torch.Tensor]]:
    """Per MoE block: logits = x W^T, the top-k, g = sigmoid(top logit), the expert's
    contribution f_j(g x) from its own weights; norm = ||f_j(g x)|| / g. Blocks and
    routers by :mod:`family_routing`, the sizes from the config (not the product's
    discovery)."""
    blocks = moe_blocks(model, "llama4")
    inputs = {name: [] for name in blocks}
    handles = [
        block.register_forward_pre_hook(
            lambda m, a, name=name: inputs[name].append(a[0].reshape(-1, a[0].shape[-1]))
        )
        for name, block in blocks.items()
    ]
    for ids in batches:
        model(input_ids=ids, use_cache=False)
    for h in handles:
        h.remove()
    text = model.config.text_config
    E, k = text.num_local_experts, text.num_experts_per_tok
    out = {}
    for name, block in blocks.items():
        x = torch.cat(inputs[name]).double()
        W = router_and_biases(block, "llama4")[0].double()
        experts = block.experts
        top, ids = (x @ W.T).topk(k, dim=-1)
        g = torch.sigmoid(top.float()).double()  # the router's sigmoid runs in float32
        stats = {s: torch.zeros(E, dtype=torch.float64) for s in ("count", "sum_weight")}
        stats.update({s: torch.zeros(E, dtype=torch.float64) for s in ("sum_norm", "sum_reap")})
        stats["max_norm"] = torch.zeros(E, dtype=torch.float64)
        for t in range(x.shape[0]):
            for s in range(k):
                j, gate = int(ids[t, s]), g[t, s]
                h = gate * x[t]
                gate_up = h @ experts.gate_up_proj[j].double()
                a, b = gate_up.chunk(2, dim=-1)
                f = (b * torch.nn.functional.silu(a)) @ experts.down_proj[j].double()
                norm = f.norm() / gate
                stats["count"][j] += 1
                stats["sum_weight"][j] += gate
                stats["sum_norm"][j] += norm
                stats["sum_reap"][j] += gate * norm
                stats["max_norm"][j] = max(stats["max_norm"][j], norm)
        out[name] = stats
    return out


def test_llama4_is_recognised_as_input_gated():
    model, _ = _tiny_llama4()
    arch = find_moe_architecture(model)
    assert arch.layers and {layer.kind for layer in arch.layers} == {"input_gated"}


@pytest.mark.parametrize("linearized", [False, True], ids=["native", "linearized"])
@pytest.mark.parametrize("calibrate_all", [False, True], ids=["routed", "calibrate_all"])
def test_llama4_statistics_match_brute_force(linearized, calibrate_all):
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D
    from llmcompressor.modeling.moe.linearize import linearize_moe

    model, vocab = _tiny_llama4()
    batches = _batches(vocab)
    reference = _brute_force(model, batches)
    if linearized:
        linearize_moe(model)
        model.double()  # the linearized experts are built in the config's dtype
        arch = find_moe_architecture(model)
        assert all(isinstance(layer.experts, LinearExperts2D) for layer in arch.layers)
        assert {layer.kind for layer in arch.layers} == {"input_gated"}
    scores = observe(model, batches, calibrate_all)
    # the model computes in float64 too; what is left is summation order
    _assert_stats_equal(scores, reference, rtol=1e-9)
    assert scores.metadata["tokens"] == {"unit": sum(b.numel() for b in batches)}


def test_llama4_hooks_leave_the_output_unchanged():
    from test_saliency_oracle import _register

    from reap_modifier.calibration.observer import SaliencyObserver

    model, vocab = _tiny_llama4()
    ids = _batches(vocab)[0]
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
        handles = []
        observer = SaliencyObserver(
            find_moe_architecture(model), lambda *a, **kw: handles.append(_register(*a, **kw))
        )
        observer.attach()
        hooked = model(input_ids=ids, use_cache=False).logits
    for h in handles:
        h.remove()
    assert torch.equal(hooked, plain)
