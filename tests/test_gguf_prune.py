"""``reap prune`` on GGUF files: byte-identical to converting the pruned safetensors with
llama.cpp's own converter (f32, bf16, q8_0; split files), kept slabs verbatim for any
quantization (k-quants, MXFP4: synthetic files), imatrix slicing, and one refusal per bad
input with nothing written.

The converter tests need ``scripts/llama_cpp_converter.sh`` (``scripts/test.sh`` runs it and
sets ``REAP_REQUIRE_GGUF_CONVERTER=1``, so they fail rather than skip in CI)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from gguf_oracle import (
    convert,
    field_values,
    prune_safetensors,
    require_converter,
    tensor_bytes,
)
from gguf_synth import write_imatrix, write_moe

from reap_modifier.checkpoint import CheckpointError
from reap_modifier.gguf import GGUFError, prepare_gguf_rewrite
from reap_modifier.gguf.verify import verify_gguf
from reap_modifier.scores.plan import PruningPlan

KEPT = {
    "qwen3_moe": {0: [1, 2, 5, 7, 8, 11, 12, 15], 1: [0, 3, 4, 6, 9, 10, 13, 14]},
    # groups of 4 experts (n_group=4): two kept in each
    "deepseek_v3": {1: [0, 2, 5, 6, 8, 11, 13, 15], 2: [1, 3, 4, 7, 9, 10, 14, 15]},
}
SIZES = {
    "qwen3_moe": dict(num_experts=16, hidden_size=64, moe_intermediate_size=32, head_dim=32),
    "deepseek_v3": dict(hidden_size=64, moe_intermediate_size=32, intermediate_size=64),
}


def plan_for(kept: dict[int, list[int]], n: int) -> PruningPlan:
    return PruningPlan(
        kept={f"model.layers.{L}.mlp": ids for L, ids in kept.items()}, num_experts=n
    )


@pytest.fixture(scope="module")
def converter():
    require_converter()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, converter):
    """family -> (unpruned dir, pruned dir): tiny models saved, the oracle's pruned copy."""
    from conftest import make_tokenizer
    from tiny_models import build_tiny

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("gguf-models")
    out = {}
    for family, sizes in SIZES.items():
        model, _ = build_tiny(family, **sizes)
        src = root / family
        model.save_pretrained(src)
        make_tokenizer().save_pretrained(src)
        pruned = root / f"{family}-pruned"
        prune_safetensors(src, pruned, KEPT[family])
        out[family] = (src, pruned)
    return out


@pytest.mark.parametrize(
    "family,outtype",
    [
        ("qwen3_moe", "f32"),
        ("qwen3_moe", "bf16"),
        ("qwen3_moe", "q8_0"),
        ("deepseek_v3", "f32"),
        ("deepseek_v3", "q8_0"),
    ],
)
def test_byte_identical_to_converting_the_pruned_safetensors(saved, tmp_path, family, outtype):
    src_dir, pruned_dir = saved[family]
    src = convert(src_dir, tmp_path / "src.gguf", outtype)
    expected = convert(pruned_dir, tmp_path / "expected.gguf", outtype)
    n = 16
    ours = tmp_path / "ours.gguf"
    prepare_gguf_rewrite(
        src, plan_for(KEPT[family], n), ours, provenance=False, progress=False
    ).run()
    assert ours.read_bytes() == expected.read_bytes()
    # with the provenance keys: the same tensors and keys, plus the reap.* keys
    with_keys = tmp_path / "with-keys.gguf"
    prepare_gguf_rewrite(src, plan_for(KEPT[family], n), with_keys, progress=False).run()
    assert tensor_bytes(with_keys) == tensor_bytes(expected)
    got, want = field_values(with_keys), field_values(expected)
    assert {k: v for k, v in got.items() if not k.startswith("reap.")} == want
    assert got["reap.source_expert_count"] == n
    assert {k: v for k, v in got.items() if k.startswith("reap.kept_experts.")} == {
        f"reap.kept_experts.{L}": ids for L, ids in KEPT[family].items()
    }


def test_split_files_byte_identical(saved, tmp_path):
    src_dir, pruned_dir = saved["qwen3_moe"]
    (tmp_path / "src").mkdir()
    (tmp_path / "expected").mkdir()
    convert(src_dir, tmp_path / "src/m.gguf", "q8_0", "--split-max-tensors", "10")
    convert(pruned_dir, tmp_path / "expected/m.gguf", "q8_0", "--split-max-tensors", "10")
    parts = sorted(p.name for p in (tmp_path / "expected").iterdir())
    assert parts == ["m-00001-of-00003.gguf", "m-00002-of-00003.gguf", "m-00003-of-00003.gguf"]
    first = tmp_path / "src" / parts[0]
    with pytest.raises(GGUFError, match="give --out a directory"):
        prepare_gguf_rewrite(first, plan_for(KEPT["qwen3_moe"], 16), tmp_path / "o.gguf")
    with pytest.raises(GGUFError, match="give its first part"):
        prepare_gguf_rewrite(
            tmp_path / "src" / parts[1], plan_for(KEPT["qwen3_moe"], 16), tmp_path / "o"
        )
    out = tmp_path / "out"
    prepare_gguf_rewrite(
        first, plan_for(KEPT["qwen3_moe"], 16), out, provenance=False, progress=False
    ).run()
    assert sorted(p.name for p in out.iterdir()) == parts
    for name in parts:
        assert (out / name).read_bytes() == (tmp_path / "expected" / name).read_bytes(), name
    # with provenance (first part only), verified part by part against the source
    out2 = tmp_path / "out2"
    prepare_gguf_rewrite(first, plan_for(KEPT["qwen3_moe"], 16), out2, progress=False).run()
    assert "reap.source_expert_count" in field_values(out2 / parts[0])
    assert not any(k.startswith("reap.") for k in field_values(out2 / parts[1]))
    report = verify_gguf(out2, source=first)
    assert report.ok, report.summary()
    assert report.info["tensors_matching_source"] == sum(len(tensor_bytes(out / p)) for p in parts)


# ---------------------------------------------------------------------------
# synthetic files: any quantization, refusals, imatrix


def _slabs(path, name, kept) -> bytes:
    """The oracle: the source tensor's outermost slabs ``kept``, concatenated."""
    dims, _, data = tensor_bytes(path)[name]
    slab = len(data) // dims[-1]
    return b"".join(data[e * slab : (e + 1) * slab] for e in kept)


@pytest.mark.parametrize("expert_type", ["Q4_K", "Q2_K", "IQ4_XS", "MXFP4", "Q8_0", "BF16"])
def test_kept_slabs_verbatim_for_any_quantization(tmp_path, expert_type):
    src = write_moe(tmp_path / "src.gguf", expert_type=expert_type)
    kept = {0: [0, 3, 5, 6], 1: [1, 2, 4, 7]}
    out = tmp_path / "out.gguf"
    prepare_gguf_rewrite(src, plan_for(kept, 8), out, progress=False).run()
    got, before = tensor_bytes(out), tensor_bytes(src)
    assert got.keys() == before.keys()
    for name, (dims, qtype, data) in got.items():
        m = re.match(r"blk\.(\d+)\.(ffn_\w+_exps|ffn_gate_inp|exp_probs_b)\.", name)
        if m:
            assert dims == (*before[name][0][:-1], 4), name
            assert data == _slabs(src, name, kept[int(m[1])]), name
        else:
            assert (dims, qtype, data) == before[name], name
    values = field_values(out)
    assert values["deepseek2.expert_count"] == 4
    assert values["general.size_label"] == "custom"  # not derived by the converter: kept


def test_imatrix_sliced_like_the_model(tmp_path):
    src = write_moe(tmp_path / "src.gguf")
    imx = write_imatrix(tmp_path / "imatrix.gguf")
    kept = {0: [0, 3, 5, 6], 1: [1, 2, 4, 7]}
    out, imx_out = tmp_path / "out.gguf", tmp_path / "out.imatrix.gguf"
    prepare_gguf_rewrite(
        src, plan_for(kept, 8), out, imatrix=imx, imatrix_out=imx_out, progress=False
    ).run()
    got, before = tensor_bytes(imx_out), tensor_bytes(imx)
    assert got.keys() == before.keys()
    for name, (dims, qtype, data) in got.items():
        m = re.match(r"blk\.(\d+)\.ffn_\w+_exps\.weight\.", name)
        if m:
            rows = np.frombuffer(before[name][2], np.float32).reshape(8, -1)
            want = rows[kept[int(m[1])]]
            assert dims == (rows.shape[1], 4)
            assert data == want.tobytes(), name
        else:
            assert (dims, qtype, data) == before[name], name
    assert field_values(imx_out) == field_values(imx)


REFUSALS = [
    ("keep-below-used", dict(used=4), {0: [0, 1, 2], 1: [0, 1, 2]}, "keep at least 4"),
    (
        "groups-keep",
        dict(groups=(4, 2)),
        {0: [0, 1, 2, 4, 6, 7], 1: [0, 1, 2, 4, 6, 7]},
        "keep a multiple of 4",
    ),
    (
        "groups-uneven",
        dict(groups=(4, 2)),
        {0: [0, 1, 2, 3], 1: [0, 2, 4, 6]},
        "same count in every group",
    ),
    (
        "groups-too-few",
        dict(groups=(4, 1), used=4),
        {0: [0, 2, 4, 6], 1: [0, 2, 4, 6]},
        "fewer than the 4 experts",
    ),
    (
        "router-shape",
        dict(n_expert=16),
        {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]},
        "plan is for 8 experts",
    ),
    (
        "not-a-moe-layer",
        dict(),
        {0: [0, 1, 2, 3], 5: [0, 1, 2, 3]},
        "layer 5, which is not a MoE layer",
    ),
    ("hash-routed", dict(hash_routed=True), {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}, "hash-routed"),
    (
        "mtp-without-rule",
        dict(layers=3, nextn=1),
        {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]},
        "next-token layer",
    ),
    ("layer-not-in-plan", dict(), {0: [0, 1, 2, 3]}, r"--extra-layers like-last"),
]


@pytest.mark.parametrize("case,build,kept,message", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_write_nothing(tmp_path, case, build, kept, message):
    src = write_moe(tmp_path / "src.gguf", **build)
    out = tmp_path / "out.gguf"
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(GGUFError, match=message):
        prepare_gguf_rewrite(src, plan_for(kept, 8), out, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_mtp_layer_cut_like_the_last(tmp_path):
    src = write_moe(tmp_path / "src.gguf", layers=3, nextn=1)
    kept = {0: [0, 1, 2, 3], 1: [1, 3, 5, 7]}
    out = tmp_path / "out.gguf"
    prepare_gguf_rewrite(
        src, plan_for(kept, 8), out, extra_layers="like-last", progress=False
    ).run()
    assert tensor_bytes(out)["blk.2.ffn_up_exps.weight"][2] == _slabs(
        src, "blk.2.ffn_up_exps.weight", kept[1]
    )
    assert field_values(out)["reap.kept_experts.2"] == kept[1]


def test_existing_output_refused_then_replaced_with_force(tmp_path):
    src = write_moe(tmp_path / "src.gguf")
    out = tmp_path / "out.gguf"
    out.write_bytes(b"previous")
    plan = plan_for({0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}, 8)
    with pytest.raises(CheckpointError, match="--force"):
        prepare_gguf_rewrite(src, plan, out, progress=False)
    assert out.read_bytes() == b"previous"
    with pytest.raises(CheckpointError, match="source"):
        prepare_gguf_rewrite(src, plan, src, force=True, progress=False)
    prepare_gguf_rewrite(src, plan, out, force=True, progress=False).run()
    assert field_values(out)["deepseek2.expert_count"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.gguf", "src.gguf"]
