"""One definition of a group-limited router, used by the keep count, the cut, the
architecture and the checkpoint binder; the ``n_group > 1`` with no ``topk_group`` case."""

from __future__ import annotations

import pytest
import torch
from conftest import calibration_samples, make_dataset, save_and_reload
from tiny_models import build_tiny, text_config

from reap_modifier import REAPPruningModifier
from reap_modifier.models import find_moe_architecture
from reap_modifier.models.config_keys import group_limit
from reap_modifier.scores.keep_count import PlanError, compute_keep_count
from reap_modifier.scores.plan import cut_plan


@pytest.mark.parametrize(
    "n_group, topk_group, expected",
    [
        (None, None, None),
        (1, None, None),
        (1, 1, None),
        (8, 4, 8),
        (8, 8, None),  # every group is always picked: not limited
        (8, 9, None),
        (4, None, 4),  # absent topk_group reads as 1 (the Kimi modeling default)
    ],
)
def test_group_limit(n_group, topk_group, expected):
    assert group_limit(n_group, topk_group) == expected


def test_absent_topk_group_keeps_an_equal_count_per_group():
    # 10 -> 8 (2 per group of 4); reachability checked with topk_group = 1
    assert compute_keep_count(16, 2, num_experts_to_keep=10, n_group=4).keep == 8
    with pytest.raises(PlanError, match="only 1 experts are reachable"):
        compute_keep_count(16, 2, num_experts_to_keep=4, n_group=4)
    sal = {"m.layers.0.mlp": torch.arange(16, dtype=torch.float64).flip(0)}
    plan = cut_plan(sal, None, num_experts=16, top_k=2, groups=(4, None), keep=10)
    # the two best of every group of 4, although the first group holds the best ten
    assert plan.kept["m.layers.0.mlp"] == [0, 1, 4, 5, 8, 9, 12, 13]
    assert plan.params["num_experts_to_keep_requested"] == 10
    assert plan.params["num_experts_to_keep"] == 8


def test_modifier_on_a_kimi_router_without_topk_group(tokenizer, tmp_path):
    from llmcompressor import oneshot

    model, _ = build_tiny(
        "kimi_k3", seed=3, num_expert_group=4, topk_group=2, num_experts_per_token=2
    )
    model = save_and_reload(model, "kimi_k3", tmp_path / "src")
    cfg = text_config(model)
    del cfg.topk_group  # the router's own default (1) now limits routing to one group
    for block in find_moe_architecture(model).layers:
        block.router.topk_group = 1
    arch = find_moe_architecture(model)
    assert arch.n_group == 4 and arch.topk_group is None and arch.group_limited
    modifier = REAPPruningModifier(num_experts_to_keep=15)  # 15 -> 12: 3 per group
    oneshot(
        model=model,
        recipe=[modifier],
        processor=tokenizer,
        dataset=make_dataset(calibration_samples(64, n=4, seed=5)),
        num_calibration_samples=4,
    )
    assert modifier.plan.num_kept == 12
    for ids in modifier.plan.kept.values():
        assert [sum(1 for i in ids if i // 4 == g) for g in range(4)] == [3, 3, 3, 3]
