"""Data-parallel REAP under torchrun (gloo, CPU): identical scores and decisions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reap_modifier.scores import ExpertScores

WORKER = Path(__file__).parent / "dist_worker.py"


def _run(args, cwd, torchrun: bool):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(29500 + os.getpid() % 1000), str(WORKER), *args]
    else:
        cmd = [sys.executable, str(WORKER), *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def _assert_scores_match(a: ExpertScores, b: ExpertScores):
    assert a.layer_names == b.layer_names
    assert a.metadata["tokens"] == b.metadata["tokens"]
    for layer in a.layers:
        for stat, ta in a.layers[layer].items():
            torch.testing.assert_close(ta, b.layers[layer][stat], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("family, split", [("kimi_k3", "even"), ("qwen3_moe", "even"), ("kimi_k3", "uneven")])
def test_two_ranks_match_single_process(tmp_path, family, split):
    single, multi = tmp_path / "single", tmp_path / "multi"
    _run([family, str(multi), split], tmp_path, torchrun=True)
    # the single-process reference calibrates on exactly the union of the shards
    _run([family, str(single), split], tmp_path, torchrun=False)
    s_scores = ExpertScores.load(single / "scores.safetensors")
    m_scores = ExpertScores.load(multi / "scores.safetensors")
    _assert_scores_match(m_scores, s_scores)
    ranks = [json.loads((multi / f"rank{r}.json").read_text()) for r in (0, 1)]
    reference = json.loads((single / "rank0.json").read_text())
    assert ranks[0]["kept"] == ranks[1]["kept"] == reference["kept"]
    # in-memory surgery happened on every rank
    assert all(set(r["router_rows"].values()) == {s_scores.num_experts // 2} for r in ranks)
    # only rank 0 wrote files; the manifest agrees with the plan
    manifest = json.loads((multi / "manifest.json").read_text())
    assert {k: v["kept_original_ids"] for k, v in manifest["layers"].items()} == reference["kept"]
    if split == "uneven":
        assert (ranks[0]["local_tokens"], ranks[1]["local_tokens"]) == (60, 4)
        # rank 1 routed 4 tokens x top-4 into 16 experts: some got nothing locally
        assert ranks[1]["local_never_routed"] > 0


def test_separate_runs_merge_to_the_union(tmp_path):
    """The other way to scale out: calibrate shards anywhere, merge the files, cut."""
    from test_saliency_oracle import observe
    from tiny_models import build_tiny, sample_input_ids

    model, info = build_tiny("kimi_k3", seed=32, dtype=torch.float64)
    batches = [sample_input_ids(info.vocab_size, 1, 12, seed=s) for s in range(4)]
    a, b = observe(model, batches[:3], False), observe(model, batches[3:], False)
    a.save(tmp_path / "a.safetensors")
    b.save(tmp_path / "b.safetensors")
    merged = ExpertScores.load(tmp_path / "a.safetensors").merge(ExpertScores.load(tmp_path / "b.safetensors"))
    union = observe(model, batches, False)
    _assert_scores_match(merged, union)
