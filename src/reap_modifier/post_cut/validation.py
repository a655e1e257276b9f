"""Whether a post-cut component made the whole model better: held-out calibration
batches, the unpruned model's next-token distributions on them (recorded before the
cut), and the pruned model's mean ``KL(unpruned || pruned)`` per token on them
(the post-cut step keeps a component only when this drops)."""

from __future__ import annotations

import torch

__all__ = ["ValidationSet"]


class ValidationSet:
    """Held-out calibration batches and the unpruned model's log-probabilities on them."""

    def __init__(self, batches: list[dict[str, torch.Tensor]]):
        self.batches = batches
        self._reference: list[torch.Tensor] = []

    @property
    def tokens(self) -> int:
        return sum(int(_valid(b).sum()) for b in self.batches)

    def _log_probs(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        device = _device_of(model)
        kwargs = {k: v.to(device) for k, v in batch.items()}
        logits = _logits(model, kwargs)
        return torch.log_softmax(logits.float(), dim=-1)[_valid(batch).to(logits.device)].cpu()

    def record_reference(self, model: torch.nn.Module) -> None:
        """The unpruned model's log-probabilities (call before the cut)."""
        self._reference = [self._log_probs(model, b) for b in self.batches]

    def kl(self, model: torch.nn.Module) -> float:
        """Mean ``KL(unpruned || model)`` per held-out token, in nats."""
        total, count = 0.0, 0
        for batch, ref in zip(self.batches, self._reference, strict=True):
            now = self._log_probs(model, batch)
            total += (ref.exp() * (ref - now)).sum().item()
            count += ref.shape[0]
        return total / max(count, 1)


def _logits(model: torch.nn.Module, kwargs: dict) -> torch.Tensor:
    """The model's logits on one batch.

    Workaround, upstream: llm-compressor's sequential pipeline runs the whole
    calibration, ``CALIBRATION_END`` included, under ``disable_lm_head``, which makes the
    LM head return meta tensors; the post-cut step validates at calibration end, so when
    the logits come back on the meta device they are computed here from the LM head's
    input and its own weight (onloaded if offloaded)."""
    from compressed_tensors import align_module_device

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    seen: list[torch.Tensor] = []
    handle = (
        head.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
        if isinstance(head, torch.nn.Linear)
        else None
    )
    try:
        with torch.no_grad():
            logits = model(**kwargs, use_cache=False).logits
            if logits.is_meta and seen:
                with align_module_device(head):
                    logits = torch.nn.functional.linear(seen[-1], head.weight, head.bias)
    finally:
        if handle is not None:
            handle.remove()
    if logits.is_meta:
        raise RuntimeError("the post-cut validation got no logits from the model (meta LM head)")
    return logits


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
