"""The checkpoint rewriter (``reap prune`` / ``rewrite_checkpoint``) on tiny MXFP4
checkpoints: bit-exact kept experts, config / index / manifest, reload + masked-routing
oracle in a fresh process, refusals, interrupted writes, MTP layers."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import xxhash

sys.path.insert(0, os.path.dirname(__file__))

from mxfp4_fixtures import (  # noqa: E402
    add_mtp_layer,
    load_tensors,
    reload_check,
    tensor_sha256,
    tree_sha256,
)
from typer.testing import CliRunner  # noqa: E402

from reap_modifier.checkpoint import (  # noqa: E402
    CheckpointError,
    DestinationError,
    ExpertPlanPruner,
    bind_plan,
    inspect_checkpoint,
    resolve_block,
    rewrite_checkpoint,
)
from reap_modifier.checkpoint.manifest import MANIFEST_NAME  # noqa: E402
from reap_modifier.checkpoint.upstream import convert, meta_tensors  # noqa: E402
from reap_modifier.cli import app  # noqa: E402
from reap_modifier.fileio import sha256_file  # noqa: E402
from reap_modifier.scores.plan import PlanError, PruningPlan  # noqa: E402

#: CLI cut per family: (args, expected kept count)
CUTS = {
    "qwen3_moe": (["--sparsity", "0.25"], 6),  # 8 experts, top-2
    "deepseek_v3": (["--keep", "12"], 12),  # 16 experts in 4 groups (topk_group 2): 3 per group
    "kimi_k3": (["--sparsity", "0.5", "--divisible-by", "8"], 8),  # 16 experts, top-4
}

runner = CliRunner()


@pytest.fixture(autouse=True)
def _private_hash_cache(tmp_path, monkeypatch):
    """Each test gets its own source-hash cache (never the user's ~/.cache)."""
    monkeypatch.setenv(
        "REAP_SHA256_CACHE", str(tmp_path.parent / f"{tmp_path.name}-sha256-cache.json")
    )


def invoke(*args):
    result = runner.invoke(app, [str(a) for a in args])
    return result


@pytest.fixture(scope="session")
def cli_outputs(sources, tmp_path_factory):
    """``reap prune SRC --scores ... --out DST`` for every MXFP4 family."""
    out_root = tmp_path_factory.mktemp("cli")
    outs = {}
    for fam, (args, _) in CUTS.items():
        f = sources["fx"][fam]
        dst = out_root / fam
        res = invoke(
            "prune",
            f.path,
            "--scores",
            sources["root"] / f"{fam}.scores.safetensors",
            *args,
            "--out",
            dst,
            "-q",
            "--no-hash-cache",
        )
        assert res.exit_code == 0, res.output
        outs[fam] = dst
    return outs


def _get_dotted(cfg: dict, key: str):
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def _manifest(dst) -> dict:
    return json.loads((Path(dst) / MANIFEST_NAME).read_text())


def _assert_source_unchanged(sources, fam):
    assert tree_sha256(sources["fx"][fam].path) == sources["hashes"][fam], f"{fam} source changed"


@pytest.mark.parametrize("fam", list(CUTS))
def test_cli_prune_is_bit_exact(sources, cli_outputs, fam):
    f, dst = sources["fx"][fam], cli_outputs[fam]
    n_keep = CUTS[fam][1]
    m = _manifest(dst)
    block_kept = m["checkpoint"]["block_kept"]
    assert set(block_kept) == set(f.moe_blocks)
    assert all(len(v) == n_keep for v in block_kept.values())

    src_sha, dst_sha = tensor_sha256(f.path), tensor_sha256(dst)
    src_t, dst_t = load_tensors(f.path), load_tensors(dst)
    n_expert_tensors = 0
    for block, kept in block_kept.items():
        for new, old in enumerate(kept):
            src_names = [k for k in src_sha if k.startswith(f"{block}.experts.{old}.")]
            assert src_names, (block, old)
            for name in src_names:
                out = name.replace(f"{block}.experts.{old}.", f"{block}.experts.{new}.")
                assert dst_sha[out] == src_sha[name], f"{out} differs from source {name}"
                n_expert_tensors += 1
        # no expert beyond the new count
        assert not [k for k in dst_sha if k.startswith(f"{block}.experts.{n_keep}.")]
        # router rows (weight, e_score_correction_bias) selected
        for name in [k for k in src_t if k.startswith(f"{block}.gate.")]:
            assert dst_t[name].shape[0] == n_keep
            assert dst_t[name].equal(src_t[name][kept]), name
    assert n_expert_tensors >= 2 * 3 * n_keep  # weight_packed + weight_scale per projection
    # every other tensor unchanged
    experts_or_router = lambda k: ".experts." in k or ".gate." in k  # noqa: E731
    for name in src_sha:
        if not experts_or_router(name):
            assert dst_sha[name] == src_sha[name], name

    # format, count key, index
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert _get_dotted(cfg, f.count_key) == n_keep
    assert (
        _get_dotted(json.loads((f.path / "config.json").read_text()), f.count_key) == f.num_experts
    )
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(dst_sha)
    shards = sorted(p.name for p in dst.glob("*.safetensors"))
    assert len(shards) > 1  # multi-shard source -> multi-shard output
    assert set(index["weight_map"].values()) <= set(shards)
    # non-tensor files copied
    src_files = {p.name for p in f.path.iterdir() if not p.name.endswith(".safetensors")}
    assert src_files - {"config.json", "model.safetensors.index.json"} <= {
        p.name for p in dst.iterdir()
    }

    # manifest: sha256 of every source shard and of the scores file, old->new, counts
    assert m["num_experts_before"] == f.num_experts and m["num_experts_after"] == n_keep
    assert m["source"]["shards"] == {p.name: sha256_file(p) for p in f.path.glob("*.safetensors")}
    scores_file = sources["root"] / f"{fam}.scores.safetensors"
    assert m["scores"]["sha256"] == sha256_file(scores_file)
    for _layer, info in m["layers"].items():
        assert info["old_to_new"] == {str(o): n for n, o in enumerate(info["kept_original_ids"])}
        assert 0 < info["retained_saliency_mass"] <= 1
    assert m["checkpoint"]["output_checksum"] == "xxh3_128"
    assert m["checkpoint"]["output_shards"] == {
        s: {
            "bytes": (dst / s).stat().st_size,
            "xxh3_128": xxhash.xxh3_128((dst / s).read_bytes()).hexdigest(),
        }
        for s in shards
    }
    _assert_source_unchanged(sources, fam)

    # reap verify --source passes
    res = invoke("verify", dst, "--source", f.path, "-q")
    assert res.exit_code == 0, res.output
    assert "sha256-equal to the source" in res.output


def test_kimi_ignore_list_renumbered(sources, cli_outputs):
    m = _manifest(cli_outputs["kimi_k3"])
    kept = m["checkpoint"]["block_kept"]["language_model.model.layers.1.block_sparse_moe"]
    ignore = json.loads((cli_outputs["kimi_k3"] / "config.json").read_text())[
        "quantization_config"
    ]["ignore"]
    per_expert = [i for i in ignore if ".block_sparse_moe.experts." in i]
    if 5 in kept:
        new = kept.index(5)
        assert per_expert == [f"language_model.model.layers.1.block_sparse_moe.experts.{new}.w2"]
        assert (
            f"language_model.model.layers.1.block_sparse_moe.experts.{new}.w2.weight"
            in tensor_sha256(cli_outputs["kimi_k3"])
        )
    else:
        assert per_expert == []
    # both cases, through the library: one plan keeping expert 5, one dropping it
    f = sources["fx"]["kimi_k3"]
    base = [i for i in range(16) if i != 5][:7]
    for ids, want in ((sorted(base + [5]), True), (sorted(base + [15]), False)):
        plan = PruningPlan(kept={b: ids for b in f.moe_blocks}, num_experts=16)
        dst = rewrite_checkpoint(f.path, plan, sources["root"] / f"kimi_ign_{want}", progress=False)
        ign = json.loads((dst / "config.json").read_text())["quantization_config"]["ignore"]
        names = [i for i in ign if ".block_sparse_moe.experts." in i]
        if want:
            assert names == [
                f"language_model.model.layers.1.block_sparse_moe.experts.{ids.index(5)}.w2"
            ]
        else:
            assert names == []
            assert not any(".experts." in k and k.endswith(".weight") for k in tensor_sha256(dst))
        assert _manifest(dst)["checkpoint"]["quantization_config_names"]["dropped"] == (
            0 if want else 1
        )
    _assert_source_unchanged(sources, "kimi_k3")


def test_reload_fresh_process_matches_masked_oracle(sources, cli_outputs, tmp_path):
    """Every output reloads in a fresh process with the new count; its logits equal the
    unpruned model's with dropped experts masked out of routing."""
    cases = []
    for fam, dst in cli_outputs.items():
        cases.append(
            {
                "family": fam,
                "src": str(sources["fx"][fam].path),
                "dst": str(dst),
                "block_kept": _manifest(dst)["checkpoint"]["block_kept"],
                "name": fam,
            }
        )
    # GPT-OSS: fused 3-D experts, router bias, single-file checkpoint, through the library
    g = sources["fx"]["gpt_oss"]
    plan = PruningPlan(kept={b: [0, 2, 3, 4, 6, 7] for b in g.moe_blocks}, num_experts=8)
    gdst = rewrite_checkpoint(g.path, plan, tmp_path / "gpt_oss", progress=False)
    cases.append(
        {
            "family": "gpt_oss",
            "src": str(g.path),
            "dst": str(gdst),
            "dtype": "float32",
            "block_kept": _manifest(gdst)["checkpoint"]["block_kept"],
            "name": "gpt_oss",
        }
    )
    results = reload_check(cases, tmp_path)
    for fam, r in results.items():
        n_keep = CUTS[fam][1] if fam in CUTS else 6
        assert r["config_count"] == n_keep, r
        assert set(r["router_rows"].values()) == {n_keep}, r
        assert r["finite"]
        if fam == "gpt_oss":
            # float32 grouped_mm accumulates in an order that depends on the group
            # offsets, which differ once experts are renumbered: ulp-level only
            assert r["max_abs_diff"] <= 1e-5, r
        else:
            assert r["max_abs_diff"] == 0.0, r
    for fam in sources["fx"]:
        _assert_source_unchanged(sources, fam)


def test_fused_3d_router_bias_single_file(sources, tmp_path):
    g = sources["fx"]["gpt_oss"]
    kept = [1, 2, 4, 5, 6, 7]
    plan = PruningPlan(kept={b: kept for b in g.moe_blocks}, num_experts=8)
    dst = rewrite_checkpoint(g.path, plan, tmp_path / "out", progress=False)
    src_t, dst_t = load_tensors(g.path), load_tensors(dst)
    assert not (dst / "model.safetensors.index.json").exists()  # the source had none
    n = 0
    for name, t in src_t.items():
        if ".experts." in name or ".router." in name:
            assert dst_t[name].equal(t[kept]), name
            n += 1
        else:
            assert dst_t[name].equal(t), name
    assert n == 2 * 6  # 4 fused expert tensors + router weight/bias, 2 layers
    assert json.loads((dst / "config.json").read_text())["num_local_experts"] == 6
    assert invoke("verify", dst, "--source", g.path, "-q").exit_code == 0
    _assert_source_unchanged(sources, "gpt_oss")


def test_plan_file_and_prefix_mapping(sources, tmp_path):
    """``--plan`` with layer keys lacking the ``language_model.`` prefix: matched by
    layer index within the same MoE container."""
    f = sources["fx"]["kimi_k3"]
    ids = [0, 1, 2, 3, 8, 9, 10, 11]
    kept = {b.replace("language_model.", "", 1): ids for b in f.moe_blocks}
    plan_file = tmp_path / "plan.json"
    PruningPlan(kept=kept, num_experts=16, saliency="manual").save(plan_file)
    dst = tmp_path / "out"
    res = invoke("prune", f.path, "--plan", plan_file, "--out", dst, "-q")
    assert res.exit_code == 0, res.output
    m = _manifest(dst)
    assert m["checkpoint"]["layer_map"] == {k: "language_model." + k for k in kept}
    assert all(v == ids for v in m["checkpoint"]["block_kept"].values())
    assert invoke("verify", dst, "--source", f.path, "-q").exit_code == 0
    _assert_source_unchanged(sources, "kimi_k3")


def test_resolve_block_exact_layer_and_ambiguous():
    blocks = ["language_model.model.layers.1.mlp", "mtp.layers.1.mlp", "model.layers.2.mlp"]
    assert resolve_block("model.layers.2.mlp", blocks) == "model.layers.2.mlp"
    assert resolve_block("foo.layers.2.mlp", blocks) == "model.layers.2.mlp"
    with pytest.raises(CheckpointError, match="ambiguous"):
        resolve_block("model.layers.1.mlp", blocks)
    with pytest.raises(CheckpointError, match="no MoE block of the checkpoint is layer 3"):
        resolve_block("model.layers.3.mlp", blocks)
    with pytest.raises(CheckpointError, match="no 'layers"):
        resolve_block("encoder.moe", blocks)


def test_resolve_block_container_renamed_by_transformers():
    """Scores of a loaded Mixtral name `model.layers.L.mlp`; its checkpoint stores
    `model.layers.L.block_sparse_moe` (transformers renames it on load)."""
    blocks = ["model.layers.0.block_sparse_moe", "model.layers.1.block_sparse_moe"]
    assert resolve_block("model.layers.1.mlp", blocks) == "model.layers.1.block_sparse_moe"
    assert (
        resolve_block("model.layers.0.block_sparse_moe", ["model.layers.0.mlp"])
        == "model.layers.0.mlp"
    )
    with pytest.raises(CheckpointError, match="no MoE block of the checkpoint is layer 2"):
        resolve_block("model.layers.2.mlp", blocks)
    with pytest.raises(
        CheckpointError, match="no MoE block of the checkpoint is layer 0 'feed_forward'"
    ):
        resolve_block("model.layers.0.feed_forward", blocks)


def test_mtp_extra_layer(sources, tmp_path):
    """A DeepSeek-V3 style MTP MoE layer (model.layers.{num_hidden_layers}) the plan
    does not cover: an error naming it, unless --extra-layers like-last."""
    import shutil

    f = sources["fx"]["deepseek_v3"]
    src = tmp_path / "with_mtp"
    shutil.copytree(f.path, src)
    mtp = add_mtp_layer(src, f.moe_blocks[-1], layer_index=3)
    assert mtp == "model.layers.3.mlp"
    before = tree_sha256(src)
    scores = sources["root"] / "deepseek_v3.scores.safetensors"
    res = invoke("prune", src, "--scores", scores, "--keep", "12", "--out", tmp_path / "o1", "-q")
    assert res.exit_code == 2
    assert "model.layers.3.mlp" in res.output and "MTP" in res.output and "like-last" in res.output
    assert not (tmp_path / "o1").exists()
    res = invoke(
        "prune",
        src,
        "--scores",
        scores,
        "--keep",
        "12",
        "--extra-layers",
        "like-last",
        "--out",
        tmp_path / "o2",
        "-q",
    )
    assert res.exit_code == 0, res.output
    m = _manifest(tmp_path / "o2")
    last = f.moe_blocks[-1]
    assert m["checkpoint"]["extra_layers"][mtp]["kept_from"] == last
    assert m["checkpoint"]["block_kept"][mtp] == m["checkpoint"]["block_kept"][last]
    src_sha, dst_sha = tensor_sha256(src), tensor_sha256(tmp_path / "o2")
    for new, old in enumerate(m["checkpoint"]["block_kept"][mtp]):
        name = f"{mtp}.experts.{old}.down_proj.weight_packed"
        assert dst_sha[name.replace(f".experts.{old}.", f".experts.{new}.")] == src_sha[name]
    assert invoke("verify", tmp_path / "o2", "--source", src, "-q").exit_code == 0
    assert tree_sha256(src) == before


def test_group_limited_plan_must_be_balanced(sources, tmp_path):
    f = sources["fx"]["deepseek_v3"]  # n_group=4, topk_group=2 -> 4 experts per group
    unbalanced = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12]
    plan = PruningPlan(kept={b: unbalanced for b in f.moe_blocks}, num_experts=16)
    with pytest.raises(PlanError, match="same number kept in every group"):
        rewrite_checkpoint(f.path, plan, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_refusals_and_bad_input_exit_before_work(sources, tmp_path):
    f = sources["fx"]["qwen3_moe"]
    scores = sources["root"] / "qwen3_moe.scores.safetensors"
    before = set(os.listdir(tmp_path))

    def refused(*args, match):
        res = invoke("prune", *args)
        assert res.exit_code == 2, res.output
        assert match in res.output, res.output

    refused(
        f.path,
        "--scores",
        scores,
        "--keep",
        "6",
        "--out",
        f.path,
        "--force",
        match="is the source checkpoint",
    )
    refused(
        f.path,
        "--scores",
        scores,
        "--keep",
        "6",
        "--out",
        f.path / "sub",
        match="inside the source",
    )
    refused(
        f.path,
        "--scores",
        scores,
        "--keep",
        "6",
        "--sparsity",
        "0.5",
        "--out",
        tmp_path / "x",
        match="exactly one of --keep",
    )
    refused(f.path, "--scores", scores, "--out", tmp_path / "x", match="exactly one of --keep")
    refused(f.path, "--out", tmp_path / "x", match="exactly one of --scores")
    refused(
        f.path,
        "--plan",
        tmp_path / "p.json",
        "--keep",
        "3",
        "--out",
        tmp_path / "x",
        match="do not apply to --plan",
    )
    refused(f.path, "--scores", scores, "--keep", "1", "--out", tmp_path / "x", match="top_k=2")
    refused(
        f.path,
        "--scores",
        tmp_path / "nope.safetensors",
        "--keep",
        "6",
        "--out",
        tmp_path / "x",
        match="does not exist",
    )
    refused(
        f.path,
        "--scores",
        sources["root"] / "kimi_k3.scores.safetensors",
        "--keep",
        "6",
        "--out",
        tmp_path / "x",
        match="16 experts",
    )
    refused(
        tmp_path / "missing",
        "--scores",
        scores,
        "--keep",
        "6",
        "--out",
        tmp_path / "x",
        match="not a directory",
    )
    refused(f.path, "--plan", tmp_path / "p.json", "--out", tmp_path / "x", match="does not exist")
    # existing non-empty output: refused without --force, replaced with it
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("precious")
    refused(f.path, "--scores", scores, "--keep", "6", "--out", existing, match="--force")
    assert (existing / "keep.txt").read_text() == "precious"
    res = invoke(
        "prune", f.path, "--scores", scores, "--keep", "6", "--out", existing, "--force", "-q"
    )
    assert res.exit_code == 0, res.output
    assert not (existing / "keep.txt").exists() and (existing / MANIFEST_NAME).is_file()
    # nothing else left behind (no temp dirs), source untouched
    assert set(os.listdir(tmp_path)) == before | {"existing"}
    _assert_source_unchanged(sources, "qwen3_moe")
    with pytest.raises(DestinationError):
        rewrite_checkpoint(
            f.path,
            PruningPlan.load(_plan_of(existing, tmp_path)),
            f.path,
            force=True,
            progress=False,
        )


def _plan_of(dst, tmp_path) -> Path:
    m = _manifest(dst)
    p = tmp_path / "plan_from_manifest.json"
    PruningPlan(
        kept={k: v["kept_original_ids"] for k, v in m["layers"].items()},
        num_experts=m["num_experts_before"],
    ).save(p)
    return p


@pytest.mark.parametrize("existing", [False, True])
def test_interrupted_write_leaves_no_dst(sources, tmp_path, monkeypatch, existing):
    """Raise inside the writer after some bytes are written: no DST (or the old DST
    intact), no temp directory, source unchanged."""
    import reap_modifier.checkpoint.byte_copy as ck

    f = sources["fx"]["deepseek_v3"]
    plan = PruningPlan(
        kept={b: [0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14] for b in f.moe_blocks}, num_experts=16
    )
    dst = tmp_path / "out"
    if existing:
        dst.mkdir()
        (dst / "old.txt").write_text("old")
    calls = {"n": 0}
    real = ck.copy_range  # one call per kept byte range

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("simulated disk failure mid-write")
        return real(*args, **kwargs)

    monkeypatch.setattr(ck, "copy_range", failing)
    with pytest.raises(OSError, match="simulated"):
        rewrite_checkpoint(f.path, plan, dst, force=True, progress=False)
    assert calls["n"] == 5
    if existing:
        assert sorted(os.listdir(dst)) == ["old.txt"]
    else:
        assert not dst.exists()
    assert sorted(os.listdir(tmp_path)) == (["out"] if existing else [])
    # the upstream hook is restored after the failure
    import importlib

    mod = importlib.import_module("compressed_tensors.entrypoints.convert.convert_checkpoint")
    assert mod.convert_file.__module__ == "compressed_tensors.entrypoints.convert.convert_file"
    _assert_source_unchanged(sources, "deepseek_v3")


def test_streaming_writer_equals_stock_converter_path(sources, tmp_path):
    """The streaming byte writer and the stock in-memory ``convert_file`` running the
    same Converter's ``process`` produce identical tensors (names, dtypes, bytes)."""
    f = sources["fx"]["kimi_k3"]
    plan = PruningPlan(kept={b: [1, 3, 4, 6, 9, 10, 13, 15] for b in f.moe_blocks}, num_experts=16)
    spec = bind_plan(inspect_checkpoint(f.path), plan)
    stock = ExpertPlanPruner(spec)
    convert(f.path, tmp_path / "stock", stock, stream=False)
    streamed = ExpertPlanPruner(spec)
    convert(f.path, tmp_path / "stream", streamed)
    assert tensor_sha256(tmp_path / "stock") == tensor_sha256(tmp_path / "stream")
    a = json.loads((tmp_path / "stock" / "config.json").read_text())
    b = json.loads((tmp_path / "stream" / "config.json").read_text())
    assert a == b and a["text_config"]["num_experts"] == 8
    # the streaming writer checksummed what it wrote; the stock path is checksummed after
    assert streamed.output_checksums == {
        p.name: xxhash.xxh3_128(p.read_bytes()).hexdigest()
        for p in (tmp_path / "stream").glob("*.safetensors")
    }
    assert set(stock.output_checksums) == set(streamed.output_checksums)
    dst = rewrite_checkpoint(
        f.path, plan, tmp_path / "sha", output_checksum="sha256", progress=False
    )
    assert _manifest(dst)["checkpoint"]["output_shards"] == {
        p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in dst.glob("*.safetensors")
    }
    assert invoke("verify", dst, "-q").exit_code == 0
    _assert_source_unchanged(sources, "kimi_k3")


def test_no_hash_source_and_small_chunks(sources, tmp_path, monkeypatch):
    """Chunking boundaries inside tensors and the seek-only (no source hash) path."""
    import reap_modifier.checkpoint.byte_copy as ck

    monkeypatch.setattr(ck, "CHUNK_BYTES", 1000)  # not a multiple of anything
    f = sources["fx"]["qwen3_moe"]
    plan = PruningPlan(kept={b: [0, 3, 5, 6, 7] + [1] for b in f.moe_blocks}, num_experts=8)
    plan.kept = {k: sorted(v) for k, v in plan.kept.items()}
    for hash_source in (True, False):
        dst = rewrite_checkpoint(
            f.path, plan, tmp_path / f"h{hash_source}", hash_source=hash_source, progress=False
        )
        m = _manifest(dst)
        assert (m["source"]["shards"] is None) == (not hash_source)
    assert tensor_sha256(tmp_path / "hTrue") == tensor_sha256(tmp_path / "hFalse")
    assert invoke("verify", tmp_path / "hFalse", "--source", f.path, "-q").exit_code == 0
    _assert_source_unchanged(sources, "qwen3_moe")


def test_shard_of_dropped_experts_only(tmp_path):
    """A shard holding only dropped experts is not written (the index cannot name an
    empty shard); the output verifies against the source."""
    import re

    from mxfp4_fixtures import write_synthetic_mxfp4

    src = tmp_path / "src"
    info = write_synthetic_mxfp4(src, num_layers=3, num_experts=16, shard_bytes=16 << 10)
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    by_shard: dict[str, list[str]] = {}
    for k, s in weight_map.items():
        by_shard.setdefault(s, []).append(k)
    block = info["blocks"][0]
    only = [
        s for s, names in by_shard.items() if all(n.startswith(block + ".experts.") for n in names)
    ]
    assert only, "fixture should have a shard holding only experts of one layer"
    doomed = {int(re.search(r"\.experts\.(\d+)\.", n).group(1)) for n in by_shard[only[0]]}
    assert len(doomed) <= 8
    keep = [i for i in range(16) if i not in doomed][:8]
    plan = PruningPlan(kept={b: keep for b in info["blocks"]}, num_experts=16)
    before = tree_sha256(src)
    dst = rewrite_checkpoint(src, plan, tmp_path / "dst", progress=False)
    assert not (dst / only[0]).exists()
    assert only[0] not in _manifest(dst)["checkpoint"]["output_shards"]
    assert only[0] in _manifest(dst)["source"]["shards"]
    r = invoke("verify", dst, "--source", src, "-q")
    assert r.exit_code == 0, r.output
    assert tree_sha256(src) == before


def test_source_hash_cache(sources, tmp_path):
    """Source shard hashes are reused while the file is unchanged, recomputed after a
    change of identity (touch), and always correct."""
    f = sources["fx"]["qwen3_moe"]
    cache = tmp_path / "cache.json"
    plan = PruningPlan(kept={b: [0, 1, 2, 3, 4, 5] for b in f.moe_blocks}, num_experts=8)
    want = {p.name: sha256_file(p) for p in f.path.glob("*.safetensors")}
    m1 = _manifest(
        rewrite_checkpoint(f.path, plan, tmp_path / "a", hash_cache=cache, progress=False)
    )
    assert m1["source"]["shards"] == want and m1["source"]["sha256_from_cache"] == []
    m2 = _manifest(
        rewrite_checkpoint(f.path, plan, tmp_path / "b", hash_cache=cache, progress=False)
    )
    assert m2["source"]["shards"] == want and m2["source"]["sha256_from_cache"] == sorted(want)
    # a changed identity (same bytes, new mtime) is rehashed, not trusted
    import shutil

    src2 = tmp_path / "src_copy"
    shutil.copytree(f.path, src2)
    m3 = _manifest(rewrite_checkpoint(src2, plan, tmp_path / "c", hash_cache=cache, progress=False))
    assert m3["source"]["sha256_from_cache"] == []
    shard = sorted(want)[0]
    os.utime(src2 / shard, ns=(1, 1))
    m4 = _manifest(rewrite_checkpoint(src2, plan, tmp_path / "d", hash_cache=cache, progress=False))
    assert (
        shard not in m4["source"]["sha256_from_cache"]
        and len(m4["source"]["sha256_from_cache"]) == len(want) - 1
    )
    assert m4["source"]["shards"] == want
    m5 = _manifest(rewrite_checkpoint(src2, plan, tmp_path / "e", hash_cache=False, progress=False))
    assert m5["source"]["sha256_from_cache"] == [] and m5["source"]["shards"] == want
    _assert_source_unchanged(sources, "qwen3_moe")


def test_upstream_signature_change_falls_back_to_stock_writer(sources, tmp_path, monkeypatch):
    """If compressed-tensors' convert_file ever changes signature, the swap is skipped
    (with a warning): every shard goes through the changed stock function, and it
    produces the same checkpoint as the streaming writer."""
    import importlib

    from loguru import logger

    mod = importlib.import_module("compressed_tensors.entrypoints.convert.convert_checkpoint")
    stock = mod.convert_file
    calls = []

    def changed(inverse_weight_map, save_path, converters, device="cpu", extra=None):
        calls.append(Path(save_path).name)
        return stock(inverse_weight_map, save_path, converters, device)

    monkeypatch.setattr(mod, "convert_file", changed)
    f = sources["fx"]["qwen3_moe"]
    plan = PruningPlan(kept={b: [0, 1, 3, 4, 6, 7] for b in f.moe_blocks}, num_experts=8)
    warnings: list[str] = []
    sink = logger.add(warnings.append, level="WARNING", format="{message}")
    try:
        a = rewrite_checkpoint(f.path, plan, tmp_path / "fallback", progress=False)
    finally:
        logger.remove(sink)
    # the swap was skipped: the changed function wrote every shard, and said so
    assert sorted(calls) == sorted(p.name for p in a.glob("*.safetensors")) and calls
    assert [w for w in warnings if "validate_file changed their signatures" in w], warnings
    monkeypatch.setattr(mod, "convert_file", stock)
    b = rewrite_checkpoint(f.path, plan, tmp_path / "stream", progress=False)
    assert tensor_sha256(a) == tensor_sha256(b)
    assert invoke("verify", a, "--source", f.path, "-q").exit_code == 0
    _assert_source_unchanged(sources, "qwen3_moe")


def test_shard_check_does_not_use_upstreams_quadratic_loader(sources, tmp_path, monkeypatch):
    """compressed-tensors' ``validate_file`` checks every name against the shard's key
    list (quadratic in the tensors of a shard: hours for the 495,905 tensors of one shard
    at K3's counts); the rewrite checks against a set. Its meta tensors equal upstream's,
    a missing name gets upstream's error, and a rewrite never calls upstream's loader."""
    import compressed_tensors.entrypoints.convert.convert_file as cf

    f = sources["fx"]["kimi_k3"]
    shard = str(next(f.path.glob("*.safetensors")))
    stock_load = cf.load_tensors_from_inverse_weight_map
    for names in (None, [], sorted(stock_load({shard: None}, device="meta"))[::3]):
        want = stock_load({shard: names}, device="meta")
        got = meta_tensors({shard: names})
        assert list(got) == list(want) and want
        assert all(
            got[k].is_meta and got[k].shape == want[k].shape and got[k].dtype == want[k].dtype
            for k in want
        )
    with pytest.raises(ValueError, match="Expected to find tensor nope in "):
        meta_tensors({shard: ["nope"]})

    def refuse(*args, **kwargs):
        raise AssertionError("upstream's list-membership loader was called")

    monkeypatch.setattr(cf, "load_tensors_from_inverse_weight_map", refuse)
    plan = PruningPlan(kept={b: [1, 3, 4, 6, 9, 10, 13, 15] for b in f.moe_blocks}, num_experts=16)
    dst = rewrite_checkpoint(f.path, plan, tmp_path / "out", progress=False)
    assert invoke("verify", dst, "--source", f.path, "-q").exit_code == 0
    _assert_source_unchanged(sources, "kimi_k3")
