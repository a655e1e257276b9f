"""Standard benchmarks through lm-evaluation-harness (the optional extra ``reap-modifier[eval]``).

The same models the evaluation runs, side by side: with the transformers backend, the already
loaded model through lm-eval's ``HFLM`` (so checkpoints load exactly as for the other metrics);
with vLLM, the server that scores the windows, through lm-eval's ``local-completions`` model
(loglikelihood requests: token ids, ``echo`` + ``logprobs``). Each task's metrics are reported
with lm-eval's standard errors. ``include_path`` adds local task YAMLs (how offline tests and
private benchmarks run).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["LmEvalMissing", "check_lm_eval", "run_on_model", "run_on_server", "summarize"]

INSTALL = "pip install 'reap-modifier[eval]' (lm-eval[api] 0.4.13)"


class LmEvalMissing(RuntimeError):
    """lm-evaluation-harness is not installed (a usage error: exit code 2)."""


def _task_manager(include_path: str | Path | None):
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise LmEvalMissing(f"--lm-eval needs lm-evaluation-harness: {INSTALL}") from None
    return TaskManager(include_path=str(include_path) if include_path else None)


def check_lm_eval(
    tasks: list[str], include_path: str | Path | None = None, backend: str = "transformers"
) -> None:
    """Raise :class:`LmEvalMissing` without lm-eval (or, for vLLM, without its API model's
    packages), ``ValueError`` for an unknown task."""
    if backend == "vllm":
        import importlib.util

        missing = [
            m for m in ("tenacity", "aiohttp", "requests") if not importlib.util.find_spec(m)
        ]
        if missing:
            raise LmEvalMissing(
                f"--lm-eval with --backend vllm needs lm-eval's API model ({', '.join(missing)} "
                f"missing): {INSTALL}"
            )
    if include_path is not None and not Path(include_path).is_dir():
        raise ValueError(f"--lm-eval-include {include_path} is not a directory of task YAMLs")
    tm = _task_manager(include_path)
    known = set(tm.all_tasks)
    for t in tasks:
        if t not in known:
            raise ValueError(
                f"unknown lm-eval task {t!r}; check the name (`lm-eval ls tasks`) or give the "
                "directory of its YAML with --lm-eval-include"
            )


def summarize(raw: dict) -> dict[str, dict[str, dict]]:
    """lm-eval's ``results`` -> ``{task: {metric: {"value", "stderr"}}}`` (filter names kept
    when not ``none``)."""
    out: dict[str, dict[str, dict]] = {}
    for task, vals in (raw.get("results") or {}).items():
        m: dict[str, dict] = {}
        for key, v in vals.items():
            if "," not in key or "_stderr" in key.split(",")[0]:
                continue
            metric, filt = key.split(",", 1)
            name = metric if filt == "none" else f"{metric},{filt}"
            se = vals.get(f"{metric}_stderr,{filt}")
            m[name] = {
                "value": float(v) if isinstance(v, (int, float)) else None,
                "stderr": float(se) if isinstance(se, (int, float)) else None,
            }
        out[task] = m
    return out


def _evaluate(lm: Any, tasks: list[str], include_path, limit) -> dict:
    from lm_eval import simple_evaluate

    raw = simple_evaluate(
        model=lm,
        tasks=tasks,
        task_manager=_task_manager(include_path),
        limit=limit,
        bootstrap_iters=1000,
        log_samples=False,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    return summarize(raw or {})


def run_on_model(
    model, tokenizer, tasks: list[str], *, include_path=None, limit=None, batch_size: int = 8
) -> dict:
    """lm-eval on a loaded transformers model (on the device it was loaded on)."""
    from lm_eval.models.huggingface import HFLM

    from .hf import input_device

    device = str(input_device(model))
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device)
    return _evaluate(lm, tasks, include_path, limit)


def run_on_server(
    url: str,
    served_name: str,
    tokenizer_path: str,
    tasks: list[str],
    *,
    include_path=None,
    limit=None,
    max_length: int = 2048,
    log: Callable[[str], None] = lambda s: None,
) -> dict:
    """lm-eval through a running vLLM OpenAI server (``local-completions``, token-id requests)."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(
        base_url=f"{url}/v1/completions",
        model=served_name,
        tokenizer=tokenizer_path,
        tokenizer_backend="huggingface",
        tokenized_requests=True,
        max_length=max_length,
        num_concurrent=1,
        max_retries=1,
        trust_remote_code=True,
    )
    return _evaluate(lm, tasks, include_path, limit)
