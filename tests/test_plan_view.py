"""The unpruned model routed as a pruned one without cutting anything (the post-cut step's
end-to-end score of a plan) equals the masked-routing oracle, and leaves the model as it was."""

from __future__ import annotations

import pytest
import torch
from oracles import masked_routing
from test_surgery_oracle import _dropped, _random_plan
from tiny_models import ALL_FAMILIES, build_tiny, sample_input_ids

from reap_modifier.models import find_moe_architecture
from reap_modifier.post_cut.plan_view import routed_as, view_problem


def _viewable(family: str) -> bool:
    model, _ = build_tiny(family, seed=7)
    arch = find_moe_architecture(model)
    return all(view_problem(layer, arch.num_experts) is None for layer in arch.layers)


VIEWABLE = [f for f in ALL_FAMILIES if _viewable(f)]


def test_the_view_covers_the_routers_the_selection_models():
    assert {"kimi_k3", "deepseek_v3", "qwen3_moe"} <= set(VIEWABLE)


@pytest.mark.parametrize("family", VIEWABLE)
def test_routed_as_a_plan_equals_masked_routing(family):
    model, info = build_tiny(family, seed=7, dtype=torch.float32)
    ids = sample_input_ids(info.vocab_size, batch=2, seq=16, seed=3)
    arch = find_moe_architecture(model)
    plan = _random_plan(arch, seed=11)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        unpruned = model(input_ids=ids, use_cache=False).logits
        with masked_routing(model, family, _dropped(plan)):
            masked = model(input_ids=ids, use_cache=False).logits
        with routed_as(arch, plan):
            viewed = model(input_ids=ids, use_cache=False).logits
        after = model(input_ids=ids, use_cache=False).logits
    assert not torch.equal(unpruned, masked), "masking changed nothing: the test is vacuous"
    torch.testing.assert_close(viewed, masked, rtol=1e-5, atol=1e-6)
    assert torch.equal(after, unpruned)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for layer in arch.layers:
        assert layer.block._modules[layer.router_attr] is layer.router
