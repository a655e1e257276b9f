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


def test_a_tensor_nothing_can_cut_is_named_and_nothing_is_written(tmp_path, tokenizer):
    """A per-expert matrix on the block that surgery does not know: named, no output."""

    def plant(model):
        for layer in find_moe_architecture(model).layers:
            layer.block.register_buffer("mystery", torch.ones(8, 3))

    result = run_family("qwen3_moe", tmp_path, tokenizer, prepare=plant)
    assert result.status == "refused", result
    assert "WholenessError" in result.error and ".mystery: shape (8, 3)" in result.error
    assert result.written == []


def test_a_forward_that_fails_is_a_wholeness_error():
    model, arch, ids, _ = _in_memory("qwen3_moe", [0, 1, 2, 3])

    def boom(module, args):
        raise RuntimeError("index 7 is out of bounds")

    arch.layers[0].block.register_forward_pre_hook(boom)
    with pytest.raises(WholenessError, match="fails its first forward.*index 7"):
        check_whole(model, arch, 8, sample_ids=ids)


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
