"""Nothing broken is ever written: per failure kind (a per-expert tensor under a new
name, a ``[1, E]`` bias, a token -> expert table, a tensor nothing knows how to cut, a
forward that fails) the product handles it exactly or refuses before writing."""

from __future__ import annotations

import pytest
import torch
from family_flow import run_family
from family_zoo import build_family
from generic_oracle import generic_masked_routing

from reap_modifier.models import find_moe_architecture
from reap_modifier.models.refusals import UnsupportedMoEError, check_prunable
from reap_modifier.scores.plan import PlanError, PruningPlan
from reap_modifier.surgery import apply_plan
from reap_modifier.wholeness import WholenessError, check_whole


def _plan(arch, kept: list[int]) -> PruningPlan:
    return PruningPlan(
        kept={layer.name: list(kept) for layer in arch.layers},
        num_experts=arch.num_experts,
        saliency="test",
    )


def _dropped(arch, kept):
    return {layer.name: sorted(set(range(arch.num_experts)) - set(kept)) for layer in arch.layers}


def _in_memory(family: str, kept: list[int], **overrides):
    model, vocab = build_family(family, seed=3, **overrides)
    ids = torch.randint(3, vocab, (2, 10), generator=torch.Generator().manual_seed(1))
    arch = find_moe_architecture(model)
    with torch.no_grad(), generic_masked_routing(model, family, _dropped(arch, kept)):
        expected = model(input_ids=ids, use_cache=False).logits
    apply_plan(model, arch, _plan(arch, kept))
    return model, arch, ids, expected


@pytest.mark.parametrize(
    "family, tensor",
    [
        ("lfm2_moe", "feed_forward.expert_bias"),  # a per-expert bias under a new name
        ("ernie4_5_moe", "mlp.gate.moe_statics.e_score_correction_bias"),  # [1, E]
    ],
)
def test_per_expert_routing_tensors_are_cut_exactly(family, tensor):
    kept = [0, 2, 5, 7]
    model, arch, ids, expected = _in_memory(family, kept)
    layer = arch.layers[0]
    name = tensor.split(".", 1)[1] if tensor.startswith(("feed_forward.", "mlp.")) else tensor
    t = layer.block.get_submodule(name.rsplit(".", 1)[0]) if "." in name else layer.block
    assert 4 in getattr(t, name.rsplit(".", 1)[-1]).shape
    check_whole(model, arch, 8, sample_ids=ids)
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["lfm2_moe", "ernie4_5_moe"])
def test_oneshot_saves_a_checkpoint_that_reloads_and_equals_masked_routing(
    family, tmp_path, tokenizer
):
    result = run_family(family, tmp_path, tokenizer)
    assert result.status == "pruned", result.error
    assert result.max_diff < 1e-4


def _set_hash_tables(model, arch, experts: list[int]):
    gen = torch.Generator().manual_seed(0)
    for layer in arch.layers:
        table = getattr(layer.router, "tid2eid", None)
        if table is not None:
            pick = torch.tensor(experts)[torch.randint(len(experts), table.shape, generator=gen)]
            table.copy_(pick)


def test_hash_table_remapped_when_it_names_only_kept_experts():
    kept = [1, 2, 4, 6]
    model, vocab = build_family("deepseek_v4", seed=3, mlp_layer_types=["hash_moe", "moe"])
    arch = find_moe_architecture(model)
    _set_hash_tables(model, arch, kept)
    ids = torch.randint(3, vocab, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), generic_masked_routing(model, "deepseek_v4+hash", _dropped(arch, kept)):
        expected = model(input_ids=ids, use_cache=False).logits
    apply_plan(model, arch, _plan(arch, kept))
    table = arch.layers[0].router.tid2eid
    assert int(table.max()) < 4
    check_whole(model, arch, 8, sample_ids=ids)
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_hash_table_naming_a_dropped_expert_is_refused():
    model, _ = build_family("deepseek_v4", seed=3, mlp_layer_types=["hash_moe", "moe"])
    arch = find_moe_architecture(model)
    _set_hash_tables(model, arch, list(range(8)))
    with pytest.raises(PlanError, match=r"tid2eid: token -> expert table routes tokens to dropped"):
        apply_plan(model, arch, _plan(arch, [0, 1, 2, 3]))


def test_hash_routed_model_refused_before_calibration(tmp_path, tokenizer):
    model, _ = build_family("deepseek_v4", seed=3, mlp_layer_types=["hash_moe", "moe"])
    with pytest.raises(UnsupportedMoEError, match=r"deepseek_v4 .*hash-routed.*tid2eid"):
        check_prunable(model, find_moe_architecture(model))
    result = run_family("deepseek_v4", tmp_path, tokenizer, mlp_layer_types=["hash_moe", "moe"])
    assert result.status == "refused" and "hash-routed" in result.error
    assert result.written == []


def test_layers_sharing_expert_weights_are_refused_before_calibration():
    """Tied MoE layers (DiffusionGemma's encoder and decoder): one tensor, two plans."""
    model, _ = build_family("qwen3_moe", seed=3)
    check_prunable(model, find_moe_architecture(model))  # untied: prunes
    arch = find_moe_architecture(model)
    first, second = arch.layers[0], arch.layers[1]
    second.experts.gate_up_proj = first.experts.gate_up_proj
    with pytest.raises(UnsupportedMoEError, match=rf"{first.name} and {second.name} share"):
        check_prunable(model, arch)
    model, _ = build_family("diffusion_gemma", seed=3)
    with pytest.raises(UnsupportedMoEError, match=r"diffusion_gemma .*tied"):
        check_prunable(model, find_moe_architecture(model))


def test_a_size_equal_to_the_expert_count_is_not_an_expert_axis(tmp_path, tokenizer):
    """An unknown ``[E, 3]`` buffer on the block (a size that equals E, no known expert
    axis) is left as it is; the forward proves the pruned model runs, and it saves."""

    def plant(model):
        for layer in find_moe_architecture(model).layers:
            layer.block.register_buffer("mystery", torch.ones(8, 3))

    result = run_family("qwen3_moe", tmp_path, tokenizer, prepare=plant)
    assert result.status == "pruned", result.error
    assert result.max_diff < 1e-4


def _restore(module, attr, old):
    tensor = getattr(module, attr)
    if isinstance(tensor, torch.nn.Parameter):
        setattr(module, attr, torch.nn.Parameter(old, requires_grad=False))
    else:
        setattr(module, attr, old)


@pytest.mark.parametrize(
    "family, where, expected",
    [
        ("qwen3_moe", "gate.weight", r"mlp\.gate\.weight: shape \(8, 32\), expected 4 router rows"),
        ("gpt_oss", "router.bias", r"mlp\.router\.bias: shape \(8,\), expected 4 router rows"),
        (
            "deepseek_v3",
            "gate.e_score_correction_bias",
            r"e_score_correction_bias: shape \(8,\) still",
        ),
        ("qwen3_moe", "experts.gate_up_proj", r"experts\.gate_up_proj: shape \(8, 64, 32\) still"),
        ("lfm2_moe", "expert_bias", r"feed_forward\.expert_bias: shape \(8,\) still"),
    ],
)
def test_a_known_per_expert_tensor_left_at_the_old_count_is_named(family, where, expected):
    """Each tensor known to be per expert (router rows and bias, routing vectors, fused
    experts) is checked on its expert axis: put back uncut, it is named."""
    model, _ = build_family(family, seed=3)
    arch = find_moe_architecture(model)
    layer = arch.layers[0]
    owner_name, attr = where.rsplit(".", 1) if "." in where else ("", where)
    owner = layer.block.get_submodule(owner_name) if owner_name else layer.block
    old = getattr(owner, attr).detach().clone()
    apply_plan(model, arch, _plan(arch, [0, 2, 5, 7]))
    check_whole(model, arch, 8, run_forward=False)  # whole as cut
    _restore(owner, attr, old)
    with pytest.raises(WholenessError, match=expected):
        check_whole(model, arch, 8, run_forward=False)


def test_router_rows_are_cut_once_when_kept_plus_shared_rows_equal_the_old_count():
    """Inkling: 8 routed + 1 shared-expert router row; keeping 7 leaves 8 rows, which
    must not be taken for an uncut router and cut again."""
    kept = [0, 1, 2, 3, 4, 6, 7]
    model, arch, ids, expected = _in_memory("inkling", kept)
    assert arch.layers[0].extra_rows == 1
    assert arch.layers[0].router_weight().shape[0] == 8
    check_whole(model, arch, 8, sample_ids=ids)
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_counts_left_at_the_old_value_are_named():
    model, _ = build_family("qwen3_moe", seed=3)
    arch = find_moe_architecture(model)
    apply_plan(model, arch, _plan(arch, [0, 2, 5, 7]))
    arch.layers[1].experts.num_experts = 8
    arch.layers[0].router.out_features = 8
    key = arch.count_keys[0]
    setattr(arch.config, key, 8)
    with pytest.raises(WholenessError) as err:
        check_whole(model, arch, 8, run_forward=False)
    assert "model.layers.1.mlp.experts.num_experts is still 8" in str(err.value)
    assert f"config {key} is 8, expected 4" in str(err.value)
    assert "mlp.gate.out_features is 8, expected 4 router rows" in str(err.value)


def test_an_unknown_per_expert_tensor_the_forward_uses_fails_the_forward_proof():
    """A per-expert matrix no rule knows, which the block's forward reads: not judged by
    its shape, but the forward proof fails, so nothing is written."""
    model, arch, ids, _ = _in_memory("qwen3_moe", [0, 1, 2, 3])
    block = arch.layers[0].block
    block.register_buffer("mystery", torch.ones(8, 3))

    def uses_mystery(module, args):
        args[0] @ module.gate.weight.T @ module.mystery  # [.., E_new] @ [E_old, 3]

    block.register_forward_pre_hook(uses_mystery)
    with pytest.raises(WholenessError, match="fails its first forward"):
        check_whole(model, arch, 8, sample_ids=ids)


def test_blocks_run_on_their_calibration_inputs_when_the_model_takes_no_token_ids():
    """The forward proof runs the whole model on token ids when its forward takes them;
    for a model whose forward takes hidden states, each block on its recorded input, or
    without one on hidden states of its router's input width."""
    model, arch, ids, _ = _in_memory("qwen3_moe", [0, 1, 2, 3])
    seen = []
    for layer in arch.layers:
        layer.block.register_forward_pre_hook(lambda m, a: seen.append(tuple(a[0].shape)))
    inputs = {layer.name: torch.randn(1, 3, 32) for layer in arch.layers}
    check_whole(model, arch, 8, sample_ids=ids, block_inputs=inputs)
    assert seen == [(1, 10, 32), (1, 10, 32)]  # the model on the first sample's ids
    model.forward = lambda hidden_states: hidden_states  # takes no token ids
    seen.clear()
    check_whole(model, arch, 8, sample_ids=ids, block_inputs=inputs)
    assert seen == [(1, 3, 32), (1, 3, 32)]
    seen.clear()
    check_whole(model, arch, 8)
    assert seen == [(1, 4, 32), (1, 4, 32)]


def test_no_tokens_names_the_pipeline_when_batches_were_cached():
    """The sequential pipeline cached batches but never called the MoE blocks (e.g. a
    wrapper whose traced layers are not the ones holding the experts): the message must
    say pipeline="basic", not "pass a dataset"."""
    from types import SimpleNamespace

    from reap_modifier import REAPPruningModifier

    model, _ = build_family("qwen3_moe", seed=0)
    modifier = REAPPruningModifier(sparsity=0.5)
    modifier._observer = SimpleNamespace(pipeline_batches=3)
    message = modifier._no_tokens_message(model)
    assert 'pipeline="basic"' in message and "qwen3_moe" in message and "3" in message
    modifier._observer = SimpleNamespace(pipeline_batches=0)
    assert "Pass a dataset" in modifier._no_tokens_message(model)
