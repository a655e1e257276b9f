"""HF -> GGUF export of a pruned model: the saved config.json carries the live expert count
under every alias and spells out the router's scoring function, so llama.cpp's own
converter writes the pruned count and sigmoid routing (without them it reads a stale alias
first, or falls back to softmax)."""

from __future__ import annotations

import json

import torch
from gguf_oracle import convert, field_values, require_converter

from reap_modifier.checkpoint.saved_config import fix_saved_expert_counts, spell_out_scoring_func

SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def test_every_count_alias_gets_the_live_count(tmp_path):
    from transformers import Qwen3MoeConfig

    live = Qwen3MoeConfig(num_experts=16)
    live.num_experts = 8  # what the cut leaves (attribute_map: num_local_experts)
    saved = {"model_type": "qwen3_moe", "num_experts": 16, "num_local_experts": 16}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    fix_saved_expert_counts(live, str(tmp_path))
    got = json.loads((tmp_path / "config.json").read_text())
    assert (got["num_experts"], got["num_local_experts"]) == (8, 8)


def test_scoring_func_spelled_out_for_deepseek_v3_only(tmp_path):
    for model_type, want in (("deepseek_v3", "sigmoid"), ("qwen3_moe", None)):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
        spell_out_scoring_func(None, str(tmp_path))
        assert json.loads((tmp_path / "config.json").read_text()).get("scoring_func") == want
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "deepseek_v3", "scoring_func": "softmax"})
    )
    spell_out_scoring_func(None, str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["scoring_func"] == "softmax"


def test_converter_reads_sigmoid_routing_and_the_pruned_count(tmp_path):
    require_converter()
    from conftest import make_tokenizer
    from tiny_models import build_tiny

    torch.set_num_threads(1)
    model, _ = build_tiny("deepseek_v3", hidden_size=64, moe_intermediate_size=32)
    model.save_pretrained(tmp_path / "m")
    make_tokenizer().save_pretrained(tmp_path / "m")
    bare = field_values(convert(tmp_path / "m", tmp_path / "bare.gguf", "f32"))
    assert "deepseek2.expert_gating_func" not in bare  # the trap: llama.cpp then uses softmax
    spell_out_scoring_func(model.config, str(tmp_path / "m"))
    fixed = field_values(convert(tmp_path / "m", tmp_path / "fixed.gguf", "f32"))
    assert fixed["deepseek2.expert_gating_func"] == SIGMOID
    assert fixed["deepseek2.expert_count"] == 16


def test_baseline_scores_from_a_gguf_equal_the_safetensors_ones(tmp_path):
    """``reap scores from-weights`` on the GGUF gives the safetensors model's baseline (same
    saliency, same fingerprints), and ``reap prune`` cuts the GGUF with it."""
    require_converter()
    from badinput import cli
    from conftest import make_tokenizer
    from tiny_models import build_tiny

    torch.set_num_threads(1)
    model, _ = build_tiny(
        "qwen3_moe", num_experts=16, hidden_size=64, moe_intermediate_size=32, head_dim=32
    )
    model.save_pretrained(tmp_path / "m")
    make_tokenizer().save_pretrained(tmp_path / "m")
    gguf_file = convert(tmp_path / "m", tmp_path / "m.gguf", "f32")
    for src, out in ((tmp_path / "m", "hf.safetensors"), (gguf_file, "gguf.safetensors")):
        res = cli("scores", "from-weights", src, "--method", "router_l1", "-o", tmp_path / out)
        assert res.exit_code == 0, res.output
    from safetensors import safe_open

    with (
        safe_open(str(tmp_path / "hf.safetensors"), "pt") as a,
        safe_open(str(tmp_path / "gguf.safetensors"), "pt") as b,
    ):
        assert sorted(a.keys()) == sorted(b.keys())
        for k in a.keys():
            assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k
        meta_a = json.loads(a.metadata()["reap_scores"])
        meta_b = json.loads(b.metadata()["reap_scores"])
    assert meta_a["model_fingerprint"] == meta_b["model_fingerprint"]
    res = cli(
        "prune",
        gguf_file,
        "--scores",
        tmp_path / "gguf.safetensors",
        "--keep",
        "8",
        "--saliency",
        "router_l1",
        "-o",
        tmp_path / "p.gguf",
        "-q",
    )
    assert res.exit_code == 0, res.output
    values = field_values(tmp_path / "p.gguf")
    assert values["qwen3moe.expert_count"] == 8
    for L, layer in enumerate(model.model.layers):  # the 8 largest router rows by L1 norm
        l1 = layer.mlp.gate.weight.detach().double().abs().sum(-1)
        assert values[f"reap.kept_experts.{L}"] == sorted(torch.topk(l1, 8).indices.tolist())
