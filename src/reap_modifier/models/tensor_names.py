"""Names of a MoE model's modules and tensors that hold in a checkpoint and in a loaded
model alike: a router's logits weight and a module's layer number. The checkpoint layout
and the weight baselines both read names through these."""

from __future__ import annotations

import re

from .config_keys import ROUTER_ATTRS

__all__ = ["LAYER_NUMBER_RE", "ROUTER_WEIGHT_RE", "layer_index"]

#: a router's logits weight, directly or one module down (``gate.weight``,
#: ``router.layer.weight``, ``router.gate.weight``, ``gate.wg.weight``); never
#: ``gate_proj`` or ``shared_expert_gate``: the module must be exactly gate/router
ROUTER_WEIGHT_RE = re.compile(
    r"^(?P<block>.+?)\.(?:{})\.(?:[^.]+\.)?weight$".format("|".join(ROUTER_ATTRS))
)
LAYER_NUMBER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def layer_index(name: str) -> int | None:
    """The layer number of a module path or tensor name (its last ``layers.<n>``), else
    ``None``."""
    found = LAYER_NUMBER_RE.findall(name)
    return int(found[-1]) if found else None
