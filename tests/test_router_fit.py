"""Router calibration after a cut: the layer-local fit on tiny models of each router kind.

Oracle: the loss the fit reports is recomputed with the block's *own* forward (no
swapped dispatch) after the fitted rows are written into the router, against the
unpruned block's outputs captured by a plain forward hook; the experts are compared
tensor by tensor before and after.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny, capture_block_io, sample_input_ids

from reap_modifier.models import find_moe_architecture
from reap_modifier.post_cut import RouterFitError
from reap_modifier.post_cut.block_fit import block_output, differentiable_dispatch, relative_error
from reap_modifier.post_cut.router_fit import fit_router, router_fit_problem
from reap_modifier.surgery import prune_layer

#: router kinds: softmax top-k (renormalised), sigmoid + score-correction bias with
#: groups and routed scaling (Kimi K3, DeepSeek-V3), softmax over top-k logits with a
#: router bias (GPT-OSS)
KINDS = {
    "qwen3_moe": {},
    "kimi_k3": {"grouped": True},
    "deepseek_v3": {},
    "gpt_oss": {},
}


def _cut_half(arch):
    """Keep the larger-norm half of each group's router rows (a valid grouped cut)."""
    E = arch.num_experts
    groups = arch.n_group if arch.group_limited else 1
    per = E // groups
    for layer in arch.layers:
        norms = layer.router.weight.detach().norm(dim=1)
        kept = []
        for g in range(groups):
            order = norms[g * per : (g + 1) * per].argsort(descending=True)
            kept += (order[: per // 2] + g * per).tolist()
        prune_layer(layer, sorted(kept), E)


def _pruned_with_targets(family, seed=3):
    model, info = build_tiny(family, seed=seed, **KINDS[family])
    arch = find_moe_architecture(model)
    ids = sample_input_ids(info.vocab_size, batch=4, seq=64, seed=1)
    io = capture_block_io(model, arch, ids)
    _cut_half(arch)
    return model, arch, io


def _expert_state(layer):
    return {k: v.detach().clone() for k, v in layer.experts.state_dict().items()}


@pytest.mark.parametrize("family", list(KINDS))
def test_dispatch_swap_equals_the_blocks_own_forward(family):
    model, arch, io = _pruned_with_targets(family)
    for layer in arch.layers:
        x, _ = io[layer.name]
        plain = block_output(layer, x)
        with differentiable_dispatch(layer):
            swapped = block_output(layer, x)
        torch.testing.assert_close(swapped, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", list(KINDS))
def test_fit_lowers_the_layer_local_loss(family):
    model, arch, io = _pruned_with_targets(family)
    for layer in arch.layers:
        x, y = io[layer.name]
        experts_before = _expert_state(layer)
        bias_before = getattr(layer.router, "e_score_correction_bias", None)
        bias_before = bias_before.detach().clone() if bias_before is not None else None
        weight_before = layer.router.weight.detach().clone()
        cut_loss = relative_error(block_output(layer, x), y).item()

        fitted, result = fit_router(layer, x, y, steps=60, lr=0.03)

        # the fit leaves the layer as it was: the caller writes the rows
        torch.testing.assert_close(layer.router.weight, weight_before, rtol=0, atol=0)
        assert result.loss_before == pytest.approx(
            relative_error(block_output(layer, x[_fit_rows(x)]), y[_fit_rows(x)]).item(), rel=1e-4
        )
        assert result.holdout_after < result.holdout_before
        assert result.loss_after < 0.95 * result.loss_before
        assert result.fitted and result.best_step > 0
        with torch.no_grad():
            for name, tensor in fitted.items():
                getattr(layer.router, name).copy_(tensor)
        # the block's own forward (no swapped dispatch) with the fitted rows
        fitted_loss = relative_error(block_output(layer, x), y).item()
        assert fitted_loss < cut_loss
        held = ~_fit_rows(x)
        assert relative_error(block_output(layer, x[held]), y[held]).item() == pytest.approx(
            result.holdout_after, rel=1e-4
        )
        for key, value in _expert_state(layer).items():
            assert torch.equal(value, experts_before[key]), key
        if bias_before is not None:
            assert torch.equal(layer.router.e_score_correction_bias, bias_before)


def _fit_rows(x):
    from reap_modifier.post_cut.block_fit import HOLDOUT_EVERY

    rows = torch.ones(x.shape[0], dtype=torch.bool)
    rows[HOLDOUT_EVERY - 1 :: HOLDOUT_EVERY] = False
    return rows


def test_no_step_keeps_the_cut_rows_bit_for_bit():
    model, arch, io = _pruned_with_targets("qwen3_moe")
    layer = arch.layers[0]
    x, y = io[layer.name]
    fitted, result = fit_router(layer, x, y, steps=0)
    assert torch.equal(fitted["weight"], layer.router.weight)
    assert result.fitted == [] and result.best_step == 0
    assert result.loss_after == pytest.approx(result.loss_before)


def test_router_the_fit_cannot_express():
    model, arch, io = _pruned_with_targets("kimi_k3")
    layer = arch.layers[0]
    layer.router.moe_router_activation_func = "relu"
    assert "activation 'relu'" in router_fit_problem(layer)
    x, y = io[layer.name]
    with pytest.raises(RouterFitError, match="not one of"):
        fit_router(layer, x, y, steps=1)
    layer.router.moe_router_activation_func = "sigmoid"
    layer.router.weight = torch.nn.Parameter(
        layer.router.weight.detach().to(torch.int8), requires_grad=False
    )
    with pytest.raises(RouterFitError, match="quantized"):
        fit_router(layer, x, y, steps=1)


def test_mismatched_fitting_data():
    model, arch, io = _pruned_with_targets("qwen3_moe")
    layer = arch.layers[0]
    x, y = io[layer.name]
    with pytest.raises(RouterFitError, match="must both be"):
        fit_router(layer, x, y[:-1], steps=1)


@pytest.mark.parametrize("family", ["qwen3_moe", "kimi_k3"])
def test_dispatch_swap_restores_instance_wrappers(family):
    """An instance-level wrapper (compressed-tensors' offload wraps ``forward`` so) is
    back in place after the swap; without one, nothing is left on the instance."""
    model, arch, io = _pruned_with_targets(family)
    layer = arch.layers[0]
    target = layer.block if family == "kimi_k3" else layer.experts
    attr = "moe_infer" if family == "kimi_k3" else "forward"
    with differentiable_dispatch(layer):
        assert attr in vars(target)
    assert attr not in vars(target)
    calls = []
    original = getattr(target, attr)

    def wrapper(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    vars(target)[attr] = wrapper
    x, _ = io[layer.name]
    with differentiable_dispatch(layer):
        swapped = block_output(layer, x)
    assert vars(target)[attr] is wrapper
    calls.clear()
    torch.testing.assert_close(block_output(layer, x), swapped, rtol=1e-5, atol=1e-6)
    assert calls


@pytest.mark.parametrize("family", ["qwen3_moe", "kimi_k3"])
def test_fit_on_a_bf16_model(family):
    """A bf16 model (as loaded from a bf16 checkpoint): the router computes in bf16 during
    the fit, Adam updates float32 masters, and the fitted rows come back in bf16."""
    model, info = build_tiny(family, seed=3, **KINDS[family])
    model = model.to(torch.bfloat16)
    arch = find_moe_architecture(model)
    ids = sample_input_ids(info.vocab_size, batch=4, seq=64, seed=1)
    io = capture_block_io(model, arch, ids)
    _cut_half(arch)
    for layer in arch.layers:
        x, y = io[layer.name]
        assert x.dtype == torch.bfloat16
        fitted, result = fit_router(layer, x, y, steps=40, lr=0.03)
        assert result.best_step > 0 and result.holdout_after < result.holdout_before
        assert all(t.dtype == torch.bfloat16 for t in fitted.values())
        with torch.no_grad():
            for name, tensor in fitted.items():
                getattr(layer.router, name).copy_(tensor)
        held = ~_fit_rows(x)
        assert relative_error(block_output(layer, x[held]), y[held]).item() == pytest.approx(
            result.holdout_after, rel=1e-3
        )
