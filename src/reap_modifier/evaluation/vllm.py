"""The vLLM backend: each model served in turn by vLLM's OpenAI server, scored by token ids.

For one checkpoint (:func:`serve_and_score`): the server starts
(:class:`~reap_modifier.serving.server.VllmServer`, its own process group, stopped by pid),
every window is sent as a prompt of token ids with ``prompt_logprobs=N`` and one generated
token, and the held-out prompts get greedy continuations (``temperature=0``, ``ignore_eos``).
From the prompt log-probs: the NLL of every window token (teacher forced, exact) and the
model's top-N tokens at every position (its argmax for top-1 agreement, and the values for the
top-N estimate of KL, :func:`~.metrics.topn_kl`). Throughput: prompt tokens scored per second
and generated tokens per second, each over the wall time of its requests.

vLLM returns at most ``--max-logprobs`` log-probs per position (20 by default); the server is
started with ``--max-logprobs`` = N unless the user's ``--vllm-arg`` sets it.

Every model is served in one dtype (:func:`served_dtype_for`: the user's ``--dtype``, except where
vLLM's CPU backend computes the model in bfloat16 only, see
:mod:`~reap_modifier.serving.vllm_dtype`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..serving import vllm_check
from ..serving.server import VllmServer
from ..serving.vllm_dtype import ServedDtype, served_dtype
from .hf import ReferenceTopN

__all__ = ["ServedRun", "serve_and_score", "served_dtype_for"]


def served_dtype_for(
    checkpoints: Sequence[str | Path], requested: str, vllm_python: str, server_args: Sequence[str]
) -> ServedDtype:
    """The one dtype every checkpoint is served in: ``requested`` unless vLLM's CPU backend
    computes one of them in bfloat16 only (then ``auto`` becomes bfloat16 for all, with the
    reason, and any other dtype raises :class:`~reap_modifier.serving.vllm_dtype.DtypeRefused`
    naming ``--dtype bfloat16``)."""
    info = vllm_check.find_vllm_python(vllm_python)
    choices = [
        served_dtype(
            requested,
            json.loads((Path(c) / "config.json").read_text()),
            cpu_amx=info.cpu_amx,
            server_args=server_args,
            dtype_flag="--dtype",
        )
        for c in checkpoints
    ]
    return next((c for c in choices if c.reason), choices[0])


@dataclass
class ServedRun:
    """One model's output from vLLM, per label."""

    scores: dict[str, ReferenceTopN] = field(default_factory=dict)
    generations: dict[str, list[list[int]]] = field(default_factory=dict)
    throughput: dict = field(default_factory=dict)
    extra: object = None


def _parse_positions(choice: dict, window: list[int], top_n: int):
    """Per predicted position t = 1..T-1: the log-prob of ``window[t]`` and the top-N (ids, lps)."""
    plp = choice.get("prompt_logprobs")
    if not plp or len(plp) != len(window):
        raise RuntimeError(
            f"vLLM returned {len(plp or [])} prompt log-prob entries for a window of {len(window)}"
        )
    nll = 0.0
    ids = torch.full((len(window) - 1, top_n), 0, dtype=torch.int32)
    lps = torch.full((len(window) - 1, top_n), -math.inf, dtype=torch.float32)
    for t in range(1, len(window)):
        entry = plp[t]
        tok = str(window[t])
        if tok not in entry:
            raise RuntimeError(f"vLLM's prompt log-probs lack the prompt token {tok} at {t}")
        nll -= float(entry[tok]["logprob"])
        ranked = sorted(
            ((int(k), float(v["logprob"])) for k, v in entry.items()),
            key=lambda kv: (-kv[1], kv[0]),
        )[:top_n]
        for j, (k, v) in enumerate(ranked):
            ids[t - 1, j] = k
            lps[t - 1, j] = v
    return nll, ids, lps


def serve_and_score(
    python: str,
    checkpoint: str | Path,
    windows: dict[str, torch.Tensor],
    prompts: dict[str, list[list[int]]],
    *,
    top_n: int,
    gen_tokens: int,
    dtype: str,
    server_args: list[str],
    log_path: Path,
    batch: int = 16,
    startup_timeout: float = 900.0,
    progress: Callable[[int], None] | None = None,
    during: Callable[[VllmServer], object] | None = None,
) -> ServedRun:
    """Serve ``checkpoint``, score every window of every label, generate from every prompt;
    ``during(server)`` runs last while the server is up (lm-eval), its value in ``run.extra``.
    With ``during`` the server loads the tokenizer (text requests)."""
    max_len = max(
        [int(w.shape[1]) + 1 for w in windows.values()]
        + [len(p) + gen_tokens for ps in prompts.values() for p in ps]
    )
    args = list(server_args)
    if not any(a.split("=", 1)[0] == "--max-logprobs" for a in args):
        args += ["--max-logprobs", str(top_n)]
    server = VllmServer(
        python,
        checkpoint,
        log_path=log_path,
        dtype=dtype,
        max_model_len=max_len,
        extra_args=args,
        startup_timeout=startup_timeout,
        skip_tokenizer_init=during is None,
    )
    run = ServedRun()
    with server:
        run.throughput["server_start_s"] = round(server.startup_seconds or 0.0, 2)
        prompt_tokens, score_s = 0, 0.0
        gen_count, gen_s = 0, 0.0
        for label, w in windows.items():
            rows = w.tolist()
            nll, n, ids, lps = [], [], [], []
            for i in range(0, len(rows), batch):
                chunk = rows[i : i + batch]
                t0 = time.perf_counter()
                choices = server.complete(chunk, max_tokens=1, prompt_logprobs=top_n)
                score_s += time.perf_counter() - t0
                prompt_tokens += sum(len(r) for r in chunk)
                for c, row in zip(choices, chunk):
                    v, a, b = _parse_positions(c, row, top_n)
                    nll.append(v)
                    n.append(float(len(row) - 1))
                    ids.append(a)
                    lps.append(b)
                if progress is not None:
                    progress(len(chunk))
            run.scores[label] = ReferenceTopN(nll, n, torch.stack(ids), torch.stack(lps))
            ps = prompts.get(label) or []
            if ps and gen_tokens > 0:
                t0 = time.perf_counter()
                choices = server.complete(ps, max_tokens=gen_tokens, ignore_eos=True)
                gen_s += time.perf_counter() - t0
                run.generations[label] = [list(c["token_ids"]) for c in choices]
                gen_count += sum(len(g) for g in run.generations[label])
            else:
                run.generations[label] = []
        run.throughput.update(
            prompt_tokens=prompt_tokens,
            prompt_tokens_per_s=prompt_tokens / score_s if score_s else None,
            generated_tokens=gen_count,
            generated_tokens_per_s=gen_count / gen_s if gen_s else None,
        )
        if during is not None:
            run.extra = during(server)
    return run
