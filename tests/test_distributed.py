"""Data-parallel REAP under torchrun (2 ranks, gloo, CPU): the same scores and kept ids
as one process over the same samples, for every way a user hands data to the ranks.

Both launches run every case of ``dist_worker.CASES`` (one process start each):
the same dataset on every rank (llm-compressor partitions it), explicit shards, shuffle
on and off, fewer samples requested than the dataset holds, batch size 1 and 4 with
padding, uneven sample counts, Kimi K3 and Qwen3-MoE.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist_worker import CASES, UNPADDED_TWIN
from launch import launch

from reap_modifier.scores import ExpertScores

WORKER = Path(__file__).parent / "helpers" / "dist_worker.py"


def _run(out: Path, torchrun: bool) -> None:
    launch(WORKER, [str(out)], 2 if torchrun else 1, out.parent)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    _run(root / "multi", torchrun=True)
    _run(root / "single", torchrun=False)
    return root


def _assert_scores_match(a: ExpertScores, b: ExpertScores):
    assert a.layer_names == b.layer_names
    assert a.metadata["tokens"] == b.metadata["tokens"]
    for layer in a.layers:
        assert set(a.layers[layer]) == set(b.layers[layer])
        for stat, ta in a.layers[layer].items():
            torch.testing.assert_close(
                ta,
                b.layers[layer][stat],
                rtol=1e-9,
                atol=1e-12,
                msg=lambda m, s=stat, l=layer: f"{l}::{s}: {m}",
            )


def _load(root: Path, mode: str, case: str):
    scores = ExpertScores.load(root / mode / case / "scores.safetensors")
    ranks = [json.loads(p.read_text()) for p in sorted((root / mode / case).glob("rank*.json"))]
    return scores, ranks


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_match_single_process(runs, case):
    spec = CASES[case]
    single, (reference,) = _load(runs, "single", case)
    multi, ranks = _load(runs, "multi", case)
    _assert_scores_match(multi, single)
    assert len(ranks) == 2 and ranks[0]["kept"] == ranks[1]["kept"] == reference["kept"]
    # in-memory surgery happened on every rank
    keep = single.num_experts // 2
    assert all(set(r["router_rows"].values()) == {keep} for r in ranks)
    # only rank 0 wrote files; the manifest agrees with the plan
    manifest = json.loads((runs / "multi" / case / "manifest.json").read_text())
    assert {k: v["kept_original_ids"] for k, v in manifest["layers"].items()} == reference["kept"]

    # what each rank observed is recorded, and adds up to the single process's run
    run = multi.metadata["calibration"]
    one = single.metadata["calibration"]
    assert run["world_size"] == 2 and one["world_size"] == 1
    per_rank = run["ranks"]
    assert [r["rank"] for r in per_rank] == [0, 1]
    selected = spec.get("num_samples") or len(spec["lengths"])
    if spec["data"] == "same":  # each rank takes every other sample of the selection
        assert [r["samples"] for r in per_rank] == [(selected + 1) // 2, selected // 2]
    else:
        assert [r["samples"] for r in per_rank] == list(spec["shards"])
    assert sum(r["samples"] for r in per_rank) == run["samples"] == one["samples"] == selected
    tokens = sum(r["tokens"] for r in per_rank)
    assert tokens == run["tokens"] == one["tokens"] == multi.total_tokens()
    if spec.get("num_samples") is None:  # every token of the dataset, once
        assert tokens == sum(spec["lengths"])
    padded = spec.get("batch_size", 1) > 1 and len(set(spec["lengths"])) > 1
    assert (run["padding_skipped"] > 0) == padded
    assert run["padding_skipped"] == sum(r["padding"] for r in per_rank)
    if case == "kimi_shards_uneven":
        # rank 1 routed 4 tokens into 16 experts: some got nothing locally
        assert ranks[1]["local_never_routed"] > 0


@pytest.mark.parametrize("case", list(UNPADDED_TWIN))
def test_padded_batches_match_unpadded(runs, case):
    """Batches of 4 padded to their longest sample give the scores of the same
    samples unpadded at batch size 1: in one process and on two ranks."""
    plain, _ = _load(runs, "single", UNPADDED_TWIN[case])
    assert plain.metadata["calibration"]["padding_skipped"] == 0
    for mode in ("single", "multi"):
        padded, _ = _load(runs, mode, case)
        assert padded.metadata["calibration"]["padding_skipped"] > 0
        _assert_scores_match(padded, plain)


def test_separate_runs_merge_to_the_union(tmp_path):
    """The other way to scale out: calibrate shards anywhere, merge the files, cut."""
    from test_saliency_oracle import observe
    from tiny_models import build_tiny, sample_input_ids

    model, info = build_tiny("kimi_k3", seed=32, dtype=torch.float64)
    batches = [sample_input_ids(info.vocab_size, 1, 12, seed=s) for s in range(4)]
    a, b = observe(model, batches[:3], False), observe(model, batches[3:], False)
    a.save(tmp_path / "a.safetensors")
    b.save(tmp_path / "b.safetensors")
    merged = ExpertScores.load(tmp_path / "a.safetensors").merge(
        ExpertScores.load(tmp_path / "b.safetensors")
    )
    union = observe(model, batches, False)
    _assert_scores_match(merged, union)


@pytest.mark.parametrize("case", [c for c, spec in CASES.items() if spec.get("fit")])
def test_post_cut_fit_on_two_ranks_is_the_single_process_fit(runs, case):
    """The post-cut step under data parallel: both ranks report the single process's
    components (kept or dropped, the same held-out KL), and both ranks' models hold the
    single process's fitted tensors, bit for bit (MKL's reproducibility mode pinned by the
    launcher: the ranks calibrate each sample as one process does, to the last bit)."""
    single = runs / "single" / case
    multi = runs / "multi" / case
    (reference,) = [json.loads(p.read_text()) for p in sorted(single.glob("rank*.json"))]
    ranks = [json.loads(p.read_text()) for p in sorted(multi.glob("rank*.json"))]
    assert len(ranks) == 2
    assert reference["post_cut"] and all(c["kl_after"] is not None for c in reference["post_cut"])
    for r in ranks:
        assert [(c["name"], c["kept"]) for c in r["post_cut"]] == [
            (c["name"], c["kept"]) for c in reference["post_cut"]
        ]
        for got, want in zip(r["post_cut"], reference["post_cut"], strict=True):
            assert got["kl_after"] == want["kl_after"]
    want = torch.load(single / "fitted_rank0.pt")
    assert want, "nothing was fitted"
    for rank in (0, 1):
        for kind in ("fitted", "model"):
            got = torch.load(multi / f"{kind}_rank{rank}.pt")
            assert got.keys() == want.keys()
            for layer, named in want.items():
                for name, tensor in named.items():
                    assert torch.equal(got[layer][name], tensor), (rank, kind, layer, name)


@pytest.mark.parametrize("case", [c for c, spec in CASES.items() if spec.get("groups")])
def test_worst_group_selection_on_two_ranks_is_the_single_process_one(runs, case):
    """``selection_groups`` under data parallel: each rank tells its samples' groups, and
    the selection sees the single process's rows in the single process's groups."""
    (reference,) = [
        json.loads(p.read_text()) for p in sorted((runs / "single" / case).glob("rank*.json"))
    ]
    ranks = [json.loads(p.read_text()) for p in sorted((runs / "multi" / case).glob("rank*.json"))]
    want = reference["selection"]
    assert want["objective"] == "worst_group"
    assert want["groups"]["names"] == ["code", "en", "zh"]
    for r in ranks:
        got = r["selection"]
        assert got["groups"] == want["groups"]
        for layer, errors in want["group_errors"].items():
            assert got["group_errors"][layer] == pytest.approx(errors, rel=1e-6), layer
