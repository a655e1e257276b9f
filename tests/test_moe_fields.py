"""The one reader of a model's MoE facts: the same answer for a ``config.json`` dict and a
transformers config, the top level before the nested text configs, every known key."""

from __future__ import annotations

import pytest
from transformers import PretrainedConfig

from reap_modifier.models.moe_fields import config_value, moe_fields


def test_top_level_then_nested_configs():
    config = {
        "architectures": ["Wrapper"],
        "vocab_size": 7,
        "text_config": {"n_routed_experts": 16, "num_experts_per_tok": 4, "vocab_size": 9},
        "language_config": {"n_group": 4, "topk_group": 2},
        "llm_config": {"routed_scaling_factor": 2.5, "num_shared_experts": 1},
    }
    f = moe_fields(config)
    assert (f.num_experts, f.top_k, f.n_group, f.topk_group) == (16, 4, 4, 2)
    assert (f.routed_scaling_factor, f.n_shared_experts) == (2.5, 1)
    assert (f.count_key, f.count_section) == ("n_routed_experts", "text_config")
    assert f.count_keys == {"text_config.n_routed_experts": 16}
    assert f.group_limit == 4
    assert config_value(config, ("vocab_size",)) == 7  # top level first


def test_count_keys_agree_or_not():
    agree = moe_fields({"num_experts": 8, "text_config": {"num_local_experts": 8}})
    assert agree.count_keys == {"num_experts": 8, "text_config.num_local_experts": 8}
    assert agree.agreed_count == 8 and agree.num_experts == 8
    split = moe_fields({"num_experts": 8, "text_config": {"num_experts": 6}})
    assert split.agreed_count is None and split.num_experts == 8


@pytest.mark.parametrize(
    "key",
    [
        "num_experts_per_tok",
        "num_experts_per_token",
        "experts_per_token",
        "moe_top_k",
        "moe_topk",
        "moe_k",
        "top_k_experts",
        "top_k",
    ],
)
def test_every_top_k_key(key):
    assert moe_fields({"text_config": {key: 3}}).top_k == 3


def test_booleans_and_missing_fields_are_none():
    f = moe_fields({"num_experts": True, "top_k": None})
    assert f.num_experts is None and f.top_k is None and f.count_keys == {}
    assert moe_fields({}).routed_scaling_factor is None


def test_a_transformers_config_reads_as_its_dict():
    config = {"num_local_experts": 6, "num_experts_per_tok": 2, "n_group": 3, "topk_group": 1}
    nested = {"architectures": ["Wrapper"], "text_config": config}
    live = PretrainedConfig(text_config=PretrainedConfig(**config))
    assert moe_fields(live) == moe_fields(nested)
