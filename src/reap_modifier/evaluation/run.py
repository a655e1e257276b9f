"""One evaluation: a reference checkpoint, candidate checkpoints, labelled texts -> results.

:func:`prepare` checks everything that can be checked before a model loads (checkpoints,
tokenizers, texts, windows, the vLLM Python) and builds the windows and prompts;
:func:`evaluate` runs the chosen backend and returns the results dict that
:mod:`.report` writes as ``eval.json`` (schema in ``docs/evaluation.md``).

Every model is evaluated on the same windows, tokenized with the reference's tokenizer. The
reference comes from the cache (``reference_cache``) when one was computed for this reference
on these windows, else it runs (and the cache is written).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from .cache import load_cache, reference_identity, save_cache
from .checkpoints import check_checkpoints, load_tokenizer
from .choices import BACKENDS, DTYPES
from .hf import ReferenceTopN, greedy_generate, run_models
from .metrics import WindowMetrics, paired_difference, repetition_stats, topn_kl
from .texts import TextError, ids_sha256, load_records, pick_prompts, sample_windows

__all__ = ["EvalInputError", "Prepared", "Settings", "device_map", "evaluate", "prepare"]


class EvalInputError(ValueError):
    """Bad input to an evaluation (exit code 2 in the CLI); the message says what to change."""


@dataclass
class Settings:
    window_tokens: int = 256
    windows: int = 64
    seed: int = 1234
    prompt_seed: int | None = None  # None: seed + 7
    prompts: int = 8
    prompt_tokens: int = 16
    gen_tokens: int = 48
    top_n: int = 20
    text_field: str = "text"
    dtype: str = "auto"
    backend: str = "transformers"
    device: str = "cpu"  # transformers backend: cpu, cuda, cuda:N, auto
    chunk: int = 8
    vllm_python: str | None = None
    vllm_args: list[str] = field(default_factory=list)
    reference_cache: str | None = None
    work_dir: str | None = None
    lm_eval_tasks: list[str] = field(default_factory=list)
    lm_eval_include: str | None = None
    lm_eval_limit: int | None = None


@dataclass
class Prepared:
    reference: str
    candidates: list[str]
    texts: dict[str, str]
    settings: Settings
    tokenizer: Any
    records: dict[str, list[dict]]
    windows: dict[str, torch.Tensor]
    prompts: dict[str, list[dict]]
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    vllm_python: str | None = None
    vllm_version: str | None = None


def device_map(device: str) -> str | dict | None:
    """``from_pretrained``'s ``device_map`` for ``--device``: ``cpu`` -> ``None``, ``cuda`` /
    ``cuda:N`` -> that GPU, ``auto`` -> ``"auto"`` (spread over every GPU, then the CPU).
    Raises :class:`EvalInputError` for another value or a GPU this machine does not have."""
    if device in ("cpu", "auto"):
        return None if device == "cpu" else "auto"
    m = re.fullmatch(r"cuda(?::(\d+))?", device)
    if m is None:
        raise EvalInputError(f"--device must be cpu, cuda, cuda:N or auto, got {device!r}")
    if not torch.cuda.is_available():
        raise EvalInputError(
            f"--device {device}: CUDA is not available (torch {torch.__version__}); "
            "use --device cpu, or run where a GPU is visible"
        )
    n, index = torch.cuda.device_count(), int(m[1] or 0)
    if index >= n:
        raise EvalInputError(
            f"--device {device}: this machine has {n} GPU(s), cuda:0..cuda:{n - 1}"
        )
    return {"": f"cuda:{index}"}


def prepare(
    reference: str, candidates: list[str], texts: dict[str, str], settings: Settings
) -> Prepared:
    """Everything checked and built before a model loads; raises :class:`EvalInputError`."""
    from .checkpoints import CheckpointInputError

    s = settings
    if s.backend not in BACKENDS:
        raise EvalInputError(f"--backend must be one of {', '.join(BACKENDS)}, got {s.backend!r}")
    if s.dtype not in DTYPES:
        raise EvalInputError(f"--dtype must be one of {', '.join(DTYPES)}, got {s.dtype!r}")
    if s.backend == "vllm" and s.device != "cpu":
        raise EvalInputError(
            "--device places the transformers backend; vLLM places the model itself "
            "(e.g. --vllm-arg=--tensor-parallel-size=8)"
        )
    device_map(s.device)
    if not candidates:
        raise EvalInputError("give at least one candidate checkpoint after the reference")
    if not texts:
        raise EvalInputError("give at least one --text LABEL=PATH")
    if s.top_n < 1:
        raise EvalInputError(f"--top-n must be at least 1, got {s.top_n}")
    if s.gen_tokens < 0 or s.prompts < 0 or s.prompt_tokens < 1:
        raise EvalInputError("--prompts / --gen-tokens must be >= 0 and --prompt-tokens >= 1")
    paths = [reference, *candidates]
    dup = sorted({p for p in paths if paths.count(p) > 1})
    if dup:
        raise EvalInputError(f"checkpoint {dup[0]} is given twice; give each model once")
    try:
        notes = check_checkpoints(Path(reference), [Path(c) for c in candidates])
        tok = load_tokenizer(reference)
    except CheckpointInputError as exc:
        raise EvalInputError(str(exc)) from None
    records, windows, prompts, warnings = {}, {}, {}, []
    for label, path in texts.items():
        try:
            records[label] = load_records(path, s.text_field)
            windows[label] = sample_windows(
                records[label], tok, s.windows, s.window_tokens, s.seed, allow_fewer=True
            )
        except TextError as exc:
            msg = str(exc)
            where = f"--text {label}={path}"
            raise EvalInputError(msg if msg.startswith(str(path)) else f"{where}: {msg}") from None
        if len(windows[label]) < s.windows:
            warnings.append(
                f"{label}: {path} holds {len(windows[label])} windows of {s.window_tokens} tokens; "
                f"using {len(windows[label])} of the {s.windows} windows asked"
            )
        pseed = s.seed + 7 if s.prompt_seed is None else s.prompt_seed
        prompts[label] = pick_prompts(records[label], tok, s.prompts, s.prompt_tokens, pseed)
        if s.prompts and len(prompts[label]) < s.prompts:
            notes.append(
                f"{label}: only {len(prompts[label])} paragraphs hold {s.prompt_tokens + 4} tokens "
                f"for the {s.prompts} prompts asked"
            )
    prep = Prepared(
        reference, list(candidates), dict(texts), s, tok, records, windows, prompts, notes, warnings
    )
    if s.backend == "vllm":
        from ..serving.vllm_check import VllmNotFound, find_vllm_python

        try:
            info = find_vllm_python(s.vllm_python)
        except VllmNotFound as exc:
            raise EvalInputError(str(exc)) from None
        prep.vllm_python, prep.vllm_version = info.python, info.version
    return prep


def _cache_meta(prep: Prepared) -> dict:
    s = prep.settings
    return {
        "reference": prep.reference,
        "reference_identity": reference_identity(prep.reference),
        "backend": s.backend,
        "dtype": s.dtype,
        "top_n": s.top_n,
        "gen_tokens": s.gen_tokens,
        "lm_eval": {"spec": _lm_eval_spec(s)} if s.lm_eval_tasks else None,
        "labels": {
            label: {
                "windows_sha256": ids_sha256(prep.windows[label]),
                "prompts_sha256": ids_sha256([p["ids"] for p in prep.prompts[label]] or [[]]),
            }
            for label in prep.windows
        },
    }


def _lm_eval_spec(s: Settings) -> dict:
    return {"tasks": list(s.lm_eval_tasks), "limit": s.lm_eval_limit, "include": s.lm_eval_include}


def _load_model(path: str, dtype: str, device: str = "cpu"):
    from ..models.loading import load_checkpoint_model

    try:
        return load_checkpoint_model(path, dtype=dtype, device_map=device_map(device))
    except Exception as exc:  # noqa: BLE001 - named and re-raised as bad input
        raise EvalInputError(
            f"{path}: transformers could not load the checkpoint ({type(exc).__name__}: {exc})"
        ) from None


def evaluate(
    prep: Prepared,
    *,
    log: Callable[[str], None] = lambda s: None,
    command: str | None = None,
) -> dict:
    """Run the evaluation; returns the results dict (see :mod:`.report`)."""
    s = prep.settings
    t_start = time.time()
    meta = _cache_meta(prep) if s.reference_cache else {}
    cached = None
    if s.reference_cache:
        cached, why = load_cache(s.reference_cache, meta)
        log(
            f"reference cache {s.reference_cache}: "
            + ("reused" if cached else f"not reused ({why}); computing the reference")
        )
    lm: dict[str, dict] = {}
    if cached and s.lm_eval_tasks:
        lm[prep.reference] = cached[2]["lm_eval"]["results"]
    if s.backend == "transformers":
        summaries, gens, ref_top, ref_gens, throughput = _run_transformers(prep, cached, log, lm)
    else:
        summaries, gens, ref_top, ref_gens, throughput = _run_vllm(prep, cached, log, lm)
    if s.reference_cache and not cached and ref_top is not None:
        if s.lm_eval_tasks:
            meta["lm_eval"] = {"spec": _lm_eval_spec(s), "results": lm.get(prep.reference)}
        try:
            save_cache(s.reference_cache, meta, ref_top, ref_gens)
            log(f"wrote the reference cache {s.reference_cache}")
        except OSError as exc:  # a cache is an optimisation: the results stand without it
            log(f"warning: could not write the reference cache {s.reference_cache}: {exc}")
    res = _results(prep, summaries, gens, throughput, cached is not None, command, t_start)
    if s.lm_eval_tasks:
        res["lm_eval"] = {
            **_lm_eval_spec(s),
            "results": {n: lm.get(n) for n in [prep.reference, *prep.candidates]},
        }
    return res


# ----------------------------------------------------------------------------- backends


def _reference_summary(ref: ReferenceTopN) -> dict:
    out = WindowMetrics(nll=list(ref.nll), n=list(ref.n)).summary()
    out.update(top1_agreement=1.0, kl=0.0)
    return out


def _generate(model, prompts: list[dict], gen_tokens: int, progress=None) -> list[list[int]]:
    if not prompts or gen_tokens <= 0:
        return []
    batch = torch.tensor([p["ids"] for p in prompts], dtype=torch.long)
    return greedy_generate(model, batch, gen_tokens, progress=progress).tolist()


def _run_transformers(prep: Prepared, cached, log, lm: dict):
    from tqdm.auto import tqdm

    s = prep.settings
    names = ([] if cached else [prep.reference]) + prep.candidates
    models = {}
    for name in names:
        log(f"loading {name} (transformers, dtype={s.dtype}, device={s.device})")
        models[name] = _load_model(name, s.dtype, s.device)
    summaries: dict[str, dict[str, dict]] = {n: {} for n in [prep.reference, *prep.candidates]}
    gens: dict[str, dict[str, list]] = {n: {} for n in summaries}
    ref_top: dict[str, ReferenceTopN] = {}
    total = sum(int(w.shape[0]) for w in prep.windows.values()) * len(models)
    t0 = time.perf_counter()
    with torch.no_grad(), tqdm(total=total, desc="evaluate (windows x models)", unit="win") as bar:
        for label, w in prep.windows.items():
            res, top = run_models(
                models,
                w,
                prep.reference,
                chunk=s.chunk,
                progress=bar.update,
                top_n=s.top_n if (s.reference_cache and not cached) else 0,
                cached=cached[0][label] if cached else None,
            )
            for name, r in res.items():
                summaries[name][label] = r
            if cached:
                summaries[prep.reference][label] = _reference_summary(cached[0][label])
            elif top is not None:
                ref_top[label] = top
    score_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    steps = sum(1 for ps in prep.prompts.values() if ps) * s.gen_tokens * len(models)
    with tqdm(total=steps, desc="greedy generation (tokens x texts x models)", unit="tok") as bar:
        for name, model in models.items():
            for label in prep.windows:
                gens[name][label] = _generate(
                    model, prep.prompts[label], s.gen_tokens, progress=bar.update
                )
    if cached:
        gens[prep.reference] = cached[1]
    gen_s = time.perf_counter() - t0
    if s.lm_eval_tasks:
        from .lm_eval import run_on_model

        for name, model in models.items():
            log(f"lm-eval {','.join(s.lm_eval_tasks)} on {name} (transformers)")
            lm[name] = run_on_model(
                model,
                prep.tokenizer,
                s.lm_eval_tasks,
                include_path=s.lm_eval_include,
                limit=s.lm_eval_limit,
            )
    del models
    throughput = {"timing": {"score_s": round(score_s, 3), "generate_s": round(gen_s, 3)}}
    ref_gens = gens[prep.reference]
    return summaries, gens, (ref_top or None), ref_gens, throughput


def _compare(ref: ReferenceTopN, cand: ReferenceTopN) -> dict:
    """Metrics of a served candidate against the reference's top-N output on the same windows."""
    wm = WindowMetrics(nll=list(cand.nll), n=list(cand.n))
    agree = (cand.top_ids[..., 0] == ref.top_ids[..., 0]).double().sum(-1)
    N, P, K = ref.top_ids.shape
    kl, tail = topn_kl(
        ref.top_ids.reshape(N * P, K).long(),
        ref.top_lp.reshape(N * P, K),
        cand.top_ids.reshape(N * P, -1).long(),
        cand.top_lp.reshape(N * P, -1),
    )
    wm.agree = agree.tolist()
    wm.kl = kl.view(N, P).sum(-1).tolist()
    wm.tail = tail.view(N, P).sum(-1).tolist()
    return wm.summary()


def _run_vllm(prep: Prepared, cached, log, lm: dict):
    from tqdm.auto import tqdm

    from .vllm import serve_and_score

    s = prep.settings
    work = Path(s.work_dir) if s.work_dir else Path(os.environ.get("TMPDIR", "/tmp")) / "reap-eval"
    prompts = {label: [p["ids"] for p in ps] for label, ps in prep.prompts.items()}
    names = ([] if cached else [prep.reference]) + prep.candidates
    served = {}
    total = sum(int(w.shape[0]) for w in prep.windows.values()) * len(names)
    with tqdm(total=total, desc="evaluate with vLLM (windows x models)", unit="win") as bar:
        for k, name in enumerate(names):
            log(f"serving {name} with vLLM {prep.vllm_version} (dtype={s.dtype})")
            served[name] = serve_and_score(
                prep.vllm_python,
                name,
                prep.windows,
                prompts,
                top_n=s.top_n,
                gen_tokens=s.gen_tokens,
                dtype=s.dtype,
                server_args=s.vllm_args,
                log_path=work / f"vllm-server-{k}.log",
                progress=bar.update,
                during=_lm_eval_on_server(prep, name, log) if s.lm_eval_tasks else None,
            )
            if s.lm_eval_tasks:
                lm[name] = served[name].extra
    if cached:
        ref_top, ref_gens = cached[0], cached[1]
        ref_throughput = None
    else:
        ref_top, ref_gens = served[prep.reference].scores, served[prep.reference].generations
        ref_throughput = served[prep.reference].throughput
    summaries = {
        prep.reference: {label: _reference_summary(ref_top[label]) for label in prep.windows}
    }
    gens = {prep.reference: ref_gens}
    throughput = {prep.reference: ref_throughput} if ref_throughput else {}
    for name in prep.candidates:
        run = served[name]
        summaries[name] = {
            label: _compare(ref_top[label], run.scores[label]) for label in prep.windows
        }
        gens[name] = run.generations
        throughput[name] = run.throughput
    return summaries, gens, (None if cached else ref_top), ref_gens, throughput


def _lm_eval_on_server(prep: Prepared, name: str, log):
    s = prep.settings

    def run(server):
        from ..serving.server import SERVED_NAME
        from .lm_eval import run_on_server

        log(f"lm-eval {','.join(s.lm_eval_tasks)} on {name} (vLLM local-completions)")
        return run_on_server(
            server.url,
            SERVED_NAME,
            prep.reference,
            s.lm_eval_tasks,
            include_path=s.lm_eval_include,
            limit=s.lm_eval_limit,
            max_length=server.max_model_len,
        )

    return run


# ----------------------------------------------------------------------------- results


def _model_entry(r: dict, rows: list[dict], ref_summary: dict | None) -> dict:
    """One model's numbers on one text (``r``: its summary; ``rows``: its generations;
    ``ref_summary``: the reference's summary, ``None`` for the reference itself)."""
    is_ref = ref_summary is None
    runs = [row["repeat_run_tokens"] for row in rows]
    entry = {
        "nll": r["nll"],
        "nll_se": r["nll_se"],
        "ppl": r["ppl"],
        "top1": r.get("top1_agreement") if not is_ref else 1.0,
        "kl": r.get("kl") if not is_ref else None,
        "repeat_run_max": max(runs) if runs else None,
        "repeat_run_mean": sum(runs) / len(runs) if runs else None,
        "repeat_run_chars_max": max((row["repeat_run_chars"] for row in rows), default=None),
        "tokens": r["tokens"],
        "windows": r["windows"],
        "nll_per_window": r["nll_per_window"],
    }
    if "kl_tail_mass" in r and not is_ref:
        entry["kl_tail_mass"] = r["kl_tail_mass"]
    if not is_ref:
        entry["vs_reference"] = paired_difference(
            ref_summary["nll_per_window"], r["nll_per_window"]
        )
    return entry


def _paired_candidates(cands: list[str], labels, models: dict) -> list[dict]:
    """Every pair of candidates' paired NLL difference, per text."""
    paired = []
    for i, a in enumerate(cands):
        for b in cands[i + 1 :]:
            row = {"a": a, "b": b}
            for label in labels:
                row[label] = paired_difference(
                    models[a][label]["nll_per_window"], models[b][label]["nll_per_window"]
                )
            paired.append(row)
    return paired


def _results(prep: Prepared, summaries, gens, throughput, from_cache, command, t_start) -> dict:
    """``eval.json``'s content: settings, texts, every model's numbers and generations."""
    s = prep.settings
    tok = prep.tokenizer
    ref = prep.reference
    models, generations = {}, {}
    for name in [ref, *prep.candidates]:
        models[name], generations[name] = {}, {}
        for label in prep.windows:
            rows = []
            for p, ids in zip(prep.prompts[label], gens[name].get(label) or []):
                text = tok.decode(ids)
                rows.append(
                    {"prompt": p["ids"], "ids": ids, "text": text, **repetition_stats(ids, text)}
                )
            generations[name][label] = rows
            ref_summary = summaries[ref][label] if name != ref else None
            models[name][label] = _model_entry(summaries[name][label], rows, ref_summary)
    cands = prep.candidates
    paired = _paired_candidates(cands, prep.windows, models)
    exact = s.backend == "transformers" and not from_cache
    from .. import __version__

    return {
        "format": "reap-eval",
        "version": 1,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": command,
        "reap_modifier": __version__,
        "backend": s.backend,
        "dtype": s.dtype,
        "reference": ref,
        "candidates": list(cands),
        "settings": {k: v for k, v in asdict(s).items() if k not in ("backend", "dtype")},
        "kl_exact": exact,
        "kl_method": "exact"
        if exact
        else f"top-{s.top_n} estimate (a lower bound; see kl_tail_mass)",
        "reference_from_cache": from_cache,
        "vllm": {"python": prep.vllm_python, "version": prep.vllm_version}
        if prep.vllm_python
        else None,
        "texts": {
            label: {
                "path": prep.texts[label],
                "paragraphs": len(prep.records[label]),
                "windows": int(prep.windows[label].shape[0]),
                "window_tokens": int(prep.windows[label].shape[1]),
                "predicted_tokens": int(prep.windows[label][:, 1:].numel()),
                "windows_sha256": ids_sha256(prep.windows[label]),
                "prompts": len(prep.prompts[label]),
            }
            for label in prep.windows
        },
        "models": models,
        "paired": paired,
        "generations": generations,
        "throughput": {k: v for k, v in throughput.items() if k != "timing"},
        "timing": throughput.get("timing"),
        "notes": prep.notes,
        "warnings": prep.warnings,
        "seconds": round(time.time() - t_start, 2),
    }
