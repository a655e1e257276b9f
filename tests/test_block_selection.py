"""Block-error expert selection (:mod:`reap_modifier.post_cut.block_selection`).

The evaluator's error of a kept set is compared with the error of the real block routed
as if the other experts did not exist, by the masked-routing oracle
(:mod:`generic_oracle`, which adds ``-inf`` to the dropped experts' router logits and
biases and never imports the product), on tiny models of each router kind the module
models: Kimi K3 (latent MoE, score-correction bias; flat and group-limited, sigmoid and
softmax), DeepSeek-V3 (sigmoid, bias, group-limited) and Qwen3-MoE (softmax top-k).
"""

from __future__ import annotations

import pytest
import torch
from family_routing import spread_biases_
from generic_oracle import masked_block_errors
from tiny_models import build_tiny

from reap_modifier.models import find_moe_architecture
from reap_modifier.post_cut import BlockSelectionError
from reap_modifier.post_cut.block_selection import BlockErrorEvaluator, select_by_block_error

N_TOKENS = 96

VARIANTS = {
    "kimi_k3": ("kimi_k3", {}),
    "kimi_k3-grouped": ("kimi_k3", {"num_expert_group": 4, "topk_group": 2}),
    "kimi_k3-softmax": ("kimi_k3", {"moe_router_activation_func": "softmax"}),
    "deepseek_v3": ("deepseek_v3", {}),
    "qwen3_moe": ("qwen3_moe", {}),
}


def _setup(variant: str, seed: int = 0):
    family, overrides = VARIANTS[variant]
    model, info = build_tiny(family, seed=seed, **overrides)
    if family != "qwen3_moe":
        spread_biases_(model, family, seed=seed)
    arch = find_moe_architecture(model)
    layer = arch.layers[0]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N_TOKENS, info.hidden_size, generator=gen)
    with torch.no_grad():
        y = layer.block(x[None])
    y = (y[0] if isinstance(y, tuple) else y).reshape(N_TOKENS, -1)
    return model, family, arch, layer, x, y


def _random_kept(E: int, keep: int, n_group: int, gen: torch.Generator) -> list[int]:
    size, kept = E // n_group, []
    for g in range(n_group):
        kept += (torch.randperm(size, generator=gen)[: keep // n_group] + g * size).tolist()
    return sorted(kept)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_evaluator_error_equals_masked_block(variant):
    model, family, arch, layer, x, y = _setup(variant)
    groups = torch.arange(N_TOKENS) % 3
    ev = BlockErrorEvaluator(layer, x, y, groups, extra_slots=2)
    E, gen = arch.num_experts, torch.Generator().manual_seed(1)
    n_group = arch.n_group if arch.group_limited else 1
    # a quarter where the router can still reach top_k experts (group-limited: 2 per group)
    for keep in (E // 2, E // 4 if n_group == 1 else 3 * E // 4):
        for _ in range(3):
            kept = _random_kept(E, keep, n_group, gen)
            mask = torch.zeros(1, E, dtype=torch.bool)
            mask[0, kept] = True
            got = ev.errors(mask)[0].tolist()
            want = masked_block_errors(layer.block, family, x, y, kept, groups)
            assert got == pytest.approx(want, rel=1e-4, abs=1e-6), (variant, kept)
            assert max(want) > 1e-3  # a real cut, not a trivially equal zero
    # the cache started small, so some kept sets routed tokens to uncached experts
    assert ev.expert_calls > N_TOKENS * (arch.top_k + 2)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_incremental_drop_errors_equal_full_evaluation(variant):
    """One step's trials, each re-routing only the tokens the drop can change, equal the
    full evaluation of every trial set (mid-search: a quarter of the experts gone)."""
    _, _, arch, layer, x, y = _setup(variant)
    groups = torch.arange(N_TOKENS) % 3
    ev = BlockErrorEvaluator(layer, x, y, groups)
    E, gen = arch.num_experts, torch.Generator().manual_seed(2)
    n_group = arch.n_group if arch.group_limited else 1
    kept = torch.zeros(E, dtype=torch.bool)
    kept[_random_kept(E, 3 * E // 4, n_group, gen)] = True
    candidates = kept.nonzero().flatten()
    trial = kept[None].repeat(candidates.numel(), 1)
    trial[torch.arange(candidates.numel()), candidates] = False
    got = ev.drop_errors(kept, candidates)
    want = ev.errors(trial)
    # rtol: a softmax over fewer experts rounds the unchanged tokens' weights differently
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-12)


def test_keep_all_is_identity():
    _, _, arch, layer, x, y = _setup("kimi_k3")
    kept, record = select_by_block_error(layer, x, y, arch.num_experts)
    assert kept == list(range(arch.num_experts))
    assert record.steps == [] and record.objective < 1e-6


@pytest.mark.parametrize("variant", ["kimi_k3-grouped", "deepseek_v3"])
def test_group_limited_counts_are_equal(variant):
    _, _, arch, layer, x, y = _setup(variant)
    assert arch.group_limited
    E, n_group = arch.num_experts, arch.n_group
    keep = E // 2
    kept, record = select_by_block_error(layer, x, y, keep, drops_per_step=3)
    size = E // n_group
    assert [sum(1 for e in kept if e // size == g) for g in range(n_group)] == [
        keep // n_group
    ] * n_group
    assert len(kept) == keep and sum(len(s["dropped"]) for s in record.steps) == E - keep
    with pytest.raises(BlockSelectionError, match="multiple of n_group"):
        select_by_block_error(layer, x, y, keep + 1)
    with pytest.raises(BlockSelectionError, match="reachable"):
        select_by_block_error(layer, x, y, n_group)


def test_greedy_drops_the_cheapest_expert_first():
    """Each step drops the candidate whose removal raises the error least (checked by
    evaluating every single drop with the evaluator's own error, and the record's)."""
    _, _, arch, layer, x, y = _setup("qwen3_moe")
    E = arch.num_experts
    ev = BlockErrorEvaluator(layer, x, y)
    trials = torch.ones(E, E, dtype=torch.bool)
    trials[torch.arange(E), torch.arange(E)] = False
    single = ev.errors(trials)[:, 0]
    kept, record = select_by_block_error(layer, x, y, E - 1)
    assert record.steps[0]["dropped"] == [int(single.argmin())]
    assert record.objective == pytest.approx(float(single.min()), rel=1e-9)


def test_candidates_follow_the_ranking():
    """With one candidate per step the search is the ranking's cut: lowest dropped first."""
    _, _, arch, layer, x, y = _setup("kimi_k3")
    E = arch.num_experts
    ranking = torch.randn(E, generator=torch.Generator().manual_seed(3))
    keep = E // 2
    kept, record = select_by_block_error(layer, x, y, keep, ranking=ranking, candidates=1)
    assert kept == sorted(ranking.argsort(descending=True)[:keep].tolist())
    assert record.evaluations == (E - keep) + 1  # one trial per step, plus the final set


def test_a_baseline_no_worse_than_the_search_is_kept():
    """``baseline``: kept when the search finds no lower objective (a search forced through
    the worst-ranked candidates against the unrestricted search's set), else the search's
    set; the record holds the search's objective, the baseline's and the kept set's, each
    equal to the masked-routing oracle's error of its set."""
    _, family, arch, layer, x, y = _setup("kimi_k3")
    E, keep = arch.num_experts, arch.num_experts // 2
    groups = torch.zeros(N_TOKENS, dtype=torch.long)
    good, good_record = select_by_block_error(layer, x, y, keep)
    # candidates=1 with the best set ranked lowest: the search drops the best experts
    ranking = torch.zeros(E)
    ranking[good] = -1.0
    bad, bad_record = select_by_block_error(layer, x, y, keep, ranking=ranking, candidates=1)
    (good_error,) = masked_block_errors(layer.block, family, x, y, good, groups)
    (bad_error,) = masked_block_errors(layer.block, family, x, y, bad, groups)
    assert set(bad).isdisjoint(good) and bad_error > 1.5 * good_error
    kept, record = select_by_block_error(
        layer, x, y, keep, ranking=ranking, candidates=1, baseline=good
    )
    assert kept == good and record.kept_baseline
    assert record.search_objective == pytest.approx(bad_error, rel=1e-4)
    assert record.baseline_objective == pytest.approx(good_error, rel=1e-4)
    assert record.objective == pytest.approx(good_error, rel=1e-4)
    kept, record = select_by_block_error(layer, x, y, keep, baseline=bad)
    assert kept == good and not record.kept_baseline
    assert record.search_objective == pytest.approx(good_error, rel=1e-4)
    assert record.baseline_objective == pytest.approx(bad_error, rel=1e-4)
    assert record.objective == pytest.approx(good_error, rel=1e-4)
    with pytest.raises(BlockSelectionError, match="baseline must hold 8 distinct experts"):
        select_by_block_error(layer, x, y, keep, baseline=good[:-1])


def test_group_balance_changes_the_choice():
    """A small group of tokens that needs experts the bulk of the tokens does not: the
    pooled objective sacrifices it, the worst-group objective keeps what it needs."""
    _, _, arch, layer, x, y = _setup("kimi_k3")
    E, keep = arch.num_experts, arch.num_experts // 2
    ev_pool = BlockErrorEvaluator(layer, x, y)
    # the small group: the 8 tokens whose error grows most when the pooled choice is cut
    pooled, _ = select_by_block_error(layer, x, y, keep)
    mask = torch.zeros(1, E, dtype=torch.bool)
    mask[0, pooled] = True
    worst = ev_pool.token_errors(mask)[0] / y.double().pow(2).sum(-1)
    groups = torch.zeros(N_TOKENS, dtype=torch.long)
    groups[worst.topk(8).indices] = 1
    balanced, record = select_by_block_error(layer, x, y, keep, groups=groups)
    assert balanced != pooled
    ev = BlockErrorEvaluator(layer, x, y, groups)
    both = torch.zeros(2, E, dtype=torch.bool)
    both[0, pooled], both[1, balanced] = True, True
    err = ev.errors(both)  # [2 sets, 2 groups]
    assert float(err[1].max()) < float(err[0].max())  # better for the worst group
    assert record.objective == pytest.approx(float(err[1].max()), rel=1e-9)


def test_bad_input_is_refused_clearly():
    _, _, arch, layer, x, y = _setup("kimi_k3")
    with pytest.raises(BlockSelectionError, match="must both be"):
        select_by_block_error(layer, x, y[:-1], 8)
    with pytest.raises(BlockSelectionError, match="one label per token"):
        select_by_block_error(layer, x, y, 8, groups=torch.zeros(3, dtype=torch.long))
    with pytest.raises(BlockSelectionError, match=r"keep=2 must be in \[top_k="):
        select_by_block_error(layer, x, y, 2)
    with pytest.raises(BlockSelectionError, match="ranking"):
        select_by_block_error(layer, x, y, 8, ranking=torch.zeros(3))
    with pytest.raises(BlockSelectionError, match="not this block's outputs"):
        select_by_block_error(layer, x, y * 1.5, 8)


def test_unmodelled_router_is_refused():
    model, _ = build_tiny("olmoe")
    layer = find_moe_architecture(model).layers[0]
    x = torch.randn(4, model.config.hidden_size)
    with pytest.raises(BlockSelectionError, match="use selection: saliency"):
        select_by_block_error(layer, x, x, 4)
