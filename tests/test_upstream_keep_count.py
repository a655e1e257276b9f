"""The kept count for ``sparsity`` is llm-compressor's own: its modifier's
``on_initialize`` runs in the same test over a grid of expert counts, sparsities and
router groups, and ours must keep the same number of experts (or refuse too)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from llmcompressor.modifiers.pruning.reap import base as upstream_base
from llmcompressor.modifiers.pruning.reap.base import REAPPruningModifier as UpstreamREAP
from llmcompressor.modifiers.pruning.reap.utils import MoeModelAttrs

from reap_modifier.scores.keep_count import PlanError, compute_keep_count

EXPERTS = [8, 16, 64, 100, 128, 160, 256, 384, 896]
SPARSITIES = [0.001, 0.05, 0.1, 0.2, 0.25, 0.29, 0.3, 0.33, 0.5, 0.6, 0.7, 0.75, 0.9, 0.97]
# (n_group, topk_group): flat, group-limited, and n_group = 1 (upstream's group path,
# a flat cut for us: the same count)
GROUPS = [(None, None), (8, 4), (4, 2), (8, 1), (2, 1), (1, 1), (4, 4), (8, 8)]
TOP_KS = [2, 8]


def upstream_keep(monkeypatch, num_experts, top_k, sparsity, n_group, topk_group):
    """Kept count of llm-compressor's REAPPruningModifier, or None when it refuses."""
    attrs = MoeModelAttrs(
        num_experts_config_key="num_experts",
        router_attr="gate",
        experts_attr="experts",
        moe_layer_names=["model.layers.0.mlp"],
        num_experts=num_experts,
        top_k=top_k,
        has_text_config=False,
        n_group=n_group,
        top_k_group=topk_group,
        group_size=num_experts // n_group if n_group else None,
    )
    monkeypatch.setattr(upstream_base, "get_moe_attrs", lambda model, ignore: attrs)
    modifier = UpstreamREAP(sparsity=sparsity)
    try:
        modifier.on_initialize(SimpleNamespace(model=None))
    except ValueError:
        return None
    return num_experts - modifier._n_experts_to_drop


def ours_keep(num_experts, top_k, sparsity, n_group, topk_group):
    try:
        return compute_keep_count(
            num_experts, top_k, sparsity=sparsity, n_group=n_group, topk_group=topk_group
        ).keep
    except PlanError:
        return None


def test_kept_count_equals_upstream_over_a_grid(monkeypatch):
    checked = refused = 0
    for e, s, (n, tg), k in itertools.product(EXPERTS, SPARSITIES, GROUPS, TOP_KS):
        if n and e % n:
            continue
        theirs = upstream_keep(monkeypatch, e, k, s, n, tg)
        ours = ours_keep(e, k, s, n, tg)
        assert ours == theirs, f"E={e} sparsity={s} n_group={n} topk_group={tg} top_k={k}"
        checked += 1
        refused += theirs is None
    assert checked > 1000 and 0 < refused < checked


@pytest.mark.parametrize(
    "num_experts, sparsity, groups, keep",
    [
        (8, 0.2, (None, None), 7),
        (100, 0.29, (None, None), 72),
        (128, 0.6, (None, None), 52),
        (896, 0.3, (None, None), 628),
        (64, 0.3, (8, 4), 48),
        (256, 0.2, (8, 4), 208),
    ],
)
def test_the_documented_examples(monkeypatch, num_experts, sparsity, groups, keep):
    assert ours_keep(num_experts, 2, sparsity, *groups) == keep
    assert upstream_keep(monkeypatch, num_experts, 2, sparsity, *groups) == keep


def test_our_fields_apply_on_top_and_are_recorded():
    # upstream's 628, then divisible_by 8 -> 624
    kc = compute_keep_count(896, 16, sparsity=0.3, divisible_by=8)
    assert (kc.requested, kc.keep) == (628, 624)
    assert kc.adjustments == ("rounded 628 down to 624 (divisible_by=8)",)
    # group-limited: 48 (upstream), then lcm(5, 8) = 40
    kc = compute_keep_count(64, 2, sparsity=0.3, n_group=8, topk_group=4, divisible_by=5)
    assert (kc.requested, kc.keep, kc.per_group) == (45, 40, 5)
    assert kc.adjustments[0].startswith("dropping 2 experts in each of 8 groups (16 instead of 19")
    assert kc.adjustments[1] == "rounded 48 down to 40 (divisible_by=5, n_group=8: lcm 40)"


def test_a_sparsity_that_drops_nothing_is_refused():
    with pytest.raises(PlanError, match=r"int\(100 x 0.001\) = 0 .* at least 0.01"):
        compute_keep_count(100, 2, sparsity=0.001)
    with pytest.raises(PlanError, match=r"round\(3 / n_group=8\) = 0 per group"):
        compute_keep_count(64, 2, sparsity=0.05, n_group=8, topk_group=4)
