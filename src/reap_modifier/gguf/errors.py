"""Errors of the GGUF tools: each says what is wrong and what to change."""

from __future__ import annotations

from ..checkpoint.errors import CheckpointError

__all__ = ["GGUFError"]


class GGUFError(CheckpointError):
    """The GGUF file (or the plan against it) cannot be pruned; says why. Raised before
    anything is written."""
