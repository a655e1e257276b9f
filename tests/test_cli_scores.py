"""``reap scores ...``, ``reap cut``, ``reap tiers``, ``reap compare`` through typer's runner."""

from __future__ import annotations

import json

import pytest
import torch
from scores_synth import LAYERS, accumulate, big_scores, routing
from test_baselines import _write_checkpoint
from typer.testing import CliRunner

from reap_modifier.cli import app
from reap_modifier.scores import ExpertScores
from reap_modifier.scores.plan import PruningPlan, plan_from_scores

runner = CliRunner()


def _run(*args, ok=True):
    result = runner.invoke(app, [str(a) for a in args])
    if ok:
        assert result.exit_code == 0, (result.output, result.exception)
    return result


@pytest.fixture()
def files(tmp_path):
    en = routing(200, 8, 2, seed=1)
    en2 = routing(200, 8, 2, seed=2)
    zh = routing(150, 8, 2, seed=3, prefer=[5, 6])
    a = accumulate(None, [("en", *en)]).save(tmp_path / "A.scores")
    en2_file = accumulate(None, [("en", *en2)]).save(tmp_path / "en2.scores")
    zh_file = accumulate(None, [("zh", *zh)]).save(tmp_path / "zh.scores")
    joint = accumulate(None, [("en", *en), ("en", *en2), ("zh", *zh)])
    return {"A": a, "en2": en2_file, "zh": zh_file, "joint": joint, "dir": tmp_path}


def test_merge_show_cut(files):
    d = files["dir"]
    _run("scores", "merge", files["A"], files["en2"], "-o", d / "B.scores")
    out = _run("scores", "merge", d / "B.scores", files["zh"], "-o", d / "C.scores").output
    assert "tokens en=400, zh=150" in out
    merged = ExpertScores.load(d / "C.scores")
    for layer in LAYERS:
        for stat, t in files["joint"].layers[layer].items():
            assert torch.equal(merged.layers[layer][stat], t), (layer, stat)
    shown = _run("scores", "show", d / "C.scores").output
    for needle in (
        "tokens[en]",
        "tokens[zh]",
        "total tokens",
        "550",
        "model.layers.2.mlp",
        "never routed",
        "median @zh",
        "SynthMoeForCausalLM",
    ):
        assert needle in shown, needle
    out = _run(
        "cut", d / "C.scores", "--sparsity", "0.5", "--divisible-by", "3", "-o", d / "plan.json"
    ).output
    assert "keep 3 of 8" in out and "rounded 4 down to 3" in out
    plan = PruningPlan.load(d / "plan.json")
    expected = plan_from_scores(merged, sparsity=0.5, divisible_by=3)
    assert plan.kept == expected.kept and plan.saliency == "reap"
    assert plan.params["scores"]["sha256"] and plan.params["divisible_by"] == 3
    _run("cut", d / "C.scores", "--keep", "4", "--saliency", "frequency", "-o", d / "f.json")
    assert (
        PruningPlan.load(d / "f.json").kept
        == plan_from_scores(merged, num_experts_to_keep=4, saliency="frequency").kept
    )


def test_tiers_greedy_keep_and_outputs(files, tmp_path):
    path = big_scores(6, 896, seed=0).save(tmp_path / "big.scores")
    res = _run("tiers", path, "--keep", 672, 448, 384, 224, "-o", tmp_path / "tiers")
    assert "Is there a knee?" in res.output and "No knee between keep 672 and 224" in res.output
    data = json.loads((tmp_path / "tiers" / "tiers.json").read_text())
    assert [t["keep"] for t in data["tiers"]] == [672, 448, 384, 224]
    assert (tmp_path / "tiers" / "tiers.png").stat().st_size > 1000
    # repeated flags and sparsities give the same tiers
    res2 = _run("tiers", path, "--keep", 672, "--sparsity", 0.5, 0.75)
    assert "448" in res2.output and "224" in res2.output and "672" in res2.output


def test_compare_cli(files):
    d = files["dir"]
    _run("scores", "merge", files["A"], files["en2"], "-o", d / "B.scores")
    _run("scores", "merge", d / "B.scores", files["zh"], "-o", d / "C.scores")
    res = _run(
        "compare",
        files["A"],
        d / "B.scores",
        d / "C.scores",
        "--keep",
        4,
        "--corpus-of",
        "B=en",
        "C=en+zh",
        "--per-source",
        f"en={d / 'B.scores'}",
        f"zh={files['zh']}",
        "-o",
        d / "cmp",
    )
    assert "A -> B" in res.output and "B -> C" in res.output
    data = json.loads((d / "cmp" / "compare.json").read_text())
    assert [r["corpus"] for r in data["rankings"]] == ["en", "en", "en+zh"]
    assert data["routing_sources"]["zh"].startswith("per-source file")
    assert {p["earlier"] + p["later"] for p in data["pairs"]} == {"AB", "AC", "BC"}
    for name in ("compare.md", "flips_per_layer.png", "routing_ratio.png"):
        assert (d / "cmp" / name).exists()
    bad = _run(
        "compare",
        files["A"],
        d / "B.scores",
        "--keep",
        4,
        "--corpus-of",
        "Z=en",
        "-o",
        d / "cmp2",
        ok=False,
    )
    assert bad.exit_code == 2 and "unknown rankings ['Z']" in bad.output


def test_from_weights_cli(tmp_path):
    ckpt = _write_checkpoint(tmp_path / "ckpt")
    out = _run(
        "scores", "from-weights", ckpt, "--method", "router_l1", "-o", tmp_path / "l1.scores"
    )
    assert "router_l1 for 2 MoE layers x 4 experts" in out.output
    _run("scores", "show", tmp_path / "l1.scores")
    _run("cut", tmp_path / "l1.scores", "--keep", 2, "-o", tmp_path / "p.json")
    plan = PruningPlan.load(tmp_path / "p.json")
    assert plan.saliency == "router_l1"
    assert plan.kept == {"model.layers.1.mlp": [0, 2], "model.layers.2.mlp": [0, 3]}
    _run(
        "scores",
        "from-weights",
        ckpt,
        "--method",
        "random",
        "--seed",
        3,
        "-o",
        tmp_path / "r.scores",
    )
    assert ExpertScores.load(tmp_path / "r.scores").metadata["seed"] == 3
    bad = _run(
        "scores", "from-weights", ckpt, "--method", "router_l3", "-o", tmp_path / "x", ok=False
    )
    assert bad.exit_code == 2 and "'router_l3' is not one of" in " ".join(bad.output.split())
    bad = _run(
        "cut",
        tmp_path / "l1.scores",
        "--keep",
        2,
        "--saliency",
        "reap",
        "-o",
        tmp_path / "x.json",
        ok=False,
    )
    assert bad.exit_code == 2 and "calibration-free baseline 'router_l1'" in bad.output


def test_cli_errors(files):
    d = files["dir"]
    data = files["A"].read_bytes()
    (d / "trunc.scores").write_bytes(data[: len(data) // 3])
    for args, needle in [
        (("scores", "show", d / "trunc.scores"), "cannot read scores file"),
        (("cut", d / "trunc.scores", "--keep", 4, "-o", d / "p.json"), "cannot read scores file"),
        (("cut", files["A"], "--keep", 4, "--sparsity", 0.5, "-o", d / "p.json"), "exactly one"),
        (("cut", files["A"], "--keep", 1, "-o", d / "p.json"), "fewer than top_k=2"),
        (
            ("cut", files["A"], "--keep", 4, "--saliency", "bogus", "-o", d / "p.json"),
            "'bogus' is not one of",
        ),
        (
            ("cut", files["A"], "--keep", 4, "--saliency", "router_l1", "-o", d / "p.json"),
            "reap scores from-weights",
        ),
        (
            ("scores", "merge", files["A"], d / "missing.scores", "-o", d / "m.scores"),
            "does not exist",
        ),
        (("tiers", files["A"]), "give tiers with --keep"),
    ]:
        res = _run(*args, ok=False)
        assert res.exit_code == 2, (args, res.output)
        assert needle in res.output, (args, res.output)
    other = accumulate(None, [("en", *routing(20, 16, 2, 1))], num_experts=16).save(d / "o.scores")
    res = _run("scores", "merge", files["A"], other, "-o", d / "m.scores", ok=False)
    assert res.exit_code == 2 and "num_experts 8 != 16" in res.output and "o.scores" in res.output
    assert not (d / "m.scores").exists()
    res = _run("compare", files["A"], other, "--keep", 4, "-o", d / "c", ok=False)
    assert res.exit_code == 2 and "different expert counts (8 != 16)" in res.output


def test_show_prints_what_each_rank_observed(files):
    """World size and each rank's samples / tokens / padding, per run; a merge keeps
    every run's record."""
    d = files["dir"]
    a = ExpertScores.load(files["A"])
    a.metadata["calibration"] = {
        "source": "en",
        "world_size": 2,
        "samples": 7,
        "tokens": 200,
        "padding_skipped": 26,
        "ranks": [
            {"rank": 0, "samples": 4, "tokens": 131, "padding": 15},
            {"rank": 1, "samples": 3, "tokens": 69, "padding": 11},
        ],
    }
    a.save(d / "ranked.scores")
    zh = ExpertScores.load(files["zh"])
    zh.metadata["calibration"] = {
        "source": "zh",
        "world_size": 1,
        "samples": 5,
        "tokens": 150,
        "padding_skipped": 0,
        "ranks": [{"rank": 0, "samples": 5, "tokens": 150, "padding": 0}],
    }
    zh.save(d / "single.scores")
    shown = _run("scores", "show", d / "ranked.scores").output
    rows = [line.replace("│", " ").split() for line in shown.splitlines() if "│" in line]
    assert ["1", "en", "2", "0", "4", "131", "15"] in rows
    assert ["1", "en", "2", "1", "3", "69", "11"] in rows
    assert ["1", "en", "2", "all", "7", "200", "26"] in rows

    _run("scores", "merge", d / "ranked.scores", d / "single.scores", "-o", d / "m.scores")
    merged = ExpertScores.load(d / "m.scores")
    assert [r["source"] for r in merged.calibration_runs()] == ["en", "zh"]
    rows = [
        line.replace("│", " ").split()
        for line in _run("scores", "show", d / "m.scores").output.splitlines()
        if "│" in line
    ]
    assert ["1", "en", "2", "all", "7", "200", "26"] in rows
    assert ["2", "zh", "1", "0", "5", "150", "0"] in rows
