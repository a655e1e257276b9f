"""The post-cut step's held-out check: what it holds does not grow with the vocabulary, it
builds no ``[tokens, vocab]`` block beyond a fixed chunk, and its per-sample KL equals a
brute-force KL over the model's full logits."""

from __future__ import annotations

import pytest
import torch
from memory_probe import LiveTensors
from tiny_models import build_tiny, sample_input_ids

from reap_modifier.post_cut.validation import LOGIT_CHUNK_ELEMENTS, ValidationSet, keeps

SAMPLES = 3


def _brute_force_kl(reference: torch.nn.Module, model: torch.nn.Module, ids) -> list[float]:
    """Per sample: sum over its tokens of KL(reference || model), from the full logits."""
    out = []
    with torch.no_grad():
        for row in ids:
            ref = reference(input_ids=row[None], use_cache=False).logits.double().log_softmax(-1)
            now = model(input_ids=row[None], use_cache=False).logits.double().log_softmax(-1)
            out.append(float((ref.exp() * (ref - now)).sum()))
    return out


@pytest.mark.parametrize("vocab, tokens", [(256, 64), (163_840, 256)])
def test_held_out_check_holds_no_vocabulary(vocab, tokens):
    reference, info = build_tiny("kimi_k3", seed=5, vocab_size=vocab)
    model, _ = build_tiny("kimi_k3", seed=5, vocab_size=vocab)
    with torch.no_grad():  # another model: a router moved
        for p in model.parameters():
            if p.dim() == 2 and p.shape[0] == 16:
                p.mul_(1.5)
    hidden = reference.config.text_config.hidden_size
    ids = sample_input_ids(vocab, batch=SAMPLES, seq=tokens, seed=1)
    check = ValidationSet([{"input_ids": row[None]} for row in ids])
    check.record_reference(reference)

    # what is held: the LM head's input, tokens x hidden, whatever the vocabulary
    held = sum(t.numel() * t.element_size() for t in check._reference)
    assert held == SAMPLES * tokens * hidden * 4

    # no vocabulary-sized block beyond a chunk of logits, a handful at a time
    def logits_like(t: torch.Tensor) -> bool:
        return t.device.type != "meta" and t.dim() >= 1 and t.shape[-1] == vocab

    with LiveTensors(logits_like) as live:
        kl = check.kl(model)
    chunk = max(1, LOGIT_CHUNK_ELEMENTS // vocab) * vocab * 8  # a float64-sized block
    assert live.peak_bytes <= 4 * chunk
    if vocab * tokens > 8 * LOGIT_CHUNK_ELEMENTS:
        assert live.peak_bytes < tokens * vocab * 4  # one sample's logits never exist at once

    brute = _brute_force_kl(reference, model, ids)
    assert kl.sums.tolist() == pytest.approx(brute, rel=1e-4)
    assert kl.tokens.tolist() == [tokens] * SAMPLES
    assert kl.mean == pytest.approx(sum(brute) / (SAMPLES * tokens), rel=1e-4)


def test_a_change_is_kept_only_beyond_its_standard_error():
    from reap_modifier.post_cut.validation import HeldOutKL

    before = HeldOutKL(
        torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64), torch.tensor([10, 10, 10])
    )
    noisy = HeldOutKL(
        torch.tensor([0.5, 1.4, 1.0], dtype=torch.float64), torch.tensor([10, 10, 10])
    )
    steady = HeldOutKL(
        torch.tensor([0.9, 0.9, 0.9], dtype=torch.float64), torch.tensor([10, 10, 10])
    )
    # paired: mean change -0.1 / 30 tokens; spread of (-0.5, 0.4, 0) is larger than the change
    change, se = noisy.change_from(before)
    assert change == pytest.approx(-0.1 / 30)
    assert se == pytest.approx((3 * torch.tensor([-0.5, 0.4, 0.0]).var().item()) ** 0.5 / 30)
    assert not keeps(before, noisy)
    assert keeps(before, steady)  # a drop of 0.1 on every sample: beyond a zero spread
    assert not keeps(before, before)
