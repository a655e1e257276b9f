"""What calibration data reaches the observer, in one process: padded positions never
count (direct calls, oneshot's basic and sequential pipelines), the sequential
pipeline runs the model's own causal attention, and the sampler that shares one
dataset across ranks selects what a single process would."""

from __future__ import annotations

import pytest
import torch
from conftest import calibrate, make_tokenizer
from test_saliency_oracle import observe
from tiny_models import FAMILIES, batch_invariant_numerics, build_tiny, reload_class

from reap_modifier import REAPPruningModifier
from reap_modifier.calibration.observer import SaliencyObserver
from reap_modifier.calibration.tokens import BatchTokens
from reap_modifier.compat import RankShareSampler
from reap_modifier.models import find_moe_architecture

LENGTHS = (12, 7, 9, 3, 12, 5, 10, 8)


def _samples(vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=gen) for n in LENGTHS]


def _assert_close(a, b, rtol=1e-9):
    assert a.metadata["tokens"] == b.metadata["tokens"]
    for layer, stats in a.layers.items():
        for stat, t in stats.items():
            torch.testing.assert_close(
                t,
                b.layers[layer][stat],
                rtol=rtol,
                atol=1e-12,
                msg=lambda m, s=stat, l=layer: f"{l}::{s}: {m}",
            )


def _observe_batches(model, batches) -> tuple:
    """Direct model calls with the observer (mask from the model's own call)."""
    handles = []

    def register(module, fn, hook_type, **kw):
        handles.append(getattr(module, f"register_{hook_type}_hook")(fn, **kw))

    observer = SaliencyObserver(find_moe_architecture(model), register, model=model)
    observer.attach()
    try:
        with torch.no_grad():
            for batch in batches:
                model(**batch, use_cache=False)
    finally:
        for h in handles:
            h.remove()
        observer.detach()
    return observer.to_scores("unit"), observer.local_counts()


@pytest.mark.parametrize("family", ["qwen3_moe", "kimi_k3"])
def test_padded_positions_never_count_direct(family):
    from transformers import DataCollatorWithPadding

    model, info = build_tiny(family, seed=31, dtype=torch.float64)
    samples = _samples(info.vocab_size)
    collate = DataCollatorWithPadding(make_tokenizer(info.vocab_size))
    padded = [collate([{"input_ids": s.tolist()} for s in samples[i : i + 4]]) for i in (0, 4)]
    assert (padded[0]["attention_mask"] == 0).any()
    with batch_invariant_numerics():
        plain, plain_counts = _observe_batches(model, [{"input_ids": s[None]} for s in samples])
        got, counts = _observe_batches(model, padded)
    _assert_close(got, plain)
    positions = sum(b["input_ids"].numel() for b in padded)
    assert counts == {"samples": 8, "tokens": sum(LENGTHS), "padding": positions - sum(LENGTHS)}
    assert plain_counts == {"samples": 8, "tokens": sum(LENGTHS), "padding": 0}


def _oneshot(family, path, samples, vocab, **kw):
    model = reload_class(family).from_pretrained(path, dtype=torch.float64).eval()
    modifier = REAPPruningModifier(sparsity=0.5)
    calibrate(model, modifier, samples, vocab, **kw)
    return modifier


@pytest.mark.parametrize("family", ["qwen3_moe", "kimi_k3"])
def test_padded_positions_never_count_oneshot(tmp_path, family):
    """Batches of 4 padded to their longest sample == the same samples at batch size 1,
    through the sequential pipeline (batches from its cache) and the basic one (the
    model's own call), with calibrate-all on and off."""
    model, info = build_tiny(family, seed=31, dtype=torch.float64)
    model.save_pretrained(tmp_path)
    samples = _samples(info.vocab_size)
    with batch_invariant_numerics():
        plain = _oneshot(family, tmp_path, samples, info.vocab_size)
        plain_routed = _oneshot(
            family, tmp_path, samples, info.vocab_size, moe_calibrate_all_experts=False
        )
        sequential = _oneshot(
            family, tmp_path, samples, info.vocab_size, batch_size=4, data_collator="padding"
        )
        basic = _oneshot(
            family,
            tmp_path,
            samples,
            info.vocab_size,
            batch_size=4,
            data_collator="padding",
            pipeline="basic",
            moe_calibrate_all_experts=False,
        )
    assert plain.scores.metadata["calibration"]["padding_skipped"] == 0
    for run, reference in ((sequential, plain), (basic, plain_routed)):
        calibration = run.scores.metadata["calibration"]
        assert calibration["padding_skipped"] > 0
        assert (calibration["samples"], calibration["tokens"]) == (8, sum(LENGTHS))
        _assert_close(run.scores, reference.scores)
        assert run.plan.kept == reference.plan.kept


@pytest.mark.parametrize("family", FAMILIES)
def test_sequential_pipeline_runs_causal_attention(tmp_path, family):
    """oneshot's sequential pipeline observes what a direct forward of the model
    observes (llm-compressor 0.14.0.1 rebuilt the traced config without its attention
    implementation, and Qwen3-MoE / Mixtral then attended without any mask)."""
    model, info = build_tiny(family, seed=31, dtype=torch.float64)
    model.save_pretrained(tmp_path)
    samples = _samples(info.vocab_size)[:3]
    reference_model = (
        reload_class(family)
        .from_pretrained(
            tmp_path,
            dtype=torch.float64,
            attn_implementation="eager",
            experts_implementation="eager",
        )
        .eval()
    )
    reference = observe(reference_model, [s[None] for s in samples], False)
    got = _oneshot(
        family, tmp_path, samples, info.vocab_size, moe_calibrate_all_experts=False
    ).scores
    for layer, stats in reference.layers.items():
        for stat, t in stats.items():
            if not stat.startswith("count@"):
                torch.testing.assert_close(got.layers[layer][stat], t, rtol=1e-12, atol=1e-12)


def test_mask_that_does_not_fit_the_routed_tokens_is_an_error():
    model, _ = build_tiny("qwen3_moe", seed=31)
    arch = find_moe_architecture(model)
    observer = SaliencyObserver(arch, lambda *a, **k: None)
    observer._batches.call = BatchTokens(2, 10, torch.tensor([True] * 9 + [False]))
    hidden = torch.zeros(2, 6, 32)
    with pytest.raises(
        RuntimeError, match="routes 12 positions but the batch's attention mask covers 10"
    ):
        observer._block_pre(arch.layers[0].name, arch.layers[0].block, (hidden,), {})
    # a mask without padding says nothing about positions: no error, all count
    observer._batches.call = BatchTokens(2, 12)
    observer._block_pre(arch.layers[0].name, arch.layers[0].block, (hidden,), {})


def _lengths_dataset(lengths):
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": [[5] * n for n in lengths]})


def test_rank_shares_cover_the_single_process_selection():
    from llmcompressor.datasets.utils import LengthAwareSampler

    lengths = [4, 9, 2, 9, 7, 1, 5, 8, 3]
    ds = _lengths_dataset(lengths)
    for requested, world in ((None, 2), (6, 2), (7, 3), (100, 4)):
        chosen = list(LengthAwareSampler(ds, num_samples=min(requested or 9, 9)))
        shares = [list(RankShareSampler(ds, requested, False, 1, r, world)) for r in range(world)]
        assert sorted(i for s in shares for i in s) == sorted(chosen)  # disjoint, complete
        assert [len(s) for s in shares] == [
            len(RankShareSampler(ds, requested, False, 1, r, world)) for r in range(world)
        ]
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
        for share in shares:  # longest first within a rank, as in one process
            assert [lengths[i] for i in share] == sorted((lengths[i] for i in share), reverse=True)
    with pytest.raises(ValueError, match="at least one sample per rank"):
        RankShareSampler(ds, 1, False, 1, 0, 2)
