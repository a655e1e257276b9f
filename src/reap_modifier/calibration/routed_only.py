"""Routed-only calibration: llm-compressor's calibrate-all-experts flag, set for the
length of one calibration.

``oneshot(moe_calibrate_all_experts=True)`` (its default) sends every token through
every expert so that quantization observers see all experts. REAP observes routed
tokens only and its statistics are identical either way, so when REAP is the only
modifier calibrating, that work (E / top-k times the routed expert work: 56x for
Kimi K3) buys nothing.

Why this module writes llm-compressor's flag directly: 0.14.0.1 keeps it in the module
global ``llmcompressor.modeling.moe.context._CALIBRATE_ALL_EXPERTS``, set by
``oneshot`` through ``moe_calibration_context()`` for the whole run and read on every
MoE forward (``get_calibrate_all_experts_flag``); there is no public setter. We set it
for REAP's calibration and put the previous value back when it ends.
"""

from __future__ import annotations

from llmcompressor.modeling.moe import context

__all__ = ["calibrate_all_experts", "set_calibrate_all_experts"]


def calibrate_all_experts() -> bool:
    """llm-compressor's current calibrate-all-experts flag."""
    return bool(context.get_calibrate_all_experts_flag())


def set_calibrate_all_experts(value: bool) -> bool:
    """Set llm-compressor's calibrate-all-experts flag; return the previous value."""
    previous = bool(context._CALIBRATE_ALL_EXPERTS)
    context._CALIBRATE_ALL_EXPERTS = bool(value)
    return previous
