"""Errors of the checkpoint tools: each says what is wrong and what to change."""

from __future__ import annotations

__all__ = ["CheckpointError", "DestinationError", "NotWholeError"]


class CheckpointError(ValueError):
    """The checkpoint (or the plan against it) cannot be rewritten; says why."""


class DestinationError(CheckpointError):
    """The output path is refused (not empty, the source, inside the source...)."""


class NotWholeError(CheckpointError):
    """The pruned checkpoint would keep a tensor of a pruned MoE block at the old expert
    count (the wholeness rule of :mod:`reap_modifier.models.expert_tensors`); nothing is
    written."""
