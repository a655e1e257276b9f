"""Which positions of a calibration batch are tokens and which are padding.

A batch's 2-D ``attention_mask`` (``[B, T]``, 0 = padding) flattened row-major gives
the validity of row ``b*T + t`` of the ``[B*T, H]`` hidden states a MoE block routes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BatchTokens", "batch_tokens"]


@dataclass
class BatchTokens:
    """Which positions of one calibration batch are tokens (not padding).

    :param samples: sequences in the batch
    :param positions: ``B * T`` positions the model sees
    :param valid: flat bool ``[B*T]`` (row ``b*T + t``), ``None`` when every
        position is a token
    """

    samples: int
    positions: int
    valid: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return self.positions if self.valid is None else int(self.valid.sum())


def batch_tokens(input_ids: Any = None, attention_mask: Any = None) -> BatchTokens | None:
    """:class:`BatchTokens` of a batch from its ``input_ids`` / 2-D ``attention_mask``
    (``None`` when neither tells the shape)."""
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        valid = attention_mask.detach().to("cpu") != 0
        samples, positions = valid.shape[0], valid.numel()
        return BatchTokens(samples, positions, None if bool(valid.all()) else valid.reshape(-1))
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2:
        return BatchTokens(input_ids.shape[0], input_ids.numel())
    return None
