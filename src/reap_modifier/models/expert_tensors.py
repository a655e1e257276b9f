"""Which tensors of a MoE block hold one entry per routed expert, and which a cut left
behind: the rule in-memory surgery, :mod:`reap_modifier.wholeness` and the checkpoint
rewriter share. Shapes and dtypes only (no torch, no model), so the offline rewriter
judges a checkpoint's tensors exactly as the modifier judges a model's.

Where a tensor lives decides what it may be:

``router``
    the router module and everything under it (``gate.*``, ``router.*``): its rows
    (leading dim = experts) are cut, as is a per-expert vector of any rank;
``block``
    a tensor of the MoE block itself, or (on disk) of a submodule that is neither the
    experts, the router nor a shared expert (ERNIE's ``moe_statics``): only a per-expert
    vector (``[E]``, ``[1, E]``, ``[E, 1]``) is cut;
``experts``
    fused experts (``experts.gate_up_proj`` ``[E, ...]``): the leading dim is cut.

An integer tensor of the router or the block is a token -> expert table (hash routing).
After the cut, a router or block tensor with the old count in any dimension, or a fused
expert tensor with it in the leading one, was left behind: the caller names it and
writes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "SCOPES",
    "cut_dim",
    "expert_dims",
    "hash_routed_message",
    "left_behind",
    "per_expert_vector",
]

SCOPES = ("router", "block", "experts")


def expert_dims(shape: Sequence[int], count: int) -> list[int]:
    """The dimensions of ``shape`` of size ``count``."""
    return [d for d, size in enumerate(shape) if size == count]


def per_expert_vector(shape: Sequence[int], count: int) -> bool:
    """``[E]``, ``[1, E]``, ``[E, 1]``, ...: exactly one dim of size ``count``, the
    others of size 1."""
    dims = expert_dims(shape, count)
    return len(dims) == 1 and all(s == 1 for d, s in enumerate(shape) if d != dims[0])


def cut_dim(shape: Sequence[int], count: int, scope: str) -> int | None:
    """The dimension along which a tensor in ``scope`` holds one entry per expert and is
    cut to the kept experts, or ``None`` (not per expert, or ambiguous: then
    :func:`left_behind` names it if it keeps ``count`` somewhere)."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    dims = expert_dims(shape, count)
    if scope == "experts":
        return 0 if shape and shape[0] == count else None
    if len(dims) != 1:
        return None
    if per_expert_vector(shape, count) or (scope == "router" and dims[0] == 0):
        return dims[0]
    return None


def left_behind(shape: Sequence[int], old_count: int, scope: str) -> bool:
    """Whether a tensor of a pruned block still has the old expert count where a cut
    would have removed it (the wholeness rule)."""
    if scope == "experts":
        return bool(shape) and shape[0] == old_count
    return old_count in tuple(shape)


def hash_routed_message(family: str, model_class: str | None, layer: str, table: str) -> str:
    """Why a hash-routed model is refused (in memory before calibration, on disk before
    anything is written)."""
    who = f"{family} ({model_class})" if model_class else family
    return (
        f"{who}: MoE layer {layer} is hash-routed: its router picks experts from a "
        f"frozen token -> expert table (`{table}`), so removing an expert the table names "
        "changes which experts those tokens use, and no pruned checkpoint equals masking "
        "it out of routing. REAP refuses hash-routed models. Workaround: a configuration "
        "without hash layers (DeepSeek-V4: `mlp_layer_types` all 'moe') prunes normally."
    )
