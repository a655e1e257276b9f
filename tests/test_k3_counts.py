"""The whole recipe at Kimi K3's counts, cut down for CI: K3's vocabulary (163,840) and
expert counts (896 routed, top-16, one shared) on 3 MoE layers with tiny widths, the
routed experts MXFP4 on disk. ``oneshot`` runs REAP with ``checkpoint_dir``, the
block-error selection, the router, bias and dense fits and the held-out validation, and
saves; ``reap verify --source`` passes; every layer keeps 448 experts; the held-out
check's vocabulary-wide tensors and what the post-cut step allocates stay bounded
(counted by an independent probe). The full 92-layer run, timed per stage, is
``benchmarks/k3_counts.py``."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import calibration_samples, make_dataset, make_tokenizer
from k3_mxfp4_synth import K3Shape, write_k3_mxfp4
from memory_probe import LiveTensors

from reap_modifier import REAPPruningModifier

VOCAB, EXPERTS, KEEP = 163_840, 896, 448
SHAPE = K3Shape(
    hidden=32,
    latent=32,  # MXFP4's scale groups are 32 wide: the smallest latent it packs
    inter=32,
    experts=EXPERTS,
    top_k=16,
    moe_layers=3,
    dense_layers=1,
    vocab=VOCAB,
    n_group=1,
    topk_group=1,
)
#: 32 samples in batches of one: every 8th held out, 4 held-out samples of 96 tokens
SAMPLES, SEQ = 32, 96
#: the held-out check's promise: logits in bounded chunks (16 MiB blocks), a handful alive
#: at once (before the chunking, 5.3 blocks of 32 MiB were measured), whatever the number
#: of held-out tokens; their full-vocabulary log-probabilities alone would exceed it
WIDE_BOUND = 6 * (1 << 23) * 4
MIB = 1 << 20


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_k3_mxfp4(tmp_path_factory.mktemp("k3c") / "src", SHAPE, shard_bytes=64 << 20)[
        "path"
    ]


def probed_oneshot(src, out, monkeypatch, **fields):
    """``oneshot`` on the MXFP4 source with one modifier; the probes follow the tensors
    the post-cut step allocates (its choose and fit stages, on the unpruned and the cut
    model): all of them, and those as wide as the vocabulary (logits, log-probabilities)."""
    from llmcompressor import oneshot

    from reap_modifier import post_cut

    real = LiveTensors(lambda t: t.device.type != "meta")
    wide = LiveTensors(lambda t: t.device.type != "meta" and t.dim() > 0 and t.shape[-1] == VOCAB)
    for stage in ("choose", "fit"):
        original = getattr(post_cut.PostCutStep, stage)

        def probed(*args, _original=original, **kwargs):
            with real, wide:
                return _original(*args, **kwargs)

        monkeypatch.setattr(post_cut.PostCutStep, stage, probed)
    torch.manual_seed(0)
    dataset = make_dataset(calibration_samples(VOCAB, n=SAMPLES, seq=SEQ, seed=3))
    modifier = REAPPruningModifier(num_experts_to_keep=KEEP, **fields)
    oneshot(
        model=str(src),
        recipe=[modifier],
        processor=make_tokenizer(VOCAB),
        dataset=dataset,
        num_calibration_samples=SAMPLES,
        moe_calibrate_all_experts=False,
        output_dir=str(out),
        shuffle_calibration_samples=False,
    )
    return modifier, real, wide


def test_whole_recipe_at_k3_counts(source, tmp_path, monkeypatch):
    from reap_modifier.checkpoint.verify import verify_checkpoint

    out = tmp_path / "full"
    modifier, real, wide = probed_oneshot(
        source,
        out,
        monkeypatch,
        checkpoint_dir=str(tmp_path / "calibration-checkpoint"),
        selection="block_error",
        selection_candidates=16,
        selection_drops=64,
        calibrate_router=True,
        calibrate_bias=True,
        compensate=True,
        validate_fit=True,
        router_fit_tokens=256,
        router_fit_steps=2,
        compensation_steps=2,
    )
    summary = {
        "plan": sorted({len(k) for k in modifier.plan.kept.values()}),
        "record": modifier.router_fit,
        "post-cut peak MiB": real.peak_bytes / MIB,
        "vocab-wide peak MiB": wide.peak_bytes / MIB,
    }
    # every MoE layer pruned to 448, in the plan and in the saved config
    assert len(modifier.plan.kept) == SHAPE.moe_layers, summary
    assert {len(kept) for kept in modifier.plan.kept.values()} == {KEEP}, summary
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["num_experts"] == KEEP
    # each component was fitted and judged on the held-out samples
    record = modifier.router_fit
    assert [c["name"] for c in record["components"]] == ["router", "bias", "dense"], summary
    assert all(c["kl_after"] is not None for c in record["components"]), summary
    assert record["validation"]["batches"] == SAMPLES // 8, summary
    # the saved checkpoint against its MXFP4 source: counts, wholeness, every tensor
    report = verify_checkpoint(out, source=source)
    assert report.ok, report
    # memory: the held-out check holds a bounded chunk of logits at a time, not the
    # held-out tokens' log-probabilities (which alone would exceed the bound here), and
    # what the post-cut step allocates stays small at K3's counts
    held_logits = record["validation"]["tokens"] * VOCAB * 4
    assert held_logits > WIDE_BOUND, "the bound would not see full-vocabulary storage"
    assert real.created > 0 and wide.created > 0, summary
    assert wide.peak_bytes <= WIDE_BOUND, summary
    assert real.peak_bytes <= 256 * MIB, summary
