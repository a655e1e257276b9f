"""MoE blocks whose router score scales each expert's *input*: Llama-4's
``experts(routed_in)``.

The router (an ``nn.Linear``) returns ``(scores [N, E], logits [N, E])``: ``scores`` is
the sigmoid of the top-k logits and 0 for every other expert. The block feeds expert
``j`` the rows ``scores[:, j] * hidden`` (every expert sees every token, unselected ones
a zero input, whose gated-MLP output is 0) and sums the outputs, so the experts module
takes the hidden states only and returns ``[E * N, H]`` in expert-major order.
llm-compressor's linearized ``Llama4LinearExperts`` keep that call.

Pruning is exact under masked routing: a dropped expert's logit at ``-inf`` is never in
the top-k, and the kept experts' scores are their own logits' sigmoids, which a pruned
router reproduces. Calibration records, per routed (token, slot), the gate
``g = scores[t, j]`` and the expert's contribution ``f_j(g x_t)``; its norm divided by
``g`` is the output per unit gate, so ``g * norm`` (REAP's weighted term) is the norm of
what the expert adds to the block output.
"""

from __future__ import annotations

import inspect

from torch import nn

from .base import MoEAdapter, register_adapter

__all__ = ["InputGatedAdapter"]


def _hidden_only(experts: nn.Module) -> bool:
    """Whether ``experts.forward`` takes one positional argument (the hidden states)."""
    try:
        params = [
            p
            for p in inspect.signature(experts.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        return False
    return len(params) == 1


@register_adapter
class InputGatedAdapter(MoEAdapter):
    kind = "input_gated"
    families = ("Llama-4",)

    @classmethod
    def matches(cls, block: nn.Module, experts: nn.Module, router: nn.Module) -> bool:
        return isinstance(router, nn.Linear) and _hidden_only(experts)
