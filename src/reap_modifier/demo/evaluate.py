"""Evaluation of pruned models against the unpruned one (the main job's metrics).

Pure functions over causal LMs (anything whose ``model(input_ids=x).logits`` is ``[B, T, V]``) and
token-id tensors, unit-tested on tiny random models:

- :func:`token_metrics` / :func:`evaluate_models`: mean next-token NLL (nats) and perplexity on
  held-out windows, and -- against a reference model (the unpruned one) -- top-1 next-token
  agreement and ``KL(reference || model)``, all over the same predicted positions; per-window NLL
  is kept so paired differences between two models can be given an uncertainty
  (:func:`paired_difference`). :func:`evaluate_models` runs every model on a chunk of windows
  right after the reference, so the reference's logits are computed once and never stored whole.
- :func:`greedy_generate` and :func:`longest_repeat_run`: the seed's degeneration check -- the
  longest run of back-to-back copies of one substring in greedy generations (3 for a code-fence
  backtick in healthy text; thousands for a model locked in a one-token loop).

Conventions: every window of ``T`` tokens predicts tokens ``1..T-1`` from their prefixes (``T-1``
positions); NLL, agreement and KL are means over all predicted positions of all windows (windows
have equal length, so this is also the mean of the per-window means). KL is computed in float32
from log-softmax of each model's logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "WindowMetrics",
    "token_metrics",
    "evaluate_models",
    "paired_difference",
    "greedy_generate",
    "longest_repeat_run",
    "repetition_stats",
    "zero_routed_experts",
]


# ----------------------------------------------------------------------------- token metrics


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids)
    logits = out.logits if hasattr(out, "logits") else out
    return logits.float()


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
    """Accumulated per-window sums of one model on one set of windows."""

    nll: list[float] = field(default_factory=list)
    n: list[float] = field(default_factory=list)
    agree: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)

    def add(self, m: Mapping[str, torch.Tensor]) -> None:
        for k in ("nll", "n", "agree", "kl"):
            if k in m:
                getattr(self, k).extend(float(v) for v in m[k])

    def summary(self) -> dict:
        tokens = sum(self.n)
        nll = sum(self.nll) / tokens if tokens else float("nan")
        out = {
            "nll": nll,
            "ppl": math.exp(nll) if math.isfinite(nll) else float("nan"),
            "tokens": int(tokens),
            "windows": len(self.nll),
            "nll_per_window": [a / b for a, b in zip(self.nll, self.n)],
        }
        if self.agree:
            out["top1_agreement"] = sum(self.agree) / tokens
            out["kl"] = sum(self.kl) / tokens
        return out


def evaluate_models(
    models: Mapping[str, Any],
    windows: torch.Tensor,
    reference: str | None = None,
    *,
    chunk: int = 8,
    progress: Callable[[int], None] | None = None,
) -> dict[str, dict]:
    """Evaluate every model of ``models`` on ``windows`` (``[N, T]`` token ids).

    For each chunk of ``chunk`` windows the reference model (``models[reference]``) runs first,
    then every other model; its logits are compared to each model's and then dropped. Returns
    ``name -> {"nll", "ppl", "tokens", "windows", "nll_per_window"[, "top1_agreement", "kl"]}``
    (agreement / KL only with a reference; the reference itself gets 1.0 / 0.0 computed, not
    assumed). ``progress(k)`` is called with the number of windows done per model and chunk.
    """
    if windows.dim() != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be [N, T>=2], got {tuple(windows.shape)}")
    if reference is not None and reference not in models:
        raise KeyError(f"reference {reference!r} is not among the models {list(models)}")
    acc = {name: WindowMetrics() for name in models}
    order = ([reference] if reference is not None else []) + [n for n in models if n != reference]
    with torch.no_grad():
        for i in range(0, windows.shape[0], chunk):
            x = windows[i : i + chunk]
            ref_logits = None
            for name in order:
                logits = _logits(models[name], x)
                if name == reference:
                    ref_logits = logits
                acc[name].add(token_metrics(logits, x, ref_logits))
                del logits
                if progress is not None:
                    progress(x.shape[0])
    return {name: acc[name].summary() for name in models}


def paired_difference(a: Sequence[float], b: Sequence[float]) -> dict:
    """Mean of ``b - a`` over paired values (e.g. per-window NLL of two models on the same
    windows), its standard error (sample std / sqrt(n)) and ``n``. Windows of one text stream are
    not fully independent, so read the standard error as a rough scale, not a test."""
    if len(a) != len(b):
        raise ValueError(f"paired lists differ in length ({len(a)} != {len(b)})")
    n = len(a)
    d = [y - x for x, y in zip(a, b)]
    mean = sum(d) / n if n else float("nan")
    if n > 1:
        var = sum((v - mean) ** 2 for v in d) / (n - 1)
        se = math.sqrt(var / n)
    else:
        se = float("nan")
    return {"mean": mean, "se": se, "n": n}


# ----------------------------------------------------------------------------- generation


def greedy_generate(
    model: Any,
    prompts: torch.Tensor,
    max_new_tokens: int,
    *,
    progress: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Greedy continuation of equal-length ``prompts`` (``[B, P]`` ids): ``[B, max_new_tokens]``.

    Re-runs the whole sequence each step (no KV cache: exact, model-agnostic, and cheap at these
    sizes); never stops early (an end-of-text token is just another token, so a loop on it counts).
    """
    if prompts.dim() != 2 or prompts.shape[1] < 1:
        raise ValueError(f"prompts must be [B, P>=1], got {tuple(prompts.shape)}")
    x = prompts
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = _logits(model, x)[:, -1].argmax(-1, keepdim=True)
            x = torch.cat([x, nxt.to(x.dtype)], dim=1)
            if progress is not None:
                progress(1)
    return x[:, prompts.shape[1] :]


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


# ----------------------------------------------------------------------------- reference ablation


def zero_routed_experts(model: Any) -> list:
    """Make every routed expert of every MoE layer output zeros (forward hooks; shared experts,
    routers and everything else untouched) -- the "no routed experts at all" reference that sizes
    what pruning can cost at most. Returns the hook handles (``.remove()`` them to undo)."""
    from ..models import find_moe_architecture

    def zero(module, args, output):
        return torch.zeros_like(output)

    handles = []
    for layer in find_moe_architecture(model).layers:
        experts = layer.experts
        targets = list(experts) if isinstance(experts, torch.nn.ModuleList) else [experts]
        handles += [m.register_forward_hook(zero) for m in targets]
    return handles
