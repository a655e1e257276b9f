"""Calibration-free baselines against hand-computed rankings on a tiny checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from reap_modifier.scores import ExpertScores, ScoresError
from reap_modifier.scores.baselines import (
    baseline_saliency,
    baseline_scores,
    layer_number,
    read_router_weights,
    router_fingerprint,
    scores_from_weights,
)
from reap_modifier.scores.plan import plan_from_scores

# Router rows chosen so that L1 and signed sum rank differently:
#   expert:       0            1             2            3
R1 = [[1.0, -2.0, 0.5], [0.25, 0.25, 0.25], [-3.0, -1.0, 0.5], [2.0, 1.0, 0.0]]
# L1:          3.5           0.75           4.5          3.0   -> order 2, 0, 3, 1
# signed sum: -0.5           0.75          -3.5          3.0   -> order 3, 1, 0, 2
R2 = [[0.5, 0.5, 0.5], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.25], [-0.5, -0.5, 2.0]]
# L1:          1.5           1.0            0.25         3.0   -> order 3, 0, 1, 2
# signed sum:  1.5          -1.0            0.25         1.0   -> order 0, 3, 2, 1


def _write_checkpoint(
    folder, dtype=torch.bfloat16, prefix="model", block="mlp", sharded=False, config=None
):
    folder.mkdir(parents=True, exist_ok=True)
    hidden = 3
    t = {
        f"{prefix}.embed_tokens.weight": torch.randn(11, hidden),
        f"{prefix}.layers.0.mlp.gate_proj.weight": torch.randn(4, hidden),  # dense layer decoy
        f"{prefix}.layers.1.{block}.gate.weight": torch.tensor(R1),
        f"{prefix}.layers.1.{block}.gate.e_score_correction_bias": torch.tensor(
            [9.0, 9.0, 9.0, 9.0]
        ),
        f"{prefix}.layers.1.{block}.shared_expert_gate.weight": torch.randn(1, hidden),
        f"{prefix}.layers.1.{block}.experts.0.w1.weight": torch.randn(2, hidden),
        f"{prefix}.layers.2.{block}.gate.weight": torch.tensor(R2),
        f"{prefix}.layers.2.{block}.experts.0.w1.weight": torch.randn(2, hidden),
    }
    t = {k: v.to(dtype) for k, v in t.items()}
    if sharded:
        names = sorted(t)
        shard1 = {k: t[k] for k in names if "layers.1." in k}
        shard2 = {k: t[k] for k in names if k not in shard1}
        save_file(shard1, str(folder / "model-00001-of-00002.safetensors"))
        save_file(shard2, str(folder / "model-00002-of-00002.safetensors"))
        weight_map = {k: "model-00001-of-00002.safetensors" for k in shard1}
        weight_map.update({k: "model-00002-of-00002.safetensors" for k in shard2})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        save_file(t, str(folder / "model.safetensors"))
    cfg = config or {
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_experts": 4,
        "num_experts_per_tok": 2,
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_hand_computed_rankings(tmp_path):
    ckpt = _write_checkpoint(tmp_path / "ckpt")
    l1 = scores_from_weights(ckpt, "router_l1")
    assert list(l1.layers) == ["model.layers.1.mlp", "model.layers.2.mlp"]
    assert l1.saliency("router_l1")["model.layers.1.mlp"].tolist() == [3.5, 0.75, 4.5, 3.0]
    assert l1.saliency("router_l1")["model.layers.2.mlp"].tolist() == [1.5, 1.0, 0.25, 3.0]
    signed = scores_from_weights(ckpt, "router_signed_sum")
    assert signed.saliency("router_signed_sum")["model.layers.1.mlp"].tolist() == [
        -0.5,
        0.75,
        -3.5,
        3.0,
    ]
    assert signed.saliency(None)["model.layers.2.mlp"].tolist() == [1.5, -1.0, 0.25, 1.0]
    assert l1.metadata["top_k"] == 2 and l1.metadata["model_class"] == "Qwen3MoeForCausalLM"
    assert l1.metadata["kind"] == "weights" and l1.metadata["num_moe_layers"] == 2
    # the cut: keep 2 of 4
    assert plan_from_scores(l1, num_experts_to_keep=2).kept == {
        "model.layers.1.mlp": [0, 2],
        "model.layers.2.mlp": [0, 3],
    }
    assert plan_from_scores(signed, sparsity=0.5).kept == {
        "model.layers.1.mlp": [1, 3],
        "model.layers.2.mlp": [0, 3],
    }
    assert plan_from_scores(l1, num_experts_to_keep=3).kept == {
        "model.layers.1.mlp": [0, 2, 3],
        "model.layers.2.mlp": [0, 1, 3],
    }
    # weights files round-trip and refuse calibration criteria
    path = l1.save(tmp_path / "l1.scores")
    back = ExpertScores.load(path)
    assert back.method == "router_l1" and back.default_saliency == "router_l1"
    with pytest.raises(ScoresError, match="no 'reap' saliency"):
        plan_from_scores(back, num_experts_to_keep=2, saliency="reap")


def test_router_l1_matches_compressed_tensors_magnitude_pruner(tmp_path):
    mep = pytest.importorskip(
        "compressed_tensors.entrypoints.convert.converters.magnitude_expert_pruner"
    )
    from compressed_tensors.utils.safetensors_load import get_checkpoint_files, get_weight_map

    ckpt = _write_checkpoint(tmp_path / "ckpt", dtype=torch.float32, sharded=True)
    files = get_checkpoint_files(str(ckpt))
    weight_map = get_weight_map(files)
    routers = [n for n in weight_map if n.endswith("mlp.gate.weight")]
    theirs = mep._compute_retained_experts(routers, weight_map, files, 0.5)
    ours = plan_from_scores(scores_from_weights(ckpt, "router_l1"), sparsity=0.5)
    assert {k[: -len(".gate.weight")]: v for k, v in theirs.items()} == ours.kept
    # and their score is exactly ours
    w = read_router_weights(ckpt)
    for layer, weight in w.items():
        torch.testing.assert_close(
            baseline_saliency("router_l1", {layer: weight})[layer],
            weight.abs().sum(dim=-1).double(),
        )


def test_sharded_kimi_names_and_in_memory_agreement(tmp_path):
    cfg = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": {
            "num_experts": 4,
            "num_experts_per_token": 2,
            "num_expert_group": 1,
            "topk_group": 1,
        },
    }
    ckpt = _write_checkpoint(
        tmp_path / "k3",
        prefix="language_model.model",
        block="block_sparse_moe",
        sharded=True,
        config=cfg,
    )
    s = scores_from_weights(ckpt, "router_l1")
    assert list(s.layers) == [
        "language_model.model.layers.1.block_sparse_moe",
        "language_model.model.layers.2.block_sparse_moe",
    ]
    assert s.metadata["top_k"] == 2 and s.metadata["n_group"] == 1
    assert s.metadata["model_class"] == "KimiK3ForConditionalGeneration"
    # the modifier's in-memory path (module path -> router weight) gives the same numbers
    mem = {
        "language_model.model.layers.1.block_sparse_moe": torch.tensor(R1).bfloat16(),
        "language_model.model.layers.2.block_sparse_moe": torch.tensor(R2).bfloat16(),
    }
    for method in ("router_l1", "router_signed_sum", "random"):
        from_file = scores_from_weights(ckpt, method, seed=7).saliency(method)
        in_mem = baseline_saliency(method, mem, seed=7)
        for layer in mem:
            assert torch.equal(from_file[layer], in_mem[layer]), (method, layer)
    assert s.metadata["router_fingerprint"] == router_fingerprint(mem)
    # the modifier's model_fingerprint recipe: sha256 of layer 1's router as float32 bytes
    import hashlib

    expected = hashlib.sha256(torch.tensor(R1).bfloat16().float().numpy().tobytes()).hexdigest()
    assert s.metadata["model_fingerprint"] == expected


def test_random_is_seeded_per_layer_number():
    w = {"model.layers.1.mlp": torch.zeros(8, 3), "model.layers.2.mlp": torch.zeros(8, 3)}
    a = baseline_saliency("random", w, seed=0)
    assert torch.equal(
        a["model.layers.1.mlp"], baseline_saliency("random", w, seed=0)["model.layers.1.mlp"]
    )
    assert not torch.equal(a["model.layers.1.mlp"], a["model.layers.2.mlp"])
    assert not torch.equal(
        a["model.layers.1.mlp"], baseline_saliency("random", w, seed=1)["model.layers.1.mlp"]
    )
    assert ((a["model.layers.1.mlp"] >= 0) & (a["model.layers.1.mlp"] < 1)).all()
    # same layer number under another module prefix: the same draw
    other = baseline_saliency(
        "random", {"language_model.model.layers.1.block_sparse_moe": torch.zeros(8, 3)}
    )
    assert torch.equal(
        other["language_model.model.layers.1.block_sparse_moe"], a["model.layers.1.mlp"]
    )
    gen = torch.Generator().manual_seed(0 * 1_000_003 + 1)
    assert torch.equal(a["model.layers.1.mlp"], torch.rand(8, generator=gen, dtype=torch.float64))
    assert layer_number("model.layers.12.mlp") == 12
    # no ``layers.<n>``: CRC32 of the path (binascii.crc32(b"mtp.block"), pinned)
    assert layer_number("mtp.block") == 4157094245
    assert layer_number("model.layers.3.mlp.layers.7.moe") == 7  # the last one


def test_fingerprint_is_dtype_and_prefix_independent():
    a = {
        "model.layers.1.mlp": torch.tensor(R1).bfloat16(),
        "model.layers.2.mlp": torch.tensor(R2).bfloat16(),
    }
    b = {"x.layers.2.moe": torch.tensor(R2), "x.layers.1.moe": torch.tensor(R1)}
    assert router_fingerprint(a) == router_fingerprint(b)
    c = dict(b)
    c["x.layers.2.moe"] = torch.tensor(R2) * 2
    assert router_fingerprint(c) != router_fingerprint(b)


def test_baseline_errors(tmp_path):
    with pytest.raises(ScoresError, match="unknown baseline 'router_l2'"):
        baseline_saliency("router_l2", {"a": torch.ones(2, 2)})
    with pytest.raises(ScoresError, match="dtype torch.int8"):
        baseline_saliency("router_l1", {"a": torch.ones(2, 2, dtype=torch.int8)})
    with pytest.raises(ScoresError, match="expected \\[num_experts, hidden\\]"):
        baseline_saliency("router_l1", {"a": torch.ones(2)})
    bad = torch.ones(2, 2)
    bad[0, 0] = float("nan")
    with pytest.raises(ScoresError, match="NaN/inf"):
        baseline_saliency("router_signed_sum", {"a": bad})
    with pytest.raises(ScoresError, match="disagree on the expert count"):
        baseline_scores(
            "router_l1", {"a.layers.0.m": torch.ones(2, 2), "a.layers.1.m": torch.ones(3, 2)}
        )
    with pytest.raises(ScoresError, match="does not exist"):
        scores_from_weights(tmp_path / "nope", "router_l1")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ScoresError, match="holds no .safetensors files"):
        scores_from_weights(tmp_path / "empty", "router_l1")
    dense = tmp_path / "dense"
    dense.mkdir()
    save_file(
        {"model.layers.0.mlp.gate_proj.weight": torch.ones(4, 3)}, str(dense / "model.safetensors")
    )
    with pytest.raises(ScoresError, match="no router tensors"):
        scores_from_weights(dense, "router_l1")
    ckpt = _write_checkpoint(tmp_path / "sharded", sharded=True)
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ScoresError, match="shards listed in the index are missing"):
        scores_from_weights(ckpt, "router_l1")
    ckpt = _write_checkpoint(tmp_path / "trunc")
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[:40])
    with pytest.raises(ScoresError, match="cannot read safetensors shard"):
        scores_from_weights(ckpt, "router_l1")


def test_without_config_uses_most_common_row_count(tmp_path):
    ckpt = _write_checkpoint(tmp_path / "ckpt")
    (ckpt / "config.json").unlink()
    s = scores_from_weights(ckpt, "router_l1")
    assert list(s.layers) == ["model.layers.1.mlp", "model.layers.2.mlp"]
    assert "top_k" not in s.metadata
    # a cut still works (top_k unknown: checked against 1, with a warning)
    assert plan_from_scores(s, num_experts_to_keep=1).num_kept == 1
