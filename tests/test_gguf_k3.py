"""The K3 test-bed (``tests/helpers/k3_testbed.py``) through the whole GGUF path: a tiny
Kimi K3 with K3's config keys (``linear_attn_config``, ``situ``, attention residuals, the
MLA output gate, latent MoE) and compressed-tensors MXFP4 routed experts, pruned by the
modifier (``oneshot``), converted by llama.cpp's own K3 converter unpruned and pruned;
``reap prune`` of the unpruned GGUF must give the converted pruned checkpoint byte for byte.

The converter tests need ``scripts/llama_cpp_converter.sh`` (skipped without it unless
``REAP_REQUIRE_GGUF_CONVERTER=1``)."""

from __future__ import annotations

import json

import pytest
import torch
from badinput import cli
from gguf_oracle import convert, field_values, require_converter, tensor_bytes
from k3_testbed import (
    IDS,
    LLAMA_CPP_TOL,
    N_LAYERS,
    build_k3_testbed,
    prune_with_reap,
    reference_logits,
)
from mxfp4_fixtures import kept_experts_are_source_bytes, tensor_sha256
from oracles import masked_routing
from tiny_models import reload_class, sample_input_ids

GGML_MXFP4 = 39


@pytest.fixture(scope="module")
def testbed(tmp_path_factory):
    """(source dir, pruned dir, plan file, plan): the test-bed and the modifier's cut."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("k3-testbed")
    build_k3_testbed(root / "src")
    plan = prune_with_reap(root / "src", root / "pruned")
    return root / "src", root / "pruned", plan.save(root / "plan.json"), plan


def test_testbed_is_k3_shaped(testbed):
    src, _, _, _ = testbed
    config = json.loads((src / "config.json").read_text())
    tc = config["text_config"]
    assert tc["linear_attn_config"]["kda_layers"] == []
    assert tc["linear_attn_config"]["full_attn_layers"] == list(range(1, N_LAYERS + 1))
    assert (tc["hidden_act"], tc["activation_situ_beta"], tc["activation_situ_linear_beta"]) == (
        "situ",
        4.0,
        25.0,
    )
    assert tc["attn_res_block_size"] == 2 and tc["mla_use_output_gate"] is True
    assert config["quantization_config"]["format"] == "mxfp4-pack-quantized"
    names = tensor_sha256(src)
    assert sum(n.endswith(".weight_packed") for n in names) == 3 * 16 * (N_LAYERS - 1)
    assert all(".experts." in n for n in names if n.endswith(".weight_packed"))
    # the modeling builds (and so runs) the parts the config names
    model = reload_class("kimi_k3").from_pretrained(src)
    lm = model.language_model.model
    assert lm.use_attn_residuals and all(layer.use_attn_residuals for layer in lm.layers)
    assert all(not layer.is_linear_attn for layer in lm.layers)
    assert all(layer.self_attn.use_output_gate for layer in lm.layers)
    block = lm.layers[1].block_sparse_moe
    assert type(block.experts[0].act_fn).__name__ == "SituAndMul"
    assert (block.experts[0].act_fn.beta, block.experts[0].act_fn.linear_beta) == (4.0, 25.0)


def test_pruned_testbed_equals_masked_routing_in_transformers(testbed):
    """The modifier's pruned MXFP4 checkpoint, reloaded: logits equal the source's with
    the dropped experts masked out of routing (situ, attention residuals and all)."""
    src, pruned, _, plan = testbed
    assert kept_experts_are_source_bytes(src, pruned, plan.kept) > 0
    ids = sample_input_ids(128, batch=1, seq=12, seed=2)
    cls = reload_class("kimi_k3")
    with torch.no_grad():
        got = cls.from_pretrained(pruned).eval()(input_ids=ids, use_cache=False).logits
        source = cls.from_pretrained(src).eval()
        source(input_ids=ids[:, :2], use_cache=False)  # decompresses before the patch
        dropped = {k: sorted(set(range(plan.num_experts)) - set(v)) for k, v in plan.kept.items()}
        with masked_routing(source, "kimi_k3", dropped):
            want = source(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_gguf_prune_byte_identical_to_converting_the_pruned_k3(testbed, tmp_path, outtype):
    require_converter()
    src_dir, pruned_dir, plan_file, plan = testbed
    src = convert(src_dir, tmp_path / "src.gguf", outtype)
    want = convert(pruned_dir, tmp_path / "want.gguf", outtype)
    keys = field_values(src)
    # llama.cpp's K3 keys, from the test-bed's config
    assert keys["general.architecture"] == "kimi-k3"
    assert keys["kimi-k3.attention.head_count_kv"] == [1] * N_LAYERS  # no KDA layer
    assert keys["kimi-k3.activation.situ_beta"] == 4.0
    assert keys["kimi-k3.activation.situ_linear_beta"] == 25.0
    assert keys["kimi-k3.attn_res.block_size"] == 2
    assert keys["kimi-k3.expert_latent_length"] == 32
    tensors = tensor_bytes(src)
    assert {t for n, (_, t, _) in tensors.items() if "_exps." in n} == {GGML_MXFP4}
    assert "output_res_score.weight" in tensors and "blk.1.attn_gate.weight" in tensors

    ours = tmp_path / "ours.gguf"
    res = cli("prune", src, "--plan", plan_file, "-o", ours, "--no-provenance", "-q")
    assert res.exit_code == 0, res.output
    assert ours.read_bytes() == want.read_bytes()

    # with the provenance keys: the same tensors and keys, plus reap.*; verified
    with_keys = tmp_path / "with-keys.gguf"
    assert cli("prune", src, "--plan", plan_file, "-o", with_keys, "-q").exit_code == 0
    assert tensor_bytes(with_keys) == tensor_bytes(want)
    got = field_values(with_keys)
    assert {k: v for k, v in got.items() if not k.startswith("reap.")} == field_values(want)
    assert got["kimi-k3.expert_count"] == plan.num_kept
    assert {k: v for k, v in got.items() if k.startswith("reap.kept_experts.")} == {
        f"reap.kept_experts.{int(k.split('.')[3])}": v for k, v in plan.kept.items()
    }
    res = cli("verify", with_keys, "--source", src, "-q")
    assert res.exit_code == 0 and "OK" in res.output, res.output


def test_llama_cpp_tolerance_covers_the_q8_0_rounding(testbed):
    """The tolerance of the llama.cpp check (``test_gguf_llama_cpp.py``): transformers with
    every routed expert's input rounded to q8_0, as llama.cpp's CPU MXFP4 kernel reads it,
    moves the pruned model's logits by under half of it; the unpruned model is far off."""
    src, pruned, _, _ = testbed
    exact = reference_logits(pruned, IDS)
    rounded = reference_logits(pruned, IDS, q8_0_expert_inputs=True)
    assert 0 < abs(exact - rounded).max() < LLAMA_CPP_TOL / 2
    assert (exact.argmax(-1) == rounded.argmax(-1)).all()
    assert abs(reference_logits(src, IDS) - exact).max() > 5 * LLAMA_CPP_TOL
