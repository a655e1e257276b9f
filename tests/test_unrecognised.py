"""Families that have experts REAP cannot prune are refused by discovery, before any
calibration, with the family, the expert count and the structural reason (not the
generic "no MoE layer" of a dense model)."""

from __future__ import annotations

import pytest
import torch
from family_zoo import build_family
from torch import nn

from reap_modifier.models import NoMoEError, find_moe_architecture
from reap_modifier.models.architecture import UnsupportedMoEError

CASES = {
    "aria": ("moe_num_experts=8", "receives router logits and picks its own top-k"),
    "dbrx": ("ffn_config.moe_num_experts=8", "stacked into one [experts x width, hidden]"),
    "doge": ("num_experts=16", "embedding table retrieved by product keys"),
    "jetmoe": ("num_local_experts=8", "mlp (e.g. model.layers.0.mlp.input_linear), self_attention"),
    "zaya": ("num_experts=8", "`router_mlp.out_proj` has 1 class(es) beyond the 8 experts"),
}


@pytest.mark.parametrize("family", sorted(CASES))
def test_family_with_unprunable_experts_names_the_reason(family):
    built = build_family(family)
    model = built[0] if isinstance(built, tuple) else built
    count, reason = CASES[family]
    with pytest.raises(UnsupportedMoEError) as info:
        find_moe_architecture(model)
    message = str(info.value)
    assert message.startswith(f"{family} ({type(model).__name__}, {count}): ")
    assert reason in message
    assert "Not supported in this version" in message


class _Config:
    model_type = "made_up"
    num_experts = 4

    def to_dict(self):
        return {"num_experts": 4}


class _Block(nn.Module):
    def __init__(self, router: nn.Module):
        super().__init__()
        self.router = router
        self.experts = nn.Module()
        self.experts.down_proj = nn.Parameter(torch.zeros(4, 8, 8))


class _Model(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.config = _Config()
        self.layers = nn.ModuleList([block])


def test_the_reason_follows_structure_not_class_names():
    """A block of made-up classes whose router is a two-layer network gets the router
    reason; the same model without anything sized by the expert count is dense."""
    router = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 5))
    with pytest.raises(
        UnsupportedMoEError, match=r"made_up \(_Model, num_experts=4\).*network of 2"
    ):
        find_moe_architecture(_Model(_Block(router)))

    dense = _Model(nn.Linear(8, 8))
    with pytest.raises(NoMoEError, match="_Model has no MoE layer REAP can prune"):
        find_moe_architecture(dense)
