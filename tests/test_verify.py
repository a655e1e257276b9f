"""``reap verify`` / ``verify_checkpoint``: passes on a pruned checkpoint, fails with a
precise message on each corruption (missing expert, wrong count, flipped byte, ...)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from mxfp4_fixtures import build_mxfp4_checkpoint, rewrite_shard_without, tree_sha256  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from reap_modifier.checkpoint import read_safetensors_header, rewrite_checkpoint  # noqa: E402
from reap_modifier.checkpoint.manifest import MANIFEST_NAME  # noqa: E402
from reap_modifier.checkpoint.verify import VerifyError, verify_checkpoint  # noqa: E402
from reap_modifier.cli import app  # noqa: E402
from reap_modifier.scores.plan import PruningPlan  # noqa: E402

runner = CliRunner()


@pytest.fixture(autouse=True)
def _private_hash_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(
        "REAP_SHA256_CACHE", str(tmp_path.parent / f"{tmp_path.name}-sha256-cache.json")
    )


BLOCK = "language_model.model.layers.2.block_sparse_moe"
KEPT = [0, 2, 3, 5, 8, 11, 12, 14]


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    """A Kimi K3 MXFP4 source (several shards) and its pruned output (kept pristine)."""
    root = tmp_path_factory.mktemp("verify")
    fx = build_mxfp4_checkpoint("kimi_k3", root / "src", max_shard_size="60KB")
    plan = PruningPlan(kept={b: KEPT for b in fx.moe_blocks}, num_experts=16)
    dst = rewrite_checkpoint(fx.path, plan, root / "dst", progress=False, hash_cache=False)
    return {
        "src": fx.path,
        "dst": dst,
        "src_hash": tree_sha256(fx.path),
        "dst_hash": tree_sha256(dst),
    }


@pytest.fixture
def copy(pruned, tmp_path):
    """A scratch copy of the pruned output to corrupt."""
    d = tmp_path / "dst"
    shutil.copytree(pruned["dst"], d)
    return d


def _shard_of(d: Path, name: str) -> str:
    return json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][name]


def _fails(d, source=None, *, match: str):
    report = verify_checkpoint(d, source=source)
    assert not report.ok
    assert any(match in f for f in report.failures), report.summary()
    with pytest.raises(VerifyError):
        report.raise_if_failed()
    res = runner.invoke(
        app, ["verify", str(d), "-q"] + (["--source", str(source)] if source else [])
    )
    assert res.exit_code == 1, res.output
    assert match in res.output
    return report


def test_verify_passes(pruned):
    r = verify_checkpoint(pruned["dst"])
    assert r.ok, r.summary()
    assert r.info["num_experts"] == 8 and r.info["moe_layers"] == 2
    assert r.info["quantization_format"] == ["mxfp4-pack-quantized"]
    r = verify_checkpoint(pruned["dst"], source=pruned["src"]).raise_if_failed()
    assert (
        r.info["checked_against_source"] and r.info["tensors_matching_source"] == r.info["tensors"]
    )
    res = runner.invoke(app, ["verify", str(pruned["dst"]), "--source", str(pruned["src"]), "-q"])
    assert res.exit_code == 0 and "OK" in res.output, res.output
    assert tree_sha256(pruned["src"]) == pruned["src_hash"]
    assert tree_sha256(pruned["dst"]) == pruned["dst_hash"]


def test_missing_expert(copy, pruned):
    names = [
        f"{BLOCK}.experts.3.{p}.{k}"
        for p in ("w1", "w2", "w3")
        for k in ("weight_packed", "weight_scale")
    ]
    rewrite_shard_without(copy, names)
    _fails(copy, match=f"{BLOCK}: expert(s) 3 missing (expected 0..7)")
    _fails(
        copy,
        pruned["src"],
        match=f"{BLOCK}.experts.3.w1.weight_packed (from source {BLOCK}.experts.5.w1.weight_packed) is missing",
    )


def test_missing_projection_of_one_expert(copy):
    rewrite_shard_without(
        copy, [f"{BLOCK}.experts.6.w2.weight_packed", f"{BLOCK}.experts.6.w2.weight_scale"]
    )
    _fails(copy, match=f"{BLOCK}.experts.6: lacks ['w2']")


def test_wrong_count(copy):
    cfg = json.loads((copy / "config.json").read_text())
    cfg["text_config"]["num_experts"] = 9
    (copy / "config.json").write_text(json.dumps(cfg))
    r = _fails(copy, match=f"{BLOCK}: expert(s) 8 missing (expected 0..8)")
    assert any("num_experts_after=8 but config.json says 9" in f for f in r.failures)
    assert any("gate.weight: shape [8, 32], expected first dim 9" in f for f in r.failures)


def test_flipped_byte(copy, pruned):
    name = f"{BLOCK}.experts.4.w3.weight_packed"
    shard = _shard_of(copy, name)
    entry = read_safetensors_header(copy / shard).entries[name]
    with open(copy / shard, "r+b") as fh:
        fh.seek(entry.begin + 7)
        b = fh.read(1)
        fh.seek(entry.begin + 7)
        fh.write(bytes([b[0] ^ 0x01]))
    # without the source: the manifest's shard checksum catches it
    _fails(copy, match=f"{shard}: xxh3_128")
    # with the source: the tensor is named, with the source tensor it came from
    _fails(copy, pruned["src"], match=f"{name}: sha256")
    r = verify_checkpoint(copy, pruned["src"])
    assert any(
        f"differs from source {BLOCK}.experts.{KEPT[4]}.w3.weight_packed" in f for f in r.failures
    )


def test_orphan_expert(copy):
    # an extra expert index beyond the count, added to shard + index
    from safetensors import safe_open
    from safetensors.torch import save_file

    name = f"{BLOCK}.experts.0.w1.weight_packed"
    shard = _shard_of(copy, name)
    with safe_open(str(copy / shard), framework="pt") as st:
        meta = st.metadata()
        tensors = {k: st.get_tensor(k) for k in st.keys()}
    tensors[f"{BLOCK}.experts.8.w1.weight_packed"] = tensors[name].clone()
    save_file(tensors, str(copy / shard), metadata=meta)
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    index["weight_map"][f"{BLOCK}.experts.8.w1.weight_packed"] = shard
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    _fails(copy, match=f"{BLOCK}: orphan expert index(es) 8 (count is 8)")


def test_router_rows_wrong(copy):
    from safetensors import safe_open
    from safetensors.torch import save_file

    name = f"{BLOCK}.gate.e_score_correction_bias"
    shard = _shard_of(copy, name)
    with safe_open(str(copy / shard), framework="pt") as st:
        meta = st.metadata()
        tensors = {k: st.get_tensor(k) for k in st.keys()}
    tensors[name] = tensors[name][:7].clone()
    save_file(tensors, str(copy / shard), metadata=meta)
    _fails(copy, match=f"{name}: shape [7], expected first dim 8")


def test_truncated_shard_and_unindexed_file(copy):
    name = f"{BLOCK}.experts.1.w1.weight_packed"
    shard = _shard_of(copy, name)
    data = (copy / shard).read_bytes()
    (copy / shard).write_bytes(data[:-3])
    _fails(copy, match="truncated or trailing garbage")
    (copy / shard).write_bytes(data)
    (copy / "stray.safetensors").write_bytes(data)
    _fails(copy, match="stray.safetensors is not referenced by the index")


def test_manifest_consistency(copy, pruned):
    m = json.loads((copy / MANIFEST_NAME).read_text())
    m["checkpoint"]["block_kept"][BLOCK] = KEPT[:-1]
    (copy / MANIFEST_NAME).write_text(json.dumps(m))
    _fails(copy, match=f"{BLOCK} keeps 7 experts, not num_experts_after=8")
    (copy / MANIFEST_NAME).unlink()
    r = verify_checkpoint(copy)
    assert r.ok and any("no pruning_manifest.json" in w for w in r.warnings)
    _fails(copy, pruned["src"], match="no pruning_manifest.json")


def test_source_changed(pruned, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(pruned["src"], src)
    shard = sorted(p.name for p in src.glob("*.safetensors"))[0]
    with open(src / shard, "r+b") as fh:
        fh.seek(-1, 2)
        b = fh.read(1)
        fh.seek(-1, 2)
        fh.write(bytes([b[0] ^ 0xFF]))
    _fails(pruned["dst"], src, match=f"source shard {shard}: sha256")


def test_top_k_under_any_known_key(copy):
    # moe_k (one of the top-k keys of models/config_keys.py), read at the top level before
    # text_config: a top-k above the expert count is refused whatever key states it
    cfg = json.loads((copy / "config.json").read_text())
    cfg["moe_k"] = 12
    (copy / "config.json").write_text(json.dumps(cfg))
    _fails(copy, match="top-k 12 exceeds the expert count 8")
