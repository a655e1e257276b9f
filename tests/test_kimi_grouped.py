"""The grouped Kimi dispatch of REAP's routed calibration: the observer's statistics on
it equal the brute-force float64 reference and the per-expert ``moe_infer`` path's,
the block's output is unchanged, and the grouped_mm path really runs where it can (a
float32 tiny K3 and the bundled bf16 model on CPU); float64 uses the per-expert loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from oracles import STAT_KEYS, brute_force_stats
from tiny_models import build_tiny

from reap_modifier.calibration.observer import SaliencyObserver
from reap_modifier.models import find_moe_architecture

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-k3-bilingual"


def _register(module, fn, hook_type, **kwargs):
    return getattr(module, f"register_{hook_type}_hook")(fn, **kwargs)


def observe(model, batches, grouped: bool):
    """Scores, last logits and whether each layer's stacked (grouped_mm) weights were
    built."""
    arch = find_moe_architecture(model)
    handles = []
    observer = SaliencyObserver(
        arch, lambda *a, **k: handles.append(_register(*a, **k)), grouped=grouped
    )
    built = {}
    if grouped:
        dispatch = observer._grouped
        stack_for = dispatch._stack_for

        def spy(name, block):
            stack = stack_for(name, block)
            built[name] = stack is not None
            return stack

        dispatch._stack_for = spy
    observer.attach()
    try:
        with torch.no_grad():
            for ids in batches:
                logits = model(input_ids=ids, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
        observer.detach()
    return observer.to_scores("unit"), logits, built


def _batches(vocab, n=3, shape=(2, 12)):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, shape, generator=gen) for _ in range(n)]


def _assert_close(scores, reference, rtol):
    assert set(scores.layers) == set(reference)
    for layer, ref in reference.items():
        got = scores.layers[layer]
        assert got["count"].sum() > 0
        for stat in STAT_KEYS:
            torch.testing.assert_close(
                got[stat],
                ref[stat].to(torch.float64),
                rtol=rtol,
                atol=1e-12,
                msg=lambda m, layer=layer, stat=stat: f"{layer}::{stat}: {m}",
            )


@pytest.mark.parametrize(
    ("dtype", "uses_grouped_mm", "rtol"),
    [(torch.float64, False, 1e-10), (torch.float32, True, 1e-5)],
    ids=["float64-loop", "float32-grouped_mm"],
)
def test_grouped_dispatch_matches_brute_force_and_moe_infer(dtype, uses_grouped_mm, rtol):
    model, info = build_tiny("kimi_k3", seed=3, dtype=dtype)
    batches = _batches(info.vocab_size)
    reference = brute_force_stats(model, "kimi_k3", batches, routing="native")
    grouped, grouped_logits, built = observe(model, batches, grouped=True)
    looped, looped_logits, _ = observe(model, batches, grouped=False)
    assert built and set(built.values()) == {uses_grouped_mm}
    _assert_close(grouped, reference, rtol)
    _assert_close(grouped, looped.layers, rtol)
    torch.testing.assert_close(grouped_logits, looped_logits, rtol=rtol, atol=rtol)
    # detached: the blocks run their own moe_infer again
    for layer in find_moe_architecture(model).layers:
        assert "moe_infer" not in layer.block.__dict__


def test_grouped_dispatch_latent_norm_and_groups():
    model, info = build_tiny(
        "kimi_k3",
        seed=6,
        dtype=torch.float32,
        num_expert_group=4,
        topk_group=2,
        latent_moe_use_norm=True,
    )
    batches = _batches(info.vocab_size)
    scores, _, built = observe(model, batches, grouped=True)
    assert all(built.values())
    _assert_close(scores, brute_force_stats(model, "kimi_k3", batches, routing="native"), 1e-5)


def test_other_hooks_on_experts_fall_back_to_the_loop():
    """Another hook on an expert projection (a quantization observer, packed weights)
    must see its calls: the layer uses the per-expert loop, with the same statistics."""
    model, info = build_tiny("kimi_k3", seed=3, dtype=torch.float32)
    batches = _batches(info.vocab_size)
    layer = find_moe_architecture(model).layers[0]
    calls = []
    handle = layer.experts[0].w1.register_forward_hook(lambda *a: calls.append(1))
    try:
        scores, _, built = observe(model, batches, grouped=True)
    finally:
        handle.remove()
    assert built[layer.name] is False and calls
    looped, _, _ = observe(model, batches, grouped=False)
    _assert_close(scores, looped.layers, 1e-5)


def test_hooks_disabled_runs_moe_infer_and_records_nothing():
    from llmcompressor.modifiers.utils.hooks import HooksMixin

    model, info = build_tiny("kimi_k3", seed=3, dtype=torch.float32)
    arch = find_moe_architecture(model)
    mixin = HooksMixin()
    observer = SaliencyObserver(arch, mixin.register_hook, grouped=True)
    observer.attach()
    try:
        with torch.no_grad(), HooksMixin.disable_hooks():
            model(input_ids=_batches(info.vocab_size)[0], use_cache=False)
        assert observer._grouped._stack is None
    finally:
        mixin.remove_hooks()
        observer.detach()
    assert all(s["count"].sum() == 0 for s in observer.to_scores("unit").layers.values())


@pytest.mark.skipif(not (MODEL / "config.json").exists(), reason=f"{MODEL} not present")
def test_bundled_model_grouped_mm_equals_moe_infer():
    """The committed bf16 K3 (MXFP4 experts, decompressed on load): grouped_mm on the
    CPU gives the per-expert path's statistics and logits."""
    from transformers import AutoModelForCausalLM

    from reap_modifier.models.loading import register_kimi_auto_classes

    register_kimi_auto_classes()
    model = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.bfloat16).eval()
    batches = _batches(model.config.text_config.vocab_size, n=2, shape=(1, 48))
    looped, looped_logits, _ = observe(model, batches, grouped=False)  # decompresses
    grouped, grouped_logits, built = observe(model, batches, grouped=True)
    assert built and all(built.values())
    _assert_close(grouped, looped.layers, 1e-6)
    torch.testing.assert_close(grouped_logits, looped_logits, rtol=1e-6, atol=1e-6)
