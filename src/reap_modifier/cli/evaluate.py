"""``reap eval``: what a cut cost -- a reference checkpoint against candidate checkpoints on the
user's texts, with the transformers backend (exact, in this process) or vLLM (each model served
in turn).

Everything is checked before any model loads: the output directories (``-o``,
``--reference-cache``, ``--vllm-work-dir``), labels, text files (at least one window each),
checkpoints (each a directory with config.json, one vocabulary and tokenizer), the device, the
vLLM Python. Bad input exits with code 2 and one line saying what to change; a model that fails
to load also exits 2, naming it; a vLLM server that dies or answers an error exits 1 with its
log's last lines; Ctrl-C / SIGTERM exits 130 (vLLM servers stopped, nothing written).

stdout holds only results (the main table, then lm-eval's), as markdown; progress, notes,
warnings and logs go to stderr.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Literal

import typer

from ..evaluation.choices import BACKENDS, DTYPES
from .common import (
    EXIT_CHECK_FAILED,
    EXIT_INTERRUPTED,
    VLLM_ARG_OPTION,
    VLLM_PYTHON_OPTION,
    check_output_dir,
    console,
    fail,
    interruptible,
)

__all__ = ["register"]

EVAL_EXAMPLE = (
    "Examples: reap eval /models/src /models/pruned-50 --text en=en.txt --text zh=zh.jsonl -o eval/ ; "
    "reap eval /models/K3 /models/K3-448-en /models/K3-448-enzh --text en=en.jsonl --backend vllm "
    "--dtype bfloat16 --vllm-arg=--tensor-parallel-size=8 --vllm-arg=--enable-expert-parallel "
    "--reference-cache cache/K3 -o eval/"
)
EVAL_HELP = (
    "What a cut cost: NLL, paired ΔNLL, top-1 agreement, KL and greedy repeat runs of "
    "candidates against a reference."
)


def _texts(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            fail(f"--text expects LABEL=PATH (e.g. --text en=data/en.txt), got {item!r}")
        if label in out:
            fail(f"--text label {label!r} is given twice; give each label once")
        if "/" in label:
            fail(f"--text label {label!r} must not contain '/'")
        out[label] = path
    return out


def register(app: typer.Typer) -> None:
    """Add ``eval`` to ``app``."""
    app.command("eval", epilog=EVAL_EXAMPLE, help=EVAL_HELP)(eval_)


def eval_(
    reference: Path = typer.Argument(..., help="the reference checkpoint (the unpruned source)"),
    candidates: list[Path] = typer.Argument(..., help="candidate checkpoints (pruned tiers)"),
    text: list[str] = typer.Option(
        ...,
        "--text",
        help="LABEL=PATH: .txt (paragraphs), .jsonl, .json, .csv, .parquet (repeatable)",
    ),
    text_field: str = typer.Option(
        "text", "--text-field", help="the text field of .jsonl/.json/.csv rows"
    ),
    out: Path | None = typer.Option(
        None, "--out", "-o", help="write eval.json, eval.md, eval.png here"
    ),
    backend: Literal[BACKENDS] = typer.Option(
        "transformers",
        "--backend",
        help="transformers (exact, in this process) or vllm (each model served in turn)",
    ),
    dtype: Literal[DTYPES] = typer.Option(
        "auto",
        "--dtype",
        help="compute dtype, both backends (auto: the checkpoint's)",
    ),
    device: str = typer.Option(
        "cpu",
        "--device",
        help="where the transformers backend runs the models: cpu, cuda, cuda:N, or auto "
        "(device_map='auto': spread over every GPU)",
    ),
    window_tokens: int = typer.Option(256, "--window-tokens", help="tokens per window"),
    windows: int = typer.Option(64, "--windows", help="windows per text"),
    seed: int = typer.Option(1234, "--seed", help="seed of the window and prompt sampling"),
    prompt_seed: int | None = typer.Option(
        None, "--prompt-seed", help="seed of the prompt choice (default: --seed + 7)"
    ),
    prompts: int = typer.Option(
        8, "--prompts", help="greedy-continuation prompts per text (0: none)"
    ),
    prompt_tokens: int = typer.Option(16, "--prompt-tokens", help="tokens per prompt"),
    gen_tokens: int = typer.Option(48, "--gen-tokens", help="greedy tokens per prompt"),
    top_n: int = typer.Option(
        20, "--top-n", help="log-probs kept per position (vLLM backend, reference cache)"
    ),
    chunk: int = typer.Option(8, "--chunk", help="windows per forward pass (transformers backend)"),
    reference_cache: Path | None = typer.Option(
        None,
        "--reference-cache",
        help="directory of the reference's cached output (reused when it matches)",
    ),
    vllm_python: Path | None = VLLM_PYTHON_OPTION,
    vllm_arg: list[str] | None = VLLM_ARG_OPTION,
    vllm_work_dir: Path | None = typer.Option(
        None, "--vllm-work-dir", help="where vLLM server logs go"
    ),
    lm_eval: str | None = typer.Option(
        None,
        "--lm-eval",
        help="comma-separated lm-evaluation-harness tasks, run on every model (extra: reap-modifier[eval])",
    ),
    lm_eval_include: Path | None = typer.Option(
        None, "--lm-eval-include", help="directory of local lm-eval task YAMLs"
    ),
    lm_eval_limit: int | None = typer.Option(
        None, "--lm-eval-limit", help="documents per task (a quick look)"
    ),
):
    """``reap eval`` (help: :data:`EVAL_HELP`). Long only by its option declarations, which
    typer reads from the signature; the work is in the three functions below."""
    from ..evaluation import Settings

    minimums = {"--window-tokens": (window_tokens, 2), "--windows": (windows, 1)}
    minimums.update({"--chunk": (chunk, 1), "--top-n": (top_n, 1)})
    labels, tasks = _check_eval_args(
        out, reference_cache, vllm_work_dir, text, lm_eval, lm_eval_include, backend, minimums
    )

    settings = Settings(
        window_tokens=window_tokens, windows=windows, seed=seed, prompt_seed=prompt_seed, prompts=prompts,
        prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, top_n=top_n, text_field=text_field,
        dtype=dtype, backend=backend, device=device, chunk=chunk,
        vllm_python=str(vllm_python) if vllm_python else None, vllm_args=list(vllm_arg or []),
        reference_cache=str(reference_cache) if reference_cache else None,
        work_dir=str(vllm_work_dir) if vllm_work_dir else (str(out / "vllm") if out else None),
        lm_eval_tasks=tasks, lm_eval_include=str(lm_eval_include) if lm_eval_include else None,
        lm_eval_limit=lm_eval_limit,
    )  # fmt: skip
    _show_results(_run_eval(reference, candidates, labels, settings), out)


def _check_eval_args(
    out, reference_cache, vllm_work_dir, text, lm_eval, lm_eval_include, backend, minimums
) -> tuple[dict[str, str], list[str]]:
    """Every option checked before any model loads (exit 2): output directories, ``--text``
    labels, the numbers' minimums (``{flag: (value, least)}``), lm-eval's tasks. Returns the
    texts by label and the lm-eval tasks."""
    for flag, path in (
        ("-o", out),
        ("--reference-cache", reference_cache),
        ("--vllm-work-dir", vllm_work_dir),
    ):
        check_output_dir(path, flag)
    labels = _texts(text)
    for name, (v, lo) in minimums.items():
        if v < lo:
            fail(f"{name} must be at least {lo}, got {v}")
    tasks = [t.strip() for t in (lm_eval or "").split(",") if t.strip()]
    if lm_eval is not None and not tasks:
        fail("--lm-eval expects task names, e.g. --lm-eval hellaswag,arc_easy")
    if tasks:
        from ..evaluation.lm_eval import LmEvalMissing, check_lm_eval

        try:
            check_lm_eval(tasks, lm_eval_include, backend)
        except (LmEvalMissing, ValueError) as exc:
            fail(exc)
    return labels, tasks


def _run_eval(reference: Path, candidates: list[Path], labels: dict[str, str], settings) -> dict:
    """Prepare (the checks of texts, checkpoints, device, vLLM), then evaluate; bad input
    exits 2, a vLLM server that failed exits 1, an interrupt exits 130 with nothing written."""
    from ..evaluation import EvalInputError, evaluate, prepare
    from ..evaluation.vllm import served_dtype_for
    from ..serving.server import ServerError
    from ..serving.vllm_dtype import DtypeRefused

    log = lambda s: typer.echo(s, err=True)  # noqa: E731
    try:
        with interruptible():  # SIGTERM takes Ctrl-C's path: vLLM servers are stopped
            prep = prepare(str(reference), [str(c) for c in candidates], labels, settings)
            if settings.backend == "vllm":  # the dtype vLLM can serve these models in
                served = served_dtype_for(
                    [reference, *candidates], settings.dtype, prep.vllm_python, settings.vllm_args
                )
                settings.dtype = served.dtype
                prep.notes += [served.reason] if served.reason else []
            for note in prep.notes:
                typer.echo(f"note: {note}", err=True)
            for warning in prep.warnings:
                typer.echo(f"warning: {warning}", err=True)
            return evaluate(prep, log=log, command=shlex.join(["reap", *sys.argv[1:]]))
    except (EvalInputError, DtypeRefused) as exc:
        fail(exc)
    except ServerError as exc:  # a vLLM server that died or answered an error: its log tail
        fail(f"vLLM: {exc}", EXIT_CHECK_FAILED)
    except KeyboardInterrupt:
        fail("interrupted: nothing was written", EXIT_INTERRUPTED)


def _show_results(res: dict, out: Path | None) -> None:
    """The tables on stdout; ``eval.json`` / ``.md`` / ``.png`` under ``out`` when given."""
    from ..evaluation.report import lm_eval_table, main_table, write_outputs

    console.print(main_table(res), markup=False, highlight=False, soft_wrap=True)
    if res.get("lm_eval"):
        console.print("\n" + lm_eval_table(res), markup=False, highlight=False, soft_wrap=True)
    if out is not None:
        try:
            paths = write_outputs(res, out)
        except OSError as exc:  # a disk that filled, a folder removed meanwhile
            fail(exc, EXIT_CHECK_FAILED)
        typer.echo(f"wrote {paths['json']}, {paths['md']} and {paths['png']}", err=True)
