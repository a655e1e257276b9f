"""The post-cut step's errors: one base class, one subclass per stage, each message saying
what to change."""

from __future__ import annotations

__all__ = [
    "BiasFitError",
    "BlockSelectionError",
    "CompensationError",
    "PostCutError",
    "RouterFitError",
]


class PostCutError(ValueError):
    """A post-cut request or input that cannot be used (any stage)."""


class RouterFitError(PostCutError):
    """A router the router fit cannot express, or fitting data that cannot be used."""


class CompensationError(PostCutError):
    """A block whose dense tensors compensation cannot refit."""


class BiasFitError(PostCutError):
    """A router whose bias the fit cannot express, or fitting data that cannot be used."""


class BlockSelectionError(PostCutError):
    """A block or input the block-error selection cannot use."""
