"""Whether a post-cut change made the whole model better: held-out calibration samples, the
unpruned model's next-token distributions on them (recorded before anything changes), and
the changed model's ``KL(unpruned || changed)`` on them, per sample, so that two states
are compared *paired* (:func:`keeps`).

What is held, whatever the vocabulary: the LM head's *input* on every held-out token (the
unpruned model's final hidden states, in the model's dtype, on CPU), never its
log-probabilities. The head is not pruned, so the reference logits are recomputed exactly
from them, a chunk of tokens at a time (:data:`LOGIT_CHUNK_ELEMENTS` logits at once), and
the changed model runs with its head disabled (llm-compressor's ``disable_lm_head``): its
logits come from the head's input the same way. Memory: ``held-out tokens x hidden x dtype
bytes`` (Kimi K3, 7168 x 2 B: 14 KiB a token) plus a few ``[chunk, vocab]`` float32 blocks
(~16 MiB each), instead of ``tokens x vocab x 4 B`` (K3: 640 KiB a token). A model that
transforms its logits after the head (soft-capping, a logit scale) is judged on the head's
own logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["LOGIT_CHUNK_ELEMENTS", "HeldOutKL", "ValidationSet", "keeps"]

#: logits computed at once: tokens per chunk = this // vocabulary size
LOGIT_CHUNK_ELEMENTS = 1 << 22


@dataclass
class HeldOutKL:
    """``KL(unpruned || model)`` on the held-out samples: the sum over each sample's
    tokens and its token count, and each sample's group (``None``: no groups)."""

    sums: torch.Tensor  # [S] float64
    tokens: torch.Tensor  # [S] int64
    groups: list[str] | None = None

    @property
    def mean(self) -> float:
        """Mean KL per held-out token, in nats."""
        return float(self.sums.sum() / max(int(self.tokens.sum()), 1))

    def by_group(self) -> dict[str, float] | None:
        """Mean KL per token of each group's samples (``None`` without groups)."""
        if self.groups is None:
            return None
        out = {}
        for g in sorted(set(self.groups)):
            rows = torch.tensor([x == g for x in self.groups])
            out[g] = float(self.sums[rows].sum() / max(int(self.tokens[rows].sum()), 1))
        return out

    def change_from(self, before: HeldOutKL) -> tuple[float, float | None]:
        """``(mean KL of self - mean KL of before, its standard error)``, paired over the
        samples: the difference of the per-sample sums, over the tokens; the standard error
        from their spread (``None`` with fewer than two samples)."""
        d = self.sums - before.sums
        n = max(int(self.tokens.sum()), 1)
        if d.numel() < 2:
            return float(d.sum() / n), None
        return float(d.sum() / n), math.sqrt(d.numel() * float(d.var(unbiased=True))) / n


def keeps(before: HeldOutKL, after: HeldOutKL) -> bool:
    """The one rule for keeping a post-cut change: the held-out KL drops by more than its
    paired standard error (with one held-out sample, by anything)."""
    change, se = after.change_from(before)
    return change < -(se or 0.0)


class ValidationSet:
    """Held-out calibration samples and the unpruned model's LM-head inputs on them.

    :param batches: each held-out sample's model inputs (``input_ids`` ``[1, T]``, and
        ``attention_mask``)
    :param groups: each sample's group (``None``: no groups)
    """

    def __init__(self, batches: list[dict[str, torch.Tensor]], groups: list[str] | None = None):
        self.batches = batches
        self.groups = groups
        self._reference: list[torch.Tensor] = []

    @property
    def tokens(self) -> int:
        return sum(int(_valid(b).sum()) for b in self.batches)

    def record_reference(self, model: torch.nn.Module) -> None:
        """The unpruned model's LM-head inputs on the held-out tokens (call before any
        change)."""
        self._reference = [_head_input(model, b).cpu() for b in self.batches]

    def kl(self, model: torch.nn.Module) -> HeldOutKL:
        """``KL(unpruned || model)`` on every held-out sample."""
        from compressed_tensors import align_module_device

        head = model.get_output_embeddings()
        sums, tokens = [], []
        for batch, ref in zip(self.batches, self._reference, strict=True):
            now = _head_input(model, batch)
            total = torch.zeros((), dtype=torch.float64)
            with torch.no_grad(), align_module_device(head):
                step = max(1, LOGIT_CHUNK_ELEMENTS // head.weight.shape[0])
                for i in range(0, now.shape[0], step):
                    r = _log_probs(head, ref[i : i + step].to(now.device))
                    p = _log_probs(head, now[i : i + step])
                    total += (r.exp() * (r - p)).sum().double().cpu()
            sums.append(total)
            tokens.append(now.shape[0])
        return HeldOutKL(
            torch.stack(sums) if sums else torch.zeros(0, dtype=torch.float64),
            torch.tensor(tokens, dtype=torch.long),
            self.groups,
        )


def _log_probs(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(F.linear(hidden, head.weight, head.bias).float(), dim=-1)


def _head_input(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """``[valid tokens, hidden]``: the LM head's input on ``batch``'s non-padding tokens,
    the model run with its head disabled (no ``[tokens, vocab]`` logits)."""
    from llmcompressor.utils.helpers import disable_lm_head

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        raise RuntimeError(
            f"the post-cut validation needs the model's LM head as an nn.Linear, got "
            f"{type(head).__name__}; set validate_fit: false"
        )
    seen: list[torch.Tensor] = []
    handle = head.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    device = _device_of(model)
    try:
        with torch.no_grad(), disable_lm_head(model):
            model(**{k: v.to(device) for k, v in batch.items()}, use_cache=False)
    finally:
        handle.remove()
    if not seen:
        raise RuntimeError("the post-cut validation got no LM-head input from the model")
    hidden = seen[-1]
    return hidden.reshape(-1, hidden.shape[-1])[_valid(batch).reshape(-1).to(hidden.device)]


def _valid(batch: dict) -> torch.Tensor:
    mask = batch.get("attention_mask")
    ids = batch["input_ids"]
    return mask.bool() if isinstance(mask, torch.Tensor) else torch.ones_like(ids, dtype=torch.bool)


def _device_of(model: torch.nn.Module) -> torch.device:
    from llmcompressor.utils.dev import get_main_device

    try:
        return get_main_device()
    except Exception:  # pragma: no cover - no accelerator helper
        return next(model.parameters()).device
