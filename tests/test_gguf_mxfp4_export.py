"""``reap export-gguf``: compressed-tensors MXFP4 routed experts of Qwen3-MoE and DeepSeek-V3
repacked losslessly into GGML MXFP4 by llama.cpp's converter (which refuses them stock).

Lossless is proven against the oracle of ``mxfp4_gguf_oracle`` (both formats' specs): every
expert's GGUF bytes are the source's codes and exponents moved (no re-quantization), and its
values, dequantized by the GGML spec, equal the source's by the compressed-tensors spec, bit for
bit (but the sign of zero: GGML has no -0); every other tensor and key is what the stock converter writes for a dequantized copy. A
repack with its nibbles swapped fails these checks. Needs the converter
(``scripts/llama_cpp_converter.sh``; required when ``REAP_REQUIRE_GGUF_CONVERTER=1``)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from converter_hooks import converter_site
from gguf_oracle import CONVERTER, convert, field_values, require_converter, tensor_bytes
from mxfp4_gguf_oracle import (
    BLOCK_BYTES,
    ct_values,
    dequantized_copy,
    expert_weights,
    ggml_blocks,
    ggml_values,
    same_values,
)
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from reap_modifier.cli import app
from reap_modifier.scores.plan import PruningPlan

runner = CliRunner()
MXFP4 = 39  # GGMLQuantizationType.MXFP4
PROJ = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
SIZES = {
    "qwen3_moe": dict(num_experts=16, hidden_size=64, head_dim=32),
    "deepseek_v3": dict(hidden_size=64, intermediate_size=64),
}
KEPT = {0: [1, 2, 5, 7, 8, 11, 12, 15], 1: [0, 3, 4, 6, 9, 10, 13, 14]}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """family -> a tiny MXFP4 compressed-tensors checkpoint (routed experts only) with a tokenizer."""
    require_converter()
    from conftest import make_tokenizer
    from mxfp4_fixtures import build_mxfp4_checkpoint

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("mxfp4-sources")
    for family, sizes in SIZES.items():
        build_mxfp4_checkpoint(family, root / family, **sizes)
        make_tokenizer().save_pretrained(root / family)
    out = {family: root / family for family in SIZES}
    out["deepseek_v3-mtp"] = with_mtp_layer(out["deepseek_v3"], root / "deepseek_v3-mtp")
    return out


def with_mtp_layer(src, dst):
    """``src`` (DeepSeek-V3) with its last layer copied as an MTP layer past
    ``num_hidden_layers``, which the converter skips (its MXFP4 experts too)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    last, cfg["num_nextn_predict_layers"] = cfg["num_hidden_layers"] - 1, 1
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = load_file(dst / "model.safetensors")
    head = f"model.layers.{last}."
    mtp = f"model.layers.{last + 1}."
    tensors |= {
        mtp + k.removeprefix(head): t.clone() for k, t in tensors.items() if k.startswith(head)
    }
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture
def site(tmp_path):
    """The environment that names the tiny tokenizer's pre-tokenizer in the converter."""
    return converter_site(tmp_path / "site")


def export(src, out, env, *extra):
    res = runner.invoke(
        app,
        [
            "export-gguf",
            str(src),
            "-o",
            str(out),
            "--converter",
            str(CONVERTER),
            "--model-name",
            "tiny",
            *extra,
        ],
        env=env,
    )
    return res


def expert_raw(path) -> dict[tuple[int, str], np.ndarray]:
    """``(layer, proj) -> uint8 [experts, rows, blocks * 17]`` of a GGUF's MXFP4 expert tensors."""
    out = {}
    for name, (dims, qtype, data) in tensor_bytes(path).items():
        parts = name.split(".")
        if parts[-2].endswith("_exps"):
            assert qtype == MXFP4, name
            cols, rows, n = dims
            proj = next(k for k, v in PROJ.items() if v == parts[-2])
            arr = np.frombuffer(data, np.uint8).reshape(n, rows, cols // 32 * BLOCK_BYTES)
            out[int(parts[1]), proj] = arr
    return out


def mismatches(path, source, kept=None) -> tuple[int, int]:
    """(experts whose GGUF bytes are not the oracle's repack of the source, experts whose GGUF
    values differ from the source's in any bit). ``kept``: layer -> the source ids of the
    GGUF's experts (a pruned export checked against its unpruned source)."""
    n_layers = json.loads((source / "config.json").read_text())["num_hidden_layers"]
    src = {k: v for k, v in expert_weights(source).items() if k[0] < n_layers}  # no MTP
    got = expert_raw(path)
    assert {(L, p) for L, p, _ in src} == set(got)
    bad_bytes = bad_values = 0
    for (layer, proj), raw in got.items():
        for e in range(raw.shape[0]):
            packed, scale = src[layer, proj, kept[layer][e] if kept else e]
            bad_bytes += raw[e].tobytes() != ggml_blocks(packed, scale).tobytes()
            mine = ggml_values(raw[e], packed.shape[1] * 2)
            bad_values += not same_values(mine, ct_values(packed, scale))
    return bad_bytes, bad_values


def test_the_oracles_agree_with_compressed_tensors_and_gguf_py(sources, tmp_path, site):
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    (packed, scale) = expert_weights(sources["qwen3_moe"])[0, "down_proj", 3]
    rows, cols = packed.shape[0], packed.shape[1] * 2
    theirs = unpack_fp4_from_uint8(torch.from_numpy(packed), rows, cols, dtype=torch.float32)
    theirs = theirs * decompress_mx_scale(torch.from_numpy(scale)).float().repeat_interleave(32, 1)
    assert np.array_equal(ct_values(packed, scale), theirs.numpy())
    raw = ggml_blocks(packed, scale)
    assert np.array_equal(
        ggml_values(raw, cols), dequantize(raw, GGMLQuantizationType.MXFP4).reshape(rows, cols)
    )


@pytest.mark.parametrize("family", [*sorted(SIZES), "deepseek_v3-mtp"])
def test_mxfp4_experts_export_losslessly(sources, tmp_path, site, family):
    src = sources[family]
    out = tmp_path / "m.gguf"
    res = export(src, out, site, "--outtype", "f32")
    assert res.exit_code == 0, res.output
    assert res.stdout.strip().endswith(str(out))
    assert mismatches(out, src) == (0, 0)
    # the float path of the stock converter on a dequantized copy: the same expert values at the
    # same place, every other tensor and key byte for byte (but the file type); the expert
    # tensors come first (written before the others, as the converter's K3 path does)
    ref = convert(dequantized_copy(src, tmp_path / "deq"), tmp_path / "ref.gguf", "f32")
    ours, theirs = tensor_bytes(out), tensor_bytes(ref)
    n_exps = sum(qtype == MXFP4 for _, qtype, _ in ours.values())
    assert n_exps == 3 * len({k[0] for k in expert_raw(out)})
    assert list(ours)[n_exps:] == [k for k in theirs if not k.split(".")[-2].endswith("_exps")]
    assert sorted(ours) == sorted(theirs)
    for name, (dims, qtype, data) in ours.items():
        if qtype == MXFP4:
            want = np.frombuffer(theirs[name][2], np.float32)
            raw = np.frombuffer(data, np.uint8).reshape(-1, dims[0] // 32 * BLOCK_BYTES)
            assert theirs[name][:2] == (dims, 0), name
            assert same_values(ggml_values(raw, dims[0]).reshape(-1), want), name
        else:
            assert (dims, qtype, data) == theirs[name], name
    keys, ref_keys = field_values(out), field_values(ref)
    assert (keys.pop("general.file_type"), ref_keys.pop("general.file_type")) == (38, 0)
    assert keys == ref_keys
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".gguf") == [
        "m.gguf",
        "ref.gguf",
    ]


def test_a_swapped_nibble_order_is_caught(sources, tmp_path, site):
    src = sources["qwen3_moe"]
    out = tmp_path / "broken.gguf"
    res = export(src, out, {**site, "REAP_TEST_BREAK_REPACK": "1"})
    assert res.exit_code == 0, res.output
    n = 2 * 3 * 16
    bad_bytes, bad_values = mismatches(out, src)
    assert bad_bytes == n and bad_values > n // 2  # an expert of all-equal nibbles can survive


def test_a_pruned_checkpoint_exports_losslessly(sources, tmp_path, site):
    src = sources["qwen3_moe"]
    plan = PruningPlan(
        kept={f"model.layers.{L}.mlp": ids for L, ids in KEPT.items()}, num_experts=16
    )
    pruned = tmp_path / "pruned"
    res = runner.invoke(
        app,
        [
            "prune",
            str(src),
            "--plan",
            str(plan.save(tmp_path / "plan.json")),
            "-o",
            str(pruned),
            "-q",
        ],
    )
    assert res.exit_code == 0, res.output
    out = tmp_path / "pruned.gguf"
    res = export(pruned, out, site, "--outtype", "bf16")
    assert res.exit_code == 0, res.output
    assert mismatches(out, pruned) == (0, 0)
    assert mismatches(out, src, kept=KEPT) == (0, 0)
    assert field_values(out)["qwen3moe.expert_count"] == 8


def test_a_plain_checkpoint_is_the_stock_conversion(tmp_path, site):
    require_converter()
    from conftest import make_tokenizer
    from tiny_models import build_tiny

    torch.set_num_threads(1)
    model, _ = build_tiny("qwen3_moe", num_experts=8, hidden_size=64, moe_intermediate_size=32)
    model.save_pretrained(tmp_path / "plain")
    make_tokenizer().save_pretrained(tmp_path / "plain")
    res = export(tmp_path / "plain", tmp_path / "ours.gguf", site, "--outtype", "q8_0")
    assert res.exit_code == 0, res.output
    ref = convert(tmp_path / "plain", tmp_path / "ref.gguf", "q8_0")
    assert (tmp_path / "ours.gguf").read_bytes() == ref.read_bytes()


def _one_expert_unquantized(src, dst):
    shutil.copytree(src, dst)
    for shard in dst.glob("*.safetensors"):
        tensors = load_file(shard)
        name = "model.layers.1.mlp.experts.5.down_proj.weight"
        if name + "_packed" in tensors:
            packed, scale = tensors.pop(name + "_packed"), tensors.pop(name + "_scale")
            tensors[name] = torch.from_numpy(ct_values(packed.numpy(), scale.numpy())).bfloat16()
            save_file(tensors, shard, metadata={"format": "pt"})
    index = dst / "model.safetensors.index.json"
    if index.exists():
        idx = json.loads(index.read_text())
        wm = idx["weight_map"]
        wm[name] = wm.pop(name + "_packed")
        wm.pop(name + "_scale")
        index.write_text(json.dumps(idx))


def _other_family(src, dst):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["Qwen2MoeForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "edit,message",
    [
        (_one_expert_unquantized, "15 of 16 experts are MXFP4"),
        (_other_family, "MXFP4 experts of Qwen2MoeForCausalLM have no repack here"),
    ],
    ids=["one-expert-unquantized", "other-family"],
)
def test_refused_by_the_converter_with_nothing_written(sources, tmp_path, site, edit, message):
    edit(sources["qwen3_moe"], tmp_path / "src")
    out = tmp_path / "o" / "m.gguf"
    out.parent.mkdir()
    res = export(tmp_path / "src", out, site)
    assert res.exit_code == 2, res.output
    assert "llama.cpp's converter failed" in res.output and message in " ".join(res.output.split())
    assert list(out.parent.iterdir()) == []


@pytest.mark.parametrize(
    "case,message",
    [
        ("no-config", "is no checkpoint directory (no config.json)"),
        ("not-gguf", "name the output file .gguf"),
        ("exists", "exists: pass --force"),
        ("no-converter", "has no convert_hf_to_gguf.py"),
    ],
)
def test_bad_input_exits_2_before_converting(tmp_path, case, message):
    model, conv = tmp_path / "model", tmp_path / "conv"
    model.mkdir()
    conv.mkdir()
    if case != "no-config":
        (model / "config.json").write_text("{}")
    if case != "no-converter":  # never run: each case is refused before
        (conv / "convert_hf_to_gguf.py").write_text("raise SystemExit(1)\n")
    out = tmp_path / ("m.bin" if case == "not-gguf" else "m.gguf")
    if case == "exists":
        out.write_bytes(b"keep")
    res = runner.invoke(app, ["export-gguf", str(model), "-o", str(out), "--converter", str(conv)])
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split())
    written = ["conv", *(["m.gguf"] if case == "exists" else []), "model"]
    assert sorted(p.name for p in tmp_path.iterdir()) == written
    if case == "exists":
        assert out.read_bytes() == b"keep"
