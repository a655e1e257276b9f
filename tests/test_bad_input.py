"""Bad input to every ``reap`` command and to the modifier's ``scores_in`` / ``plan_in``:
each case asserts the exit code, a message naming the file / layer / field and what to
change, no traceback, and that nothing was written (the case's whole scratch tree,
source copies included, is byte-identical before and after)."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from badinput import (
    assert_clean_error,
    cli,
    copy_tree,
    edit_header,
    edit_json,
    make_read_only,
    overwrite,
    replace_tensor,
    save_scores_variant,
    set_scores_metadata,
    snapshot,
    truncate,
    unprivileged,
    world_scratch,
)
from mxfp4_fixtures import tree_sha256, write_scores, write_synthetic_mxfp4

from reap_modifier.scores import ExpertScores
from reap_modifier.scores.plan import PruningPlan

Q_BLOCKS = ["model.layers.0.mlp", "model.layers.1.mlp"]  # qwen3_moe fixture: 8 experts, top-2
SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
KIMI_SCALE = "language_model.model.layers.2.block_sparse_moe.experts.3.w2.weight_scale"


@dataclass
class Expect:
    args: list
    code: int
    needles: list = field(default_factory=list)


CASES: dict[str, Callable] = {}


def case(name: str):
    def deco(fn):
        assert name not in CASES
        CASES[name] = fn
        return fn

    return deco


@pytest.fixture(scope="module")
def env(sources, tmp_path_factory):
    """Read-only inputs shared by the cases: the qwen3 source, its scores, a pruned output."""
    from reap_modifier.checkpoint import rewrite_checkpoint

    root = tmp_path_factory.mktemp("badinput")
    q = sources["fx"]["qwen3_moe"]
    scores = ExpertScores.load(sources["root"] / "qwen3_moe.scores.safetensors")
    plan = PruningPlan(kept={b: [0, 2, 3, 5, 6, 7] for b in Q_BLOCKS}, num_experts=8)
    pruned = rewrite_checkpoint(q.path, plan, root / "pruned", progress=False, hash_cache=False)
    return SimpleNamespace(
        sources=sources,
        q=q.path,
        kimi=sources["fx"]["kimi_k3"].path,
        gpt=sources["fx"]["gpt_oss"].path,
        scores_file=sources["root"] / "qwen3_moe.scores.safetensors",
        kimi_scores=sources["root"] / "kimi_k3.scores.safetensors",
        scores=scores,
        pruned=pruned,
    )


def _src(env, tmp, which="q"):
    return copy_tree(getattr(env, which), tmp / "src")


def _plan_file(tmp, kept, num_experts=8, **extra) -> Path:
    data = {
        "format": "reap-plan",
        "version": 1,
        "num_experts": num_experts,
        "num_kept": None,
        "saliency": "manual",
        "params": {},
        "kept": kept,
    }
    data.update(extra)
    p = tmp / "plan.json"
    p.write_text(json.dumps(data))
    return p


def _prune_plan(env, tmp, kept, **extra):
    src = _src(env, tmp)
    return ["prune", src, "--plan", _plan_file(tmp, kept, **extra), "--out", tmp / "out", "-q"]


def _prune_scores(env, tmp, scores, *more, which="q"):
    src = _src(env, tmp, which)
    return ["prune", src, "--scores", scores, "--keep", "6", *more, "--out", tmp / "out", "-q"]


def _scores_with(env, tmp, mutate, name="bad.scores.safetensors") -> Path:
    return save_scores_variant(env.scores, tmp / name, mutate)


def _set(layer, stat, index, value):
    def mutate(layers):
        layers[layer][stat][index] = value

    return mutate


# ---------------------------------------------------------------------------
# reap prune: the checkpoint


@case("prune/truncated-shard")
def _(env, tmp):
    src = _src(env, tmp)
    truncate(src / SHARD2, 7)
    return Expect(
        ["prune", src, "--scores", env.scores_file, "--keep", 6, "--out", tmp / "out"],
        2,
        [SHARD2, "truncated"],
    )


@case("prune/corrupt-header-json")
def _(env, tmp):
    src = _src(env, tmp)
    overwrite(src / SHARD1, 8, b"\xff" * 16)
    return Expect(
        ["prune", src, "--scores", env.scores_file, "--keep", 6, "--out", tmp / "out"],
        2,
        [SHARD1, "corrupt safetensors header"],
    )


@case("prune/header-length-beyond-file")
def _(env, tmp):
    src = _src(env, tmp)
    overwrite(src / SHARD1, 0, struct.pack("<Q", 1 << 40))
    return Expect(
        ["prune", src, "--scores", env.scores_file, "--keep", 6, "--out", tmp / "out"],
        2,
        [SHARD1, "header length"],
    )


@case("prune/header-shape-disagrees-with-offsets")
def _(env, tmp):
    src = _src(env, tmp)
    name = "model.layers.0.mlp.experts.3.down_proj.weight_packed"

    def bump(h):
        h[name]["shape"] = [32, 17]

    edit_header(src / SHARD1, bump)
    return Expect(
        ["prune", src, "--scores", env.scores_file, "--keep", 6, "--out", tmp / "out"],
        2,
        [SHARD1, name, "needs 544 bytes, header says 512"],
    )


@case("prune/index-names-missing-shard")
def _(env, tmp):
    src = _src(env, tmp)
    (src / SHARD2).unlink()
    return Expect(
        ["prune", src, "--scores", env.scores_file, "--keep", 6, "--out", tmp / "out"],
        2,
        [SHARD2, "does not exist"],
    )


@case("prune/index-names-absent-tensor")
def _(env, tmp):
    src = _src(env, tmp)
    edit_json(
        src / "model.safetensors.index.json",
        lambda d: d["weight_map"].update({"model.layers.0.mlp.experts.0.bogus.weight": SHARD1}),
    )
    return Expect(
        ["prune", src, "--scores", env.scores_file, "--keep", 6, "--out", tmp / "out"],
        2,
        ["model.layers.0.mlp.experts.0.bogus.weight", SHARD1, "lacks it"],
    )


@case("prune/index-not-json")
def _(env, tmp):
    src = _src(env, tmp)
    (src / "model.safetensors.index.json").write_text("{ not json")
    return Expect(
        ["prune", src, "--scores", env.scores_file, "--keep", 6, "--out", tmp / "out"],
        2,
        ["model.safetensors.index.json", "unreadable index"],
    )


@case("prune/unindexed-safetensors-file")
def _(env, tmp):
    src = _src(env, tmp)
    shutil.copy(src / SHARD1, src / "stray.safetensors")
    return Expect(
        ["prune", src, "--scores", env.scores_file, "--keep", 6, "--out", tmp / "out"],
        2,
        ["stray.safetensors", "not in the weight index"],
    )


@case("prune/single-file-not-named-model.safetensors")
def _(env, tmp):
    src = copy_tree(env.gpt, tmp / "src")
    (src / "model.safetensors").rename(src / "weights.safetensors")
    plan = _plan_file(tmp, {b: [0, 1, 2, 3, 4, 5] for b in Q_BLOCKS})
    return Expect(
        ["prune", src, "--plan", plan, "--out", tmp / "out", "-q"],
        2,
        ["weights.safetensors", "model.safetensors"],
    )


@case("prune/no-config")
def _(env, tmp):
    src = _src(env, tmp)
    (src / "config.json").unlink()
    return Expect(
        ["prune", src, "--scores", env.scores_file, "--keep", 6, "--out", tmp / "out"],
        2,
        ["no config.json"],
    )


@case("prune/config-not-json")
def _(env, tmp):
    src = _src(env, tmp)
    (src / "config.json").write_text('{"num_local_experts": 8,')
    return Expect(
        ["prune", src, "--scores", env.scores_file, "--keep", 6, "--out", tmp / "out"],
        2,
        ["config.json", "not valid JSON"],
    )


@case("prune/config-count-key-missing")
def _(env, tmp):
    src = _src(env, tmp)
    edit_json(src / "config.json", lambda c: c.pop("num_local_experts"))
    return Expect(_args_plan(src, tmp), 2, ["config.json", "expert-count key", "num_local_experts"])


def _args_plan(src, tmp, kept=None):
    plan = _plan_file(tmp, kept or {b: [0, 1, 2, 3, 4, 5] for b in Q_BLOCKS})
    return ["prune", src, "--plan", plan, "--out", tmp / "out", "-q"]


@case("prune/non-moe-checkpoint")
def _(env, tmp):
    src = tmp / "dense"
    write_synthetic_mxfp4(src, num_layers=2, dense_layers=2, shard_bytes=1 << 20)
    return Expect(
        ["prune", src, "--scores", env.scores_file, "--keep", 6, "--out", tmp / "out"],
        2,
        ["no MoE layer"],
    )


@case("prune/non-moe-checkpoint-with-plan")
def _(env, tmp):
    src = tmp / "dense"
    write_synthetic_mxfp4(src, num_layers=2, dense_layers=2, shard_bytes=1 << 20)
    return Expect(_args_plan(src, tmp), 2, ["no MoE block"])


@case("prune/mxfp4-scale-shape-mismatch")
def _(env, tmp):
    src = copy_tree(env.kimi, tmp / "src")
    replace_tensor(src, KIMI_SCALE, torch.zeros(32, 2, dtype=torch.uint8))
    blocks = [
        "language_model.model.layers.1.block_sparse_moe",
        "language_model.model.layers.2.block_sparse_moe",
    ]
    plan = _plan_file(tmp, {b: list(range(8)) for b in blocks}, num_experts=16)
    return Expect(
        ["prune", src, "--plan", plan, "--out", tmp / "out", "-q"],
        2,
        [KIMI_SCALE, "[32, 2]", "weight_packed", "[32, 1]"],
    )


# ---------------------------------------------------------------------------
# reap prune: the plan


@case("prune/plan-duplicate-ids")
def _(env, tmp):
    return Expect(
        _prune_plan(env, tmp, {Q_BLOCKS[0]: [0, 1, 1, 2, 3, 4], Q_BLOCKS[1]: [0, 1, 2, 3, 4, 5]}),
        2,
        [Q_BLOCKS[0], "unique", "1"],
    )


@case("prune/plan-out-of-range-ids")
def _(env, tmp):
    return Expect(
        _prune_plan(env, tmp, {Q_BLOCKS[0]: [0, 1, 2, 3, 4, 8], Q_BLOCKS[1]: [0, 1, 2, 3, 4, 5]}),
        2,
        [Q_BLOCKS[0], "[0, 8)", "8"],
    )


@case("prune/plan-negative-id")
def _(env, tmp):
    return Expect(
        _prune_plan(env, tmp, {Q_BLOCKS[0]: [-1, 1, 2, 3, 4, 5], Q_BLOCKS[1]: [0, 1, 2, 3, 4, 5]}),
        2,
        [Q_BLOCKS[0], "[0, 8)", "-1"],
    )


@case("prune/plan-unsorted-ids")
def _(env, tmp):
    return Expect(
        _prune_plan(env, tmp, {Q_BLOCKS[0]: [1, 0, 2, 3, 4, 5], Q_BLOCKS[1]: [0, 1, 2, 3, 4, 5]}),
        2,
        [Q_BLOCKS[0], "ascending"],
    )


@case("prune/plan-missing-layer")
def _(env, tmp):
    return Expect(
        _prune_plan(env, tmp, {Q_BLOCKS[0]: [0, 1, 2, 3, 4, 5]}),
        2,
        [Q_BLOCKS[1], "the plan does not cover", "cut it from scores of this checkpoint"],
    )


@case("prune/plan-uneven-counts")
def _(env, tmp):
    return Expect(
        _prune_plan(env, tmp, {Q_BLOCKS[0]: [0, 1, 2, 3, 4, 5], Q_BLOCKS[1]: [0, 1, 2, 3, 4]}),
        2,
        ["different counts", Q_BLOCKS[1]],
    )


@case("prune/plan-for-another-model-expert-count")
def _(env, tmp):
    kept = {b: list(range(8)) for b in Q_BLOCKS}
    return Expect(
        _prune_plan(env, tmp, kept, num_experts=16),
        2,
        ["8 experts in the checkpoint", "the plan is for 16"],
    )


@case("prune/plan-for-another-model-layers")
def _(env, tmp):
    kept = {
        "language_model.model.layers.1.feed_forward": [0, 1, 2, 3, 4, 5],
        "language_model.model.layers.2.feed_forward": [0, 1, 2, 3, 4, 5],
    }
    return Expect(
        _prune_plan(env, tmp, kept),
        2,
        [
            "language_model.model.layers.1.feed_forward",
            "no MoE block of the checkpoint is layer 1",
            Q_BLOCKS[0],
        ],
    )


@case("prune/plan-future-version")
def _(env, tmp):
    return Expect(
        _prune_plan(env, tmp, {b: [0, 1, 2, 3, 4, 5] for b in Q_BLOCKS}, version=2),
        2,
        ["plan.json", "version 2", "not supported", "version 1"],
    )


@case("prune/plan-not-json")
def _(env, tmp):
    src = _src(env, tmp)
    (tmp / "plan.json").write_text("{")
    return Expect(
        ["prune", src, "--plan", tmp / "plan.json", "--out", tmp / "out"],
        2,
        ["plan.json", "not valid JSON"],
    )


@case("prune/plan-kept-not-a-mapping")
def _(env, tmp):
    return Expect(_prune_plan(env, tmp, [[0, 1, 2, 3, 4, 5]]), 2, ["plan.json", "kept"])


@case("prune/plan-missing-num-experts")
def _(env, tmp):
    src = _src(env, tmp)
    (tmp / "plan.json").write_text(
        json.dumps({"format": "reap-plan", "version": 1, "kept": {b: [0, 1] for b in Q_BLOCKS}})
    )
    return Expect(
        ["prune", src, "--plan", tmp / "plan.json", "--out", tmp / "out"],
        2,
        ["plan.json", "num_experts"],
    )


@case("prune/plan-ids-not-integers")
def _(env, tmp):
    return Expect(
        _prune_plan(env, tmp, {b: ["a", 1, 2, 3, 4, 5] for b in Q_BLOCKS}),
        2,
        ["plan.json", Q_BLOCKS[0]],
    )


@case("prune/plan-missing-file")
def _(env, tmp):
    src = _src(env, tmp)
    return Expect(
        ["prune", src, "--plan", tmp / "nope.json", "--out", tmp / "out"],
        2,
        ["nope.json", "does not exist"],
    )


# ---------------------------------------------------------------------------
# reap prune: the scores


@case("prune/scores-nan")
def _(env, tmp):
    bad = _scores_with(env, tmp, _set(Q_BLOCKS[1], "sum_reap", 3, math.nan))
    return Expect(_prune_scores(env, tmp, bad), 2, [f"{Q_BLOCKS[1]}::sum_reap", "NaN", "[3]"])


@case("prune/scores-inf")
def _(env, tmp):
    bad = _scores_with(env, tmp, _set(Q_BLOCKS[0], "sum_norm", 5, math.inf))
    return Expect(_prune_scores(env, tmp, bad), 2, [f"{Q_BLOCKS[0]}::sum_norm", "inf", "[5]"])


@case("prune/scores-negative-count")
def _(env, tmp):
    bad = _scores_with(env, tmp, _set(Q_BLOCKS[0], "count", 2, -4.0))
    return Expect(_prune_scores(env, tmp, bad), 2, [f"{Q_BLOCKS[0]}::count", "negative", "[2]"])


@case("prune/scores-future-version")
def _(env, tmp):
    bad = Path(shutil.copy(env.scores_file, tmp / "future.scores.safetensors"))
    set_scores_metadata(bad, version=2)
    return Expect(
        _prune_scores(env, tmp, bad), 2, ["future.scores.safetensors", "version 2", "not supported"]
    )


@case("prune/scores-other-expert-count")
def _(env, tmp):
    return Expect(
        _prune_scores(env, tmp, env.kimi_scores),
        2,
        ["kimi_k3.scores.safetensors", "holds 16 experts per layer", "the checkpoint has 8"],
    )


@case("prune/scores-other-layers")
def _(env, tmp):
    def rename(layers):
        layers["model.layers.7.mlp"] = layers.pop(Q_BLOCKS[1])

    base = ExpertScores(layers=env.scores.layers, metadata=dict(env.scores.metadata))
    bad = save_scores_variant(base, tmp / "other.scores.safetensors", rename)
    return Expect(
        _prune_scores(env, tmp, bad),
        2,
        ["other.scores.safetensors", "model.layers.7.mlp", "layer 7"],
    )


@case("prune/scores-truncated")
def _(env, tmp):
    bad = tmp / "trunc.scores.safetensors"
    bad.write_bytes(env.scores_file.read_bytes()[:100])
    return Expect(
        _prune_scores(env, tmp, bad), 2, ["trunc.scores.safetensors", "cannot read scores file"]
    )


@case("prune/scores-is-a-checkpoint-shard")
def _(env, tmp):
    return Expect(_prune_scores(env, tmp, env.q / SHARD1), 2, [SHARD1, "not a REAP scores file"])


@case("prune/sparsity-out-of-range")
def _(env, tmp):
    src = _src(env, tmp)
    return Expect(
        ["prune", src, "--scores", env.scores_file, "--sparsity", 1.5, "--out", tmp / "out"],
        2,
        ["sparsity must be in (0, 1)"],
    )


@case("prune/keep-below-top-k")
def _(env, tmp):
    src = _src(env, tmp)
    return Expect(
        ["prune", src, "--scores", env.scores_file, "--keep", 1, "--out", tmp / "out"],
        2,
        ["top_k=2"],
    )


@case("prune/divisible-by-zero")
def _(env, tmp):
    src = _src(env, tmp)
    return Expect(
        [
            "prune",
            src,
            "--scores",
            env.scores_file,
            "--keep",
            6,
            "--divisible-by",
            0,
            "--out",
            tmp / "out",
        ],
        2,
        ["divisible_by must be >= 1"],
    )


@case("prune/bad-extra-layers-value")
def _(env, tmp):
    return Expect(
        _prune_scores(env, tmp, env.scores_file, "--extra-layers", "drop"),
        2,
        ["--extra-layers", "'drop'"],
    )


@case("prune/bad-output-checksum")
def _(env, tmp):
    return Expect(
        _prune_scores(env, tmp, env.scores_file, "--output-checksum", "md5"),
        2,
        ["--output-checksum", "'md5'"],
    )


# ---------------------------------------------------------------------------
# reap prune: the destination


@case("prune/out-is-source")
def _(env, tmp):
    src = _src(env, tmp)
    return Expect(
        ["prune", src, "--scores", env.scores_file, "--keep", 6, "--out", src, "--force"],
        2,
        ["is the source checkpoint"],
    )


@case("prune/out-inside-source")
def _(env, tmp):
    src = _src(env, tmp)
    return Expect(
        ["prune", src, "--scores", env.scores_file, "--keep", 6, "--out", src / "pruned"],
        2,
        ["inside the source"],
    )


@case("prune/source-inside-out")
def _(env, tmp):
    src = copy_tree(env.q, tmp / "outer" / "src")
    return Expect(
        ["prune", src, "--scores", env.scores_file, "--keep", 6, "--out", tmp / "outer", "--force"],
        2,
        ["is inside the output"],
    )


@case("prune/out-is-a-file")
def _(env, tmp):
    src = _src(env, tmp)
    (tmp / "out").write_text("precious")
    return Expect(
        ["prune", src, "--scores", env.scores_file, "--keep", 6, "--out", tmp / "out"],
        2,
        ["exists and is a file", "--force"],
    )


@case("prune/out-non-empty")
def _(env, tmp):
    src = _src(env, tmp)
    (tmp / "out").mkdir()
    (tmp / "out" / "keep.txt").write_text("precious")
    return Expect(
        ["prune", src, "--scores", env.scores_file, "--keep", 6, "--out", tmp / "out"],
        2,
        ["non-empty directory", "--force"],
    )


@case("prune/out-parent-missing")
def _(env, tmp):
    src = _src(env, tmp)
    return Expect(
        ["prune", src, "--scores", env.scores_file, "--keep", 6, "--out", tmp / "no" / "out"],
        2,
        ["parent directory", "does not exist"],
    )


@case("prune/save-plan-is-a-directory")
def _(env, tmp):
    src = _src(env, tmp)
    (tmp / "plans").mkdir()
    return Expect(
        [
            "prune",
            src,
            "--scores",
            env.scores_file,
            "--keep",
            6,
            "--save-plan",
            tmp / "plans",
            "--out",
            tmp / "out",
            "-q",
        ],
        2,
        ["plans", "--save-plan"],
    )


# ---------------------------------------------------------------------------
# reap verify (exit 1: verification failed, naming the file / tensor)


def _pruned(env, tmp):
    return copy_tree(env.pruned, tmp / "pruned")


@case("verify/not-a-directory")
def _(env, tmp):
    return Expect(["verify", tmp / "nope"], 1, ["nope", "is not a directory"])


@case("verify/no-config")
def _(env, tmp):
    d = _pruned(env, tmp)
    (d / "config.json").unlink()
    return Expect(["verify", d], 1, ["no config.json"])


@case("verify/truncated-shard")
def _(env, tmp):
    d = _pruned(env, tmp)
    truncate(d / SHARD2, 3)
    return Expect(["verify", d, "-q"], 1, [SHARD2, "truncated"])


@case("verify/corrupt-header")
def _(env, tmp):
    d = _pruned(env, tmp)
    overwrite(d / SHARD1, 8, b"\x00\xff" * 8)
    return Expect(["verify", d, "-q"], 1, [SHARD1, "corrupt safetensors header"])


@case("verify/index-names-missing-shard")
def _(env, tmp):
    d = _pruned(env, tmp)
    (d / SHARD2).unlink()
    return Expect(["verify", d, "-q"], 1, [SHARD2, "does not exist"])


@case("verify/manifest-not-json")
def _(env, tmp):
    d = _pruned(env, tmp)
    (d / "pruning_manifest.json").write_text("{")
    return Expect(["verify", d, "-q"], 1, ["pruning_manifest.json", "not valid JSON"])


@case("verify/manifest-malformed")
def _(env, tmp):
    d = _pruned(env, tmp)
    edit_json(
        d / "pruning_manifest.json",
        lambda m: m["checkpoint"].update(block_kept={Q_BLOCKS[0]: "0,2,3", Q_BLOCKS[1]: None}),
    )
    return Expect(["verify", d, "-q"], 1, ["pruning_manifest.json", "block_kept"])


@case("verify/source-missing-shard")
def _(env, tmp):
    d = _pruned(env, tmp)
    src = _src(env, tmp)
    (src / SHARD2).unlink()
    return Expect(["verify", d, "--source", src, "-q"], 1, ["source", SHARD2])


@case("verify/mxfp4-scale-shape-mismatch")
def _(env, tmp):
    from reap_modifier.checkpoint import rewrite_checkpoint

    src = copy_tree(env.kimi, tmp / "src")
    blocks = [
        "language_model.model.layers.1.block_sparse_moe",
        "language_model.model.layers.2.block_sparse_moe",
    ]
    d = rewrite_checkpoint(
        src,
        PruningPlan(kept={b: list(range(8)) for b in blocks}, num_experts=16),
        tmp / "pruned",
        progress=False,
        hash_cache=False,
    )
    replace_tensor(d, KIMI_SCALE, torch.zeros(32, 2, dtype=torch.uint8))
    return Expect(["verify", d, "-q"], 1, [KIMI_SCALE, "[32, 2]", "weight_packed"])


@case("verify/temp-dir-of-an-interrupted-prune")
def _(env, tmp):
    d = copy_tree(env.pruned, tmp / ".out.reap-tmp-0123abcd")
    return Expect(["verify", d, "-q"], 1, ["reap-tmp", "interrupted"])


# ---------------------------------------------------------------------------
# reap cut / scores merge / show / from-weights / compare / tiers (exit 2: bad input)


@case("cut/nan")
def _(env, tmp):
    bad = _scores_with(env, tmp, _set(Q_BLOCKS[0], "count", 1, math.nan))
    return Expect(
        ["cut", bad, "--keep", 6, "-o", tmp / "plan.json"], 2, [f"{Q_BLOCKS[0]}::count", "NaN"]
    )


@case("cut/negative-count")
def _(env, tmp):
    def per_source(layers):
        for stats in layers.values():
            stats["count@test"] = stats["count"].clone()
        layers[Q_BLOCKS[1]]["count@test"][0] = -1.0

    bad = _scores_with(env, tmp, per_source)
    return Expect(
        ["cut", bad, "--keep", 6, "-o", tmp / "plan.json"],
        2,
        [f"{Q_BLOCKS[1]}::count@test", "negative"],
    )


@case("cut/future-version")
def _(env, tmp):
    bad = Path(shutil.copy(env.scores_file, tmp / "future.scores.safetensors"))
    set_scores_metadata(bad, version=2)
    return Expect(
        ["cut", bad, "--keep", 6, "-o", tmp / "plan.json"], 2, ["version 2", "not supported"]
    )


@case("cut/unknown-format")
def _(env, tmp):
    bad = Path(shutil.copy(env.scores_file, tmp / "other.scores.safetensors"))
    set_scores_metadata(bad, format="something-else")
    return Expect(
        ["cut", bad, "--keep", 6, "-o", tmp / "plan.json"], 2, ["'something-else'", "reap-scores"]
    )


@case("cut/empty-file")
def _(env, tmp):
    (tmp / "empty.scores").write_bytes(b"")
    return Expect(
        ["cut", tmp / "empty.scores", "--keep", 6, "-o", tmp / "plan.json"],
        2,
        ["empty.scores", "cannot read scores file"],
    )


@case("cut/keep-above-expert-count")
def _(env, tmp):
    return Expect(
        ["cut", env.scores_file, "--keep", 9, "-o", tmp / "plan.json"], 2, ["[1, 8]", "9"]
    )


@case("cut/divisible-by-zero")
def _(env, tmp):
    return Expect(
        ["cut", env.scores_file, "--keep", 6, "--divisible-by", 0, "-o", tmp / "plan.json"],
        2,
        ["divisible_by must be >= 1"],
    )


@case("cut/output-is-a-directory")
def _(env, tmp):
    (tmp / "plans").mkdir()
    return Expect(["cut", env.scores_file, "--keep", 6, "-o", tmp / "plans"], 2, ["plans"])


@case("merge/other-expert-count")
def _(env, tmp):
    return Expect(
        ["scores", "merge", env.scores_file, env.kimi_scores, "-o", tmp / "m.scores"],
        2,
        ["kimi_k3.scores.safetensors", "num_experts 8 != 16"],
    )


@case("merge/future-version")
def _(env, tmp):
    bad = Path(shutil.copy(env.scores_file, tmp / "future.scores.safetensors"))
    set_scores_metadata(bad, version=3)
    return Expect(
        ["scores", "merge", env.scores_file, bad, "-o", tmp / "m.scores"],
        2,
        ["future.scores.safetensors", "version 3"],
    )


@case("merge/nan")
def _(env, tmp):
    bad = _scores_with(env, tmp, _set(Q_BLOCKS[0], "max_norm", 0, math.nan))
    return Expect(
        ["scores", "merge", env.scores_file, bad, "-o", tmp / "m.scores"],
        2,
        [f"{Q_BLOCKS[0]}::max_norm", "NaN"],
    )


@case("merge/baseline-file")
def _(env, tmp):
    from reap_modifier.scores.baselines import scores_from_weights

    w = scores_from_weights(env.gpt, "router_l1").save(tmp / "l1.scores")
    return Expect(
        ["scores", "merge", env.scores_file, w, "-o", tmp / "m.scores"],
        2,
        ["calibration-free", "router_l1"],
    )


@case("merge/one-file")
def _(env, tmp):
    return Expect(["scores", "merge", env.scores_file, "-o", tmp / "m.scores"], 2, ["at least two"])


@case("merge/output-is-a-directory")
def _(env, tmp):
    (tmp / "merged").mkdir()
    return Expect(
        ["scores", "merge", env.scores_file, env.scores_file, "-o", tmp / "merged"], 2, ["merged"]
    )


@case("show/checkpoint-shard")
def _(env, tmp):
    return Expect(["scores", "show", env.q / SHARD1], 2, [SHARD1, "not a REAP scores file"])


@case("show/missing")
def _(env, tmp):
    return Expect(["scores", "show", tmp / "nope.scores"], 2, ["nope.scores", "does not exist"])


@case("show/truncated")
def _(env, tmp):
    bad = tmp / "t.scores"
    bad.write_bytes(env.scores_file.read_bytes()[:-5])
    return Expect(["scores", "show", bad], 2, ["t.scores", "cannot read scores file"])


@case("from-weights/non-moe")
def _(env, tmp):
    src = tmp / "dense"
    write_synthetic_mxfp4(src, num_layers=2, dense_layers=2, shard_bytes=1 << 20)
    return Expect(
        ["scores", "from-weights", src, "--method", "router_l1", "-o", tmp / "w.scores"],
        2,
        ["no router tensors"],
    )


@case("from-weights/truncated-shard")
def _(env, tmp):
    src = _src(env, tmp)
    truncate(src / SHARD1, 11)
    return Expect(
        ["scores", "from-weights", src, "--method", "router_l1", "-o", tmp / "w.scores"],
        2,
        [SHARD1, "cannot read safetensors shard"],
    )


@case("from-weights/index-names-missing-shard")
def _(env, tmp):
    src = _src(env, tmp)
    (src / SHARD2).unlink()
    return Expect(
        ["scores", "from-weights", src, "--method", "router_l1", "-o", tmp / "w.scores"],
        2,
        [SHARD2, "missing"],
    )


@case("from-weights/missing-directory")
def _(env, tmp):
    return Expect(
        ["scores", "from-weights", tmp / "nope", "--method", "router_l1", "-o", tmp / "w.scores"],
        2,
        ["nope", "does not exist"],
    )


@case("from-weights/unknown-method")
def _(env, tmp):
    return Expect(
        ["scores", "from-weights", env.q, "--method", "l2", "-o", tmp / "w.scores"],
        2,
        ["'l2' is not one of", "'router_l1'"],
    )


@case("from-weights/output-is-a-directory")
def _(env, tmp):
    (tmp / "w").mkdir()
    return Expect(
        ["scores", "from-weights", env.q, "--method", "router_l1", "-o", tmp / "w"], 2, ["w"]
    )


@case("compare/nan")
def _(env, tmp):
    bad = _scores_with(env, tmp, _set(Q_BLOCKS[0], "sum_reap", 0, math.nan))
    return Expect(
        ["compare", env.scores_file, bad, "--keep", 6, "-o", tmp / "cmp"],
        2,
        [f"{Q_BLOCKS[0]}::sum_reap", "NaN"],
    )


@case("compare/other-expert-count")
def _(env, tmp):
    return Expect(
        ["compare", env.scores_file, env.kimi_scores, "--keep", 6, "-o", tmp / "cmp"],
        2,
        ["different expert counts (8 != 16)"],
    )


@case("compare/future-version")
def _(env, tmp):
    bad = Path(shutil.copy(env.scores_file, tmp / "future.scores.safetensors"))
    set_scores_metadata(bad, version=2)
    return Expect(
        ["compare", env.scores_file, bad, "--keep", 6, "-o", tmp / "cmp"],
        2,
        ["future.scores.safetensors", "version 2"],
    )


@case("compare/bad-per-source-syntax")
def _(env, tmp):
    return Expect(
        [
            "compare",
            env.scores_file,
            env.scores_file,
            "--keep",
            6,
            "--per-source",
            "en",
            "-o",
            tmp / "cmp",
        ],
        2,
        ["--per-source", "KEY=VALUE", "'en'"],
    )


@case("tiers/keep-above-expert-count")
def _(env, tmp):
    return Expect(["tiers", env.scores_file, "--keep", 6, 12, "-o", tmp / "tiers"], 2, ["12", "8"])


@case("tiers/nan")
def _(env, tmp):
    bad = _scores_with(env, tmp, _set(Q_BLOCKS[1], "sum_weight", 7, math.inf))
    return Expect(
        ["tiers", bad, "--keep", 6, "-o", tmp / "tiers"], 2, [f"{Q_BLOCKS[1]}::sum_weight", "inf"]
    )


@case("tiers/no-tiers")
def _(env, tmp):
    return Expect(["tiers", env.scores_file], 2, ["--keep"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_cli_bad_input(name, env, tmp_path):
    expect = CASES[name](env, tmp_path)
    before = snapshot(tmp_path)
    result = cli(*expect.args)
    assert_clean_error(result, expect.code, expect.needles)
    assert snapshot(tmp_path) == before, "something was written"
    assert env.sources["hashes"]["qwen3_moe"] == tree_sha256(env.q)


def test_bad_input_suite_size():
    commands = {name.split("/")[0] for name in CASES}
    assert len(CASES) >= 30
    assert commands >= {
        "prune",
        "verify",
        "cut",
        "merge",
        "show",
        "from-weights",
        "compare",
        "tiers",
    }


# ---------------------------------------------------------------------------
# permissions: output directory not writable (refused), source read-only (works)


def test_output_directory_not_writable(env):
    with world_scratch() as d:
        src = copy_tree(env.q, d / "src")
        (d / "ro").mkdir()
        (d / "ro").chmod(0o555)
        scores = _world_copy(env.scores_file, d)
        before = snapshot(d)
        with unprivileged():
            result = cli(
                "prune", src, "--scores", scores, "--keep", 6, "--out", d / "ro" / "out", "-q"
            )
        assert_clean_error(result, 2, [str(d / "ro"), "not writable"])
        assert snapshot(d) == before


def _world_copy(path: Path, d: Path) -> Path:
    dst = d / path.name
    if not dst.exists():
        shutil.copy(path, dst)
        dst.chmod(0o644)
    return dst


def test_read_only_source_still_works(env):
    from reap_modifier.checkpoint.verify import verify_checkpoint

    with world_scratch() as d:
        src = copy_tree(env.q, d / "src")
        scores = _world_copy(env.scores_file, d)
        make_read_only(src)
        (d / "out_parent").mkdir()
        (d / "out_parent").chmod(0o777)
        before = snapshot(src)
        with unprivileged():
            result = cli(
                "prune",
                src,
                "--scores",
                scores,
                "--keep",
                6,
                "--out",
                d / "out_parent" / "out",
                "-q",
            )
        assert result.exit_code == 0, result.output
        assert snapshot(src) == before
        assert verify_checkpoint(d / "out_parent" / "out", source=src).ok


# ---------------------------------------------------------------------------
# symlinks: a symlinked source directory, and HF-cache style symlinked files


def test_symlinked_source_directory(env, tmp_path):
    from reap_modifier.checkpoint.verify import verify_checkpoint

    src = copy_tree(env.q, tmp_path / "real")
    (tmp_path / "link").symlink_to(src, target_is_directory=True)
    before = snapshot(src)
    result = cli(
        "prune",
        tmp_path / "link",
        "--scores",
        env.scores_file,
        "--keep",
        6,
        "--out",
        tmp_path / "out",
        "-q",
    )
    assert result.exit_code == 0, result.output
    assert snapshot(src) == before
    report = verify_checkpoint(tmp_path / "out", source=tmp_path / "link")
    assert report.ok, report.summary()
    # an output inside the source is still refused through the link
    assert_clean_error(
        cli(
            "prune",
            tmp_path / "link",
            "--scores",
            env.scores_file,
            "--keep",
            6,
            "--out",
            src / "pruned",
        ),
        2,
        ["inside the source"],
    )


def test_hf_cache_style_symlinked_files(env, tmp_path):
    """Every file of the snapshot is a symlink into a blobs folder (the Hugging Face
    cache layout): the rewrite follows them, and the output holds real files."""
    from reap_modifier.checkpoint.verify import verify_checkpoint

    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for p in sorted(env.q.iterdir()):
        blob = blobs / hashlib.sha256(p.read_bytes()).hexdigest()
        shutil.copy(p, blob)
        (snap / p.name).symlink_to(Path("../..") / "blobs" / blob.name)
    before = snapshot(tmp_path)
    result = cli(
        "prune", snap, "--scores", env.scores_file, "--keep", 6, "--out", tmp_path / "out", "-q"
    )
    assert result.exit_code == 0, result.output
    after = snapshot(tmp_path)
    assert {
        k: v for k, v in after.items() if not k.startswith("out")
    } == before  # blobs and links untouched
    assert not any(p.is_symlink() for p in (tmp_path / "out").iterdir())
    report = verify_checkpoint(tmp_path / "out", source=snap)
    assert report.ok, report.summary()


# ---------------------------------------------------------------------------
# the modifier's scores_in / plan_in


@pytest.fixture(scope="module")
def tiny_qwen():
    from tiny_models import build_tiny

    model, info = build_tiny("qwen3_moe", seed=5)
    return model, info


def _fresh_qwen(tiny_qwen):
    import copy

    return copy.deepcopy(tiny_qwen[0])


def _model_scores(info, tmp) -> ExpertScores:
    fixture = SimpleNamespace(
        moe_blocks=list(info.moe_blocks),
        num_experts=info.num_experts,
        top_k=info.top_k,
        n_group=None,
        topk_group=None,
        family="qwen3_moe",
    )
    return write_scores(tmp / "good.scores.safetensors", fixture)


MODIFIER_CASES = {
    "scores_in/nan": (
        lambda info, tmp, good: dict(
            sparsity=0.25,
            scores_in=str(
                save_scores_variant(
                    good,
                    tmp / "nan.s.safetensors",
                    _set(info.moe_blocks[0], "sum_reap", 1, math.nan),
                )
            ),
        ),
        ["nan.s.safetensors", "{L0}::sum_reap", "NaN"],
    ),
    "scores_in/negative-count": (
        lambda info, tmp, good: dict(
            sparsity=0.25,
            scores_in=str(
                save_scores_variant(
                    good, tmp / "neg.s.safetensors", _set(info.moe_blocks[1], "count", 0, -1.0)
                )
            ),
        ),
        ["neg.s.safetensors", "::count", "negative"],
    ),
    "scores_in/future-version": (
        lambda info, tmp, good: dict(sparsity=0.25, scores_in=str(_future(good, tmp))),
        ["future.s.safetensors", "version 2"],
    ),
    "scores_in/other-expert-count": (
        lambda info, tmp, good: dict(sparsity=0.25, scores_in=str(_other_count(info, tmp))),
        ["16 experts per layer", "the model has 8"],
    ),
    "scores_in/other-layers": (
        lambda info, tmp, good: dict(
            sparsity=0.25,
            scores_in=str(
                save_scores_variant(
                    good,
                    tmp / "layers.s.safetensors",
                    lambda L: L.update({"model.layers.9.mlp": L.pop(info.moe_blocks[1])}),
                )
            ),
        ),
        ["does not cover the model's MoE layers", "{L1}"],
    ),
    "plan_in/duplicate-ids": (
        lambda info, tmp, good: dict(
            plan_in=str(_plan_file(tmp, {b: [0, 1, 1, 2, 3, 4] for b in info.moe_blocks}))
        ),
        ["plan.json", "unique", "{L0}"],
    ),
    "plan_in/out-of-range": (
        lambda info, tmp, good: dict(
            plan_in=str(_plan_file(tmp, {b: [0, 1, 2, 3, 4, 9] for b in info.moe_blocks}))
        ),
        ["plan.json", "[0, 8)", "9"],
    ),
    "plan_in/missing-layer": (
        lambda info, tmp, good: dict(
            plan_in=str(_plan_file(tmp, {info.moe_blocks[0]: [0, 1, 2, 3, 4, 5]}))
        ),
        ["plan.json", "{L1}"],
    ),
    "plan_in/another-model": (
        lambda info, tmp, good: dict(
            plan_in=str(
                _plan_file(tmp, {b: list(range(8)) for b in info.moe_blocks}, num_experts=16)
            )
        ),
        ["plan.json", "16 experts", "8"],
    ),
    "plan_in/future-version": (
        lambda info, tmp, good: dict(
            plan_in=str(
                _plan_file(tmp, {b: [0, 1, 2, 3, 4, 5] for b in info.moe_blocks}, version=2)
            )
        ),
        ["plan.json", "version 2"],
    ),
    "plan_in/not-json": (
        lambda info, tmp, good: dict(plan_in=str(_write(tmp / "plan.json", "[1,"))),
        ["plan.json", "not valid JSON"],
    ),
    "plan_in/kept-not-a-mapping": (
        lambda info, tmp, good: dict(plan_in=str(_plan_file(tmp, [[0, 1, 2, 3, 4, 5]]))),
        ["plan.json", "kept"],
    ),
}


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _future(good, tmp) -> Path:
    p = good.save(tmp / "future.s.safetensors")
    set_scores_metadata(p, version=2)
    return p


def _other_count(info, tmp) -> Path:
    fixture = SimpleNamespace(
        moe_blocks=list(info.moe_blocks),
        num_experts=16,
        top_k=info.top_k,
        n_group=None,
        topk_group=None,
        family="qwen3_moe",
    )
    write_scores(tmp / "e16.s.safetensors", fixture)
    return tmp / "e16.s.safetensors"


@pytest.mark.parametrize("name", sorted(MODIFIER_CASES))
def test_modifier_bad_input(name, tiny_qwen, tmp_path):
    """The modifier refuses bad ``scores_in`` / ``plan_in`` (when the recipe is parsed,
    or in ``on_initialize`` before any change) naming the file and the problem; the
    model is untouched and no output (manifest, report, their folders) is written."""
    from llmcompressor.core import State
    from pydantic import ValidationError

    from reap_modifier import REAPPruningModifier

    _, info = tiny_qwen
    model = _fresh_qwen(tiny_qwen)
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    good = _model_scores(info, inputs)
    make, needles = MODIFIER_CASES[name]
    kwargs = make(info, inputs, good)
    needles = [
        n.replace("{L0}", info.moe_blocks[0]).replace("{L1}", info.moe_blocks[1]) for n in needles
    ]
    outputs = dict(
        manifest_path=str(tmp_path / "out" / "m.json"), report_path=str(tmp_path / "rep" / "r.json")
    )
    before = snapshot(tmp_path)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises((ValueError, ValidationError)) as err:
        modifier = REAPPruningModifier(**kwargs, **outputs)
        modifier.on_initialize(State(model=model))
    message = str(err.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    assert snapshot(tmp_path) == before, "something was written"
    after = model.state_dict()
    assert set(after) == set(weights) and all(torch.equal(after[k], weights[k]) for k in weights)
    assert model.config.num_local_experts == info.num_experts
