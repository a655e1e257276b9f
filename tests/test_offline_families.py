"""The offline path on a saved checkpoint of each MoE family: ``reap scores
from-weights`` -> ``reap prune`` -> ``reap verify --source`` -> ``from_pretrained`` ->
logits equal to the unpruned model with the dropped experts masked out of routing
(:mod:`generic_oracle`), every output tensor sha256-equal to the bytes it came from;
and, per failure kind (a per-expert tensor under a new name, a ``[1, E]`` bias, a token
-> expert table, a tensor no rule cuts), that ``reap prune`` cuts it exactly or refuses
before anything is written.

One family: ``pytest tests/test_offline_families.py -q -k lfm2_moe``.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from family_routing import ROUTING, moe_blocks, router_and_biases, spread_biases_
from family_zoo import build_family
from generic_oracle import generic_masked_routing
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from reap_modifier.cli import app

runner = CliRunner()
KEEP = 4  # of the zoo's 8 experts (top-k 2)

#: one family per checkpoint layout the rewriter must handle (see docs/README-checkpoint.md)
FAMILIES = {
    "qwen3_moe": "per-expert tensors, gate.weight",
    "deepseek_v3": "gate.e_score_correction_bias, shared experts",
    "lfm2_moe": "feed_forward.expert_bias on the block",
    "ernie4_5_moe": "moe_statics.e_score_correction_bias [1, E], moe_num_experts, moe_k",
    "gpt_oss": "fused experts with biases, router.bias, num_local_experts",
    "granitemoe": "no experts module: input_linear/output_linear [E, ...], router.layer",
    "mixtral": "block_sparse_moe on disk, mlp when loaded",
    "minimax_m2": "e_score_correction_bias on the block",
    "laguna": "experts.e_score_correction_bias",
    "hunyuan_v1_moe": "gate.wg.weight, moe_topk",
    "qwen3_vl_moe": "nested text_config, fused experts",
    "inkling": "a router row per shared expert after the routed ones",
    "gemma4": "experts and router directly under the decoder layer, q_norm [head_dim = E]",
    "diffusion_gemma": "encoder and decoder MoE layers tied: stored once, cut once",
}


def _run(*args, code: int = 0) -> str:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == code, (result.output, result.exception)
    return result.output


def _layer(name: str) -> int:
    return int(re.findall(r"layers\.(\d+)", name)[-1])


def offline_flow(family: str, root: Path, model=None) -> float:
    """Save ``family``'s tiny model, prune it offline, verify, reload; returns the max
    abs logit difference from the masked-routing oracle."""
    if model is None:
        model, _ = build_family(family, seed=13)
        spread_biases_(model, family)
    src, dst, scores = root / "src", root / "dst", root / "l1.safetensors"
    model.save_pretrained(src)
    _run("scores", "from-weights", src, "--method", "router_l1", "-o", scores)
    _run("prune", src, "--scores", scores, "--keep", KEEP, "--saliency", "router_l1",
         "-o", dst, "-q", "--no-hash-cache")  # fmt: skip
    out = _run("verify", dst, "--source", src, "-q")
    manifest = json.loads((dst / "pruning_manifest.json").read_text())
    tensors = int(re.search(r"(\d+) tensors in", out)[1])
    assert f"{tensors} tensors sha256-equal to the source" in out, out  # bit-exact
    cls = type(model)
    source = cls.from_pretrained(src, dtype=torch.float32).eval()
    pruned, info = cls.from_pretrained(dst, dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (
        info
    )
    blocks = moe_blocks(source, family)
    kept = {_layer(p): ids for p, ids in manifest["checkpoint"]["block_kept"].items()}
    # tied layers (DiffusionGemma's encoder and decoder) are one set of tensors on disk
    assert sorted(kept) == sorted({_layer(name) for name in blocks})
    extra = ROUTING[family].extra_rows
    E = int(router_and_biases(next(iter(blocks.values())), family)[0].shape[0]) - extra
    dropped = {name: sorted(set(range(E)) - set(kept[_layer(name)])) for name in blocks}
    pruned_blocks = moe_blocks(pruned, family)
    assert sorted(pruned_blocks) == sorted(blocks)
    for block in pruned_blocks.values():
        assert router_and_biases(block, family)[0].shape[0] == KEEP + extra
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(5))

    def logits(model):  # seeded: a block-diffusion forward samples its canvas noise
        torch.manual_seed(0)
        return model(input_ids=ids, use_cache=False).logits

    with torch.no_grad():
        plain = logits(source)
        with generic_masked_routing(source, family, dropped):
            expected = logits(source)
        got = logits(pruned.eval())
    assert not torch.equal(plain, expected), f"{family}: masking changed nothing"
    return float((got - expected).abs().max())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_offline_prune_equals_masked_routing(family, tmp_path):
    assert offline_flow(family, tmp_path) < 1e-4


def _other_pruned_families() -> list[str]:
    """Every other family the coverage table marks "pruned, equals masked routing"."""
    from test_families import committed_rows

    done = "| pruned, equals masked routing |"
    return [f for f, row in committed_rows().items() if row.endswith(done) and f not in FAMILIES]


@pytest.mark.parametrize("family", _other_pruned_families())
def test_every_pruned_family_prunes_offline_too(family, tmp_path):
    """The offline path follows the in-memory one for every family it prunes."""
    assert offline_flow(family, tmp_path) < 1e-4


# -- failure kinds --------------------------------------------------------------------------


def _saved(family: str, root: Path, **overrides) -> Path:
    model, _ = build_family(family, seed=13, **overrides)
    src = root / "src"
    model.save_pretrained(src)
    return src


def _edit(src: Path, change) -> None:
    """Rewrite the single shard of ``src`` with ``change(tensors)`` applied."""
    path = src / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _prune(src: Path, root: Path, code: int) -> tuple[Path, str]:
    scores, dst = root / "l1.safetensors", root / "dst"
    _run("scores", "from-weights", src, "--method", "router_l1", "-o", scores)
    out = _run("prune", src, "--scores", scores, "--keep", KEEP, "--saliency", "router_l1",
               "-o", dst, "-q", "--no-hash-cache", code=code)  # fmt: skip
    return dst, out


def _nothing_written(root: Path) -> None:
    assert sorted(p.name for p in root.iterdir()) == ["l1.safetensors", "src"]


def test_per_expert_vector_under_a_new_name_is_cut_bit_exact(tmp_path):
    """An unknown per-expert vector on the block (``[E]``) and an unknown ``[1, E]`` one
    in a submodule are cut to the kept experts, byte for byte."""
    src = _saved("qwen3_moe", tmp_path)
    block = "model.layers.0.mlp"

    def plant(t):
        t[f"{block}.expert_temperature"] = torch.arange(8, dtype=torch.float32)
        t[f"{block}.statics.expert_offset"] = torch.arange(8, dtype=torch.float32)[None] * 10

    _edit(src, plant)
    dst, _ = _prune(src, tmp_path, 0)
    kept = json.loads((dst / "pruning_manifest.json").read_text())["checkpoint"]["block_kept"]
    out = load_file(str(dst / "model.safetensors"))
    ids = kept[block]
    assert out[f"{block}.expert_temperature"].tolist() == [float(i) for i in ids]
    assert out[f"{block}.statics.expert_offset"].tolist() == [[10.0 * i for i in ids]]
    assert "sha256-equal to the source" in _run("verify", dst, "--source", src, "-q")


def test_ernie_statics_bias_1xE_is_cut_and_reloads(tmp_path):
    assert offline_flow("ernie4_5_moe", tmp_path) < 1e-4
    out = load_file(str(tmp_path / "dst" / "model.safetensors"))
    assert out["model.layers.1.mlp.moe_statics.e_score_correction_bias"].shape == (1, KEEP)


def test_router_weight_of_a_hidden_size_equal_to_the_expert_count_is_cut_on_rows(tmp_path):
    """hidden = MoE intermediate = E = 8: the router weight ``[E, E]`` is cut on its rows
    (its expert axis), the experts on their leading one; bit-exact, equals masked routing."""
    model, _ = build_family("qwen3_moe", seed=13, hidden_size=8, moe_intermediate_size=8)
    assert offline_flow("qwen3_moe", tmp_path, model=model) < 1e-4


def test_tensor_no_rule_cuts_is_named_and_nothing_is_written(tmp_path):
    """A per-expert matrix on the block ([E, 3]) that no rule knows how to cut."""
    src = _saved("qwen3_moe", tmp_path)
    _edit(src, lambda t: t.update({"model.layers.1.mlp.mystery": torch.ones(8, 3)}))
    _, out = _prune(src, tmp_path, 2)
    assert "would not be whole, nothing was written" in out
    assert "model.layers.1.mlp.mystery: shape [8, 3]" in out
    _nothing_written(tmp_path)


def test_router_tensor_with_experts_in_a_later_dim_is_refused(tmp_path):
    src = _saved("deepseek_v3", tmp_path)
    _edit(src, lambda t: t.update({"model.layers.0.mlp.gate.mix": torch.ones(3, 8)}))
    _, out = _prune(src, tmp_path, 2)
    assert "model.layers.0.mlp.gate.mix: shape [3, 8]" in out
    _nothing_written(tmp_path)


def test_hash_routed_checkpoint_is_refused_before_writing(tmp_path):
    """DeepSeek-V4's hash layers (``gate.tid2eid``): refused as the modifier refuses them,
    with no output, no temp or lock file left."""
    src = _saved("deepseek_v4", tmp_path, mlp_layer_types=["hash_moe", "moe"])
    _, out = _prune(src, tmp_path, 2)
    flat = " ".join(out.split())
    assert (
        "deepseek_v4 (DeepseekV4ForCausalLM): MoE layer model.layers.0.ffn is hash-routed" in flat
    )
    assert "`gate.tid2eid`" in flat and "REAP refuses hash-routed models" in flat
    _nothing_written(tmp_path)


def test_verify_names_a_tensor_left_at_the_old_count(tmp_path):
    """A pruned output whose per-expert bias kept the old count fails ``reap verify``."""
    src = _saved("lfm2_moe", tmp_path)
    dst, _ = _prune(src, tmp_path, 0)
    bad = tmp_path / "bad"
    shutil.copytree(dst, bad)
    name = "model.layers.0.feed_forward.expert_bias"
    _edit(bad, lambda t: t.update({name: torch.zeros(8)}))
    out = _run("verify", bad, "-q", code=1)
    assert f"{name}: shape [8] still has 8 experts" in out
