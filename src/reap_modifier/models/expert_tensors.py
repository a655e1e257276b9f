"""Which tensors of a MoE block hold one entry per routed expert, along which axis, and
which a cut left behind: the rule in-memory surgery, :mod:`reap_modifier.wholeness` and
the checkpoint rewriter share. Shapes and dtypes only (no torch, no model), so the
offline rewriter judges a checkpoint's tensors exactly as the modifier judges a model's.

A tensor's expert axis is known from where it lives, never from a size that happens to
equal the expert count (a hidden size, head dim, latent width or vocabulary may equal
it):

``experts``
    fused experts (``experts.gate_up_proj`` ``[E, ...]``, their packed weights and
    scales): the leading axis;
``router``
    the router module and everything under it (``gate.*``, ``router.*``): its output
    axis leads (the logits weight ``[E, hidden]`` even when ``hidden == E``, the bias,
    ``e_score_correction_bias``), or a per-expert vector ``[1, E]``;
``block``
    a tensor of the MoE block itself, or (on disk) of a submodule that is neither the
    experts, the router nor a shared expert (ERNIE's ``moe_statics``): only a per-expert
    vector (``[E]``, ``[1, E]``, ``[E, 1]``), the one shape a block keeps per expert.

An integer tensor of the router or the block is a token -> expert table (hash routing).
After the cut, a tensor whose known expert axis still has the old count was left
behind: the caller names it and writes nothing. A tensor with the count in some
dimension but no known expert axis (``[E, 3]`` on the block) is not per expert by this
rule: the modifier's forward proof judges it in memory; the offline rewriter, which runs
no forward, refuses it (:func:`unknown_count`).
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
    "unknown_count",
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
    """The expert axis of a tensor in ``scope`` of a block with ``count`` experts: the
    dimension it is cut along to the kept experts, or ``None`` (not per expert). Sizes
    elsewhere never count: a router weight ``[E, E]`` (hidden = E) is cut on its rows."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    if not shape:
        return None
    if scope in ("experts", "router") and shape[0] == count:
        return 0
    if scope == "experts" or not per_expert_vector(shape, count):
        return None
    return expert_dims(shape, count)[0]


def left_behind(shape: Sequence[int], old_count: int, scope: str) -> bool:
    """Whether a tensor still has the old expert count on its expert axis (the wholeness
    rule): :func:`cut_dim` would still cut it."""
    return cut_dim(shape, old_count, scope) is not None


def unknown_count(shape: Sequence[int], count: int, scope: str) -> bool:
    """A tensor with ``count`` in some dimension and no expert axis by :func:`cut_dim`:
    per expert or not, no rule says (``[E, 3]`` on the block, a router's ``[3, E]``).
    The offline rewriter refuses such a tensor; in memory the forward proof judges it."""
    return count in tuple(shape) and cut_dim(shape, count, scope) is None


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
