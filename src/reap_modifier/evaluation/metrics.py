"""Quality metrics of a model against a reference on the same token windows.

Pure functions over logits, log-probabilities and token ids:

- :func:`token_metrics` / :class:`WindowMetrics`: per-window sums of next-token NLL (nats),
  top-1 agreement with the reference and ``KL(reference || model)``; the summary gives the mean
  NLL, perplexity, the standard error of the mean over windows, agreement and KL.
- :func:`paired_difference`: mean and standard error of a per-window difference.
- :func:`topn_kl`: ``KL(reference || model)`` estimated from top-N log-probabilities (what a
  serving engine returns), a lower bound of the exact value (see its docstring).
- :func:`longest_repeat_run` / :func:`repetition_stats`: the degeneration check -- the longest
  run of back-to-back copies of one substring in a generation.

Conventions: every window of ``T`` tokens predicts tokens ``1..T-1`` from their prefixes
(``T-1`` positions); NLL, agreement and KL are means over all predicted positions of all windows
(windows have equal length, so this is also the mean of the per-window means). Log-softmax is
taken in float32, sums are accumulated in float64.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "WindowMetrics",
    "longest_repeat_run",
    "paired_difference",
    "repetition_stats",
    "token_metrics",
    "topn_kl",
]


def token_metrics(
    logits: torch.Tensor, ids: torch.Tensor, ref_logits: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Per-window sums for one batch: ``logits`` ``[B, T, V]`` of the model on ``ids`` ``[B, T]``
    (and optionally the reference model's logits on the same ids).

    Returns float64 tensors of shape ``[B]``: ``nll`` (sum of next-token NLL over the ``T-1``
    predicted positions), ``n`` (predicted positions) and, with a reference, ``agree`` (positions
    where both models' argmax agree) and ``kl`` (sum over positions of ``KL(ref || model)``).
    """
    if logits.dim() != 3 or ids.shape != logits.shape[:2]:
        raise ValueError(f"logits {tuple(logits.shape)} do not match ids {tuple(ids.shape)}")
    lp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    tgt = ids[:, 1:]
    nll = -lp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)  # [B, T-1]
    out = {
        "nll": nll.double().sum(1),
        "n": torch.full((ids.shape[0],), float(tgt.shape[1]), dtype=torch.float64),
    }
    if ref_logits is not None:
        if ref_logits.shape != logits.shape:
            raise ValueError(f"reference logits {tuple(ref_logits.shape)} != {tuple(logits.shape)}")
        rlp = F.log_softmax(ref_logits[:, :-1].float(), dim=-1)
        out["agree"] = (lp.argmax(-1) == rlp.argmax(-1)).double().sum(1)
        kl = (rlp.exp() * (rlp - lp)).sum(-1)  # [B, T-1]
        out["kl"] = kl.clamp_min(0).double().sum(1)  # rounding can leave -1e-9
    return out


@dataclass
class WindowMetrics:
    """Accumulated per-window sums of one model on one set of windows (``tail`` is the KL
    estimator's reference mass left out, only when KL was estimated from top-N log-probs)."""

    nll: list[float] = field(default_factory=list)
    n: list[float] = field(default_factory=list)
    agree: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    tail: list[float] = field(default_factory=list)

    def add(self, m: Mapping[str, torch.Tensor]) -> None:
        for k in ("nll", "n", "agree", "kl", "tail"):
            if k in m:
                getattr(self, k).extend(float(v) for v in m[k])

    def summary(self) -> dict:
        """``nll`` (mean nats per predicted token), ``nll_se`` (standard error of the mean of the
        per-window NLL), ``ppl``, ``tokens``, ``windows``, ``nll_per_window`` and, with a
        reference, ``top1_agreement``, ``kl`` and ``kl_per_window`` (plus ``kl_tail_mass`` when
        estimated)."""
        tokens = sum(self.n)
        nll = sum(self.nll) / tokens if tokens else float("nan")
        per_window = [a / b for a, b in zip(self.nll, self.n)]
        out = {
            "nll": nll,
            "nll_se": _se(per_window),
            "ppl": math.exp(nll) if math.isfinite(nll) else float("nan"),
            "tokens": int(tokens),
            "windows": len(self.nll),
            "nll_per_window": per_window,
        }
        if self.agree:
            out["top1_agreement"] = sum(self.agree) / tokens
            out["kl"] = sum(self.kl) / tokens
            out["kl_per_window"] = [a / b for a, b in zip(self.kl, self.n)]
        if self.tail:
            out["kl_tail_mass"] = sum(self.tail) / tokens
        return out


def _se(values: Sequence[float]) -> float:
    n = len(values)
    if n < 2:
        return float("nan")
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def paired_difference(a: Sequence[float], b: Sequence[float]) -> dict:
    """Mean of ``b - a`` over paired values (e.g. per-window NLL of two models on the same
    windows), its standard error (sample std / sqrt(n)) and ``n``. Windows of one text stream are
    not fully independent, so read the standard error as a rough scale, not a test."""
    if len(a) != len(b):
        raise ValueError(f"paired lists differ in length ({len(a)} != {len(b)})")
    n = len(a)
    d = [y - x for x, y in zip(a, b)]
    mean = sum(d) / n if n else float("nan")
    return {"mean": mean, "se": _se(d), "n": n}


# ----------------------------------------------------------------------------- KL from top-N

TAIL_EPS = 1e-6


def topn_kl(
    ref_ids: torch.Tensor,
    ref_logprobs: torch.Tensor,
    cand_ids: torch.Tensor,
    cand_logprobs: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``KL(reference || candidate)`` per position from top-N log-probabilities: the estimate and
    the reference mass it leaves out.

    Inputs are ``[M, K]`` (reference: its top-K token ids and log-probs) and ``[M, K2]``
    (candidate: the ids whose log-prob is known -- its own top-K2 from a server, or the
    reference's ids when the full distribution is at hand). ``-inf`` log-probs mark padding.

    Estimator: let ``A`` be the reference's top-K tokens whose candidate log-prob is known,
    ``m = 1 - sum_A p_i`` and ``r = 1 - sum_A q_i``. Then::

        KL_est = sum_{i in A} p_i (log p_i - log q_i) + m log(m / r)

    is the exact KL of the two distributions coarse-grained to the tokens of ``A`` plus one bin
    for everything else. By the log-sum inequality (coarse-graining never increases KL)::

        0 <= KL_est <= KL,   KL - KL_est = m * KL(p_rest || q_rest)

    where ``p_rest`` / ``q_rest`` are the two distributions renormalized over the tokens outside
    ``A``. The estimate is exact when ``m = 0`` and its deficit is at most ``m`` times the
    divergence of the tails: the reported ``m`` (``kl_tail_mass``) says how much was left out.
    No upper bound follows from top-N values alone (the candidate may put arbitrarily little
    mass on a tail token). Leftover masses below ``TAIL_EPS`` (1e-6) count as 0: they are the
    rounding of summed float32 probabilities. Returns ``(kl_est, m)``, both ``[M]`` float64.
    """
    p_lp = ref_logprobs.double()
    q_lp = cand_logprobs.double()
    eq = ref_ids.unsqueeze(-1) == cand_ids.unsqueeze(-2)  # [M, K, K2]
    eq &= torch.isfinite(q_lp).unsqueeze(-2) & torch.isfinite(p_lp).unsqueeze(-1)
    known = eq.any(-1)  # [M, K]
    q_at = torch.where(eq, q_lp.unsqueeze(-2), torch.zeros_like(q_lp).unsqueeze(-2)).sum(-1)
    p = torch.where(known, p_lp.exp(), torch.zeros_like(p_lp))
    q = torch.where(known, q_at.exp(), torch.zeros_like(p_lp))
    head = torch.where(known, p * (p_lp - q_at), torch.zeros_like(p_lp)).sum(-1)
    m = (1.0 - p.sum(-1)).clamp_min(0.0)
    r = (1.0 - q.sum(-1)).clamp_min(0.0)
    # leftover masses below TAIL_EPS are the rounding of float32 log-probs summed, not mass
    tail = torch.where(
        m > TAIL_EPS, m * (torch.log(m.clamp_min(TAIL_EPS)) - torch.log(r.clamp_min(TAIL_EPS))), 0.0
    )
    return (head + tail).clamp_min(0.0), torch.where(m > TAIL_EPS, m, 0.0)


# ----------------------------------------------------------------------------- repetition


def longest_repeat_run(seq: Sequence) -> tuple[int, Any]:
    """The largest number of back-to-back copies of one substring (unit) anywhere in ``seq`` (a
    string or a list of token ids), and that unit. ``"ab```c"`` -> ``(3, "`")``; ``"abcabcab"``
    -> ``(2, "abc")``; a sequence without any repetition -> 1 (its first element); empty -> 0.

    For each period ``p``, a stretch of ``m`` consecutive positions with ``s[j] == s[j+p]`` is
    ``m + p`` elements of period ``p``: ``(m + p) // p`` copies of its first ``p`` elements. Ties go
    to the shorter unit, then the earlier position. O(n^2) time, fine for generations.
    """
    n = len(seq)
    if n == 0:
        return 0, seq[:0]
    best, unit = 1, seq[:1]
    for p in range(1, n // 2 + 1):
        if (n // p) <= best:  # even the whole sequence cannot beat `best` copies
            break
        run, start = 0, 0
        for j in range(n - p):
            if seq[j] == seq[j + p]:
                if run == 0:
                    start = j
                run += 1
                copies = (run + p) // p
                if copies > best:
                    best, unit = copies, seq[start : start + p]
            else:
                run = 0
    return best, unit


def repetition_stats(token_ids: Sequence[int], text: str) -> dict:
    """Longest repeat run of a generation, in tokens and in characters of its decoded text."""
    tok_run, tok_unit = longest_repeat_run(list(token_ids))
    chr_run, chr_unit = longest_repeat_run(text)
    return {
        "repeat_run_tokens": tok_run,
        "repeat_unit_tokens": list(tok_unit),
        "repeat_run_chars": chr_run,
        "repeat_unit_chars": chr_unit,
    }
