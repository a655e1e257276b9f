"""Stage 5 of the main job: the stages' records as the JSON-able ``results.json`` document, with
the paired per-window differences that answer the job's questions (:func:`paired_rows`, read
from the method table)."""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from ..reporting import jsonable
from .calibrate import Calibration
from .comparison import Comparison
from .config import (
    BEST_METHOD,
    HEADLINE_METHOD,
    LANGS,
    METHODS,
    RANKINGS,
    DemoConfig,
    objective_pairs,
)
from .inputs import Inputs
from .provenance import compare_corpora, corpus_manifest
from .prune import Pruning
from .quality import generation_summary
from .workspace import Clock, environment_versions, relative_to


def paired_rows(names) -> list[tuple[str, str, tuple[str, ...]]]:
    """``(first, second, metrics)`` of every paired difference among the models ``names``, at
    every sparsity the job ran (the job's first, then each ``_<percent>`` suffix): consecutive
    REAP calibration mixes (NLL), each other non-fit method against :data:`HEADLINE_METHOD`
    (NLL), each cut against the same cut with its post-cut fit (NLL and KL), each fit whose
    selection minimises the worst language's error against the same fit with the pooled
    objective (NLL and KL: :func:`~.config.objective_pairs`), and each baseline against
    :data:`BEST_METHOD` (NLL and KL)."""
    names = set(names)
    suffixes = [""] + sorted(
        {"_" + n.rsplit("_", 1)[1] for n in names if n.rsplit("_", 1)[-1].isdigit()}
    )
    mixes = [m.name for m in METHODS if m.role == "mix"]
    rows = [(a, b, ("nll",)) for a, b in zip(mixes, mixes[1:])]
    rows += [
        (m.name, HEADLINE_METHOD, ("nll",))
        for m in METHODS
        if m.role != "fit" and m.name != HEADLINE_METHOD
    ]
    rows += [(m.fit_of, m.name, ("nll", "kl")) for m in METHODS if m.role == "fit"]
    rows += [(a, b, ("nll", "kl")) for a, b in objective_pairs()]
    rows += [(m.name, BEST_METHOD, ("nll", "kl")) for m in METHODS if m.role == "baseline"]
    out: list[tuple[str, str, tuple[str, ...]]] = []
    for sfx in suffixes:
        for a, b, metrics in rows:
            a, b = a + sfx, b + sfx
            if a in names and b in names and (a, b) not in {(x, y) for x, y, _ in out}:
                out.append((a, b, metrics))
    return out


def paired_differences(quality: dict) -> list[dict]:
    """The differences of :func:`paired_rows`, paired per window (second minus first): NLL per
    language, and KL to the unpruned model under ``kl`` where the row asks for it."""
    from ..evaluation import paired_difference

    out = []
    for a, b, metrics in paired_rows(quality):
        row = {"a": a, "b": b}
        for lang in LANGS:
            row[lang] = paired_difference(
                quality[a][lang]["nll_per_window"], quality[b][lang]["nll_per_window"]
            )
            if "kl" in metrics:
                row.setdefault("kl", {})[lang] = paired_difference(
                    quality[a][lang]["kl_per_window"], quality[b][lang]["kl_per_window"]
                )
        out.append(row)
    return out


def model_card_eval(model_dir: Path, cfg: DemoConfig, data_dir: Path) -> dict | None:
    """The bundled model card's evaluation settings, whether the job uses the same windows, and
    which corpus splits differ from the ones the card was measured on."""
    card_path = model_dir / "model_card.json"
    if not card_path.is_file():
        return None
    c = json.loads(card_path.read_text())
    ev = c.get("eval", {})
    card = {
        "loss": ev.get("loss"),
        "windows_per_lang": ev.get("windows_per_lang"),
        "seq_len": ev.get("seq_len"),
        "window_seed": ev.get("window_seed"),
    }
    card["same_windows"] = (
        cfg.split == "eval"
        and card["windows_per_lang"] == cfg.eval_windows
        and card["seq_len"] == cfg.eval_seq_len
        and card["window_seed"] == cfg.eval_seed
    )
    card["corpora"] = compare_corpora(c.get("corpora"), corpus_manifest(data_dir))
    return card


def assemble_results(
    cfg: DemoConfig,
    command: str | None,
    model_dir: Path,
    data_dir: Path,
    out: Path,
    inputs: Inputs,
    calib: Calibration,
    pruning: Pruning,
    quality: dict,
    generations: dict,
    comparison: Comparison,
    clock: Clock,
) -> dict:
    """Stage 5: the stages' records as the JSON-able ``results.json`` document. (Long only
    because it is the document's layout written out as one literal.)"""
    from . import data as D

    merged, scores_dir = calib.merged, out / "scores"
    src_dir = pruning.src_dir
    results = {
        "format": "reap-demo-results",
        "version": 1,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": command,
        "config": asdict(cfg),
        "model": {
            "path": str(model_dir),
            "model_card": model_card_eval(model_dir, cfg, data_dir),
            "checkpoint_source": relative_to(src_dir, out)
            if src_dir != model_dir
            else str(model_dir),
            "left_out_of_checkpoint_source": pruning.left_out,
            "num_experts": merged["D"].num_experts,
            "top_k": merged["D"].metadata.get("top_k"),
            "moe_layers": merged["D"].layer_names,
            "model_class": merged["D"].metadata.get("model_class"),
        },
        "data": {
            "dir": str(data_dir),
            "eval_paragraphs_per_source": {
                lang: D.source_counts(inputs.evals[lang]) for lang in LANGS
            },
        },
        "calibration": {
            "runs": calib.runs,
            "packed_check": calib.packed_check,
            "rankings": {
                label: {
                    "parts": list(names),
                    "tokens": merged[label].source_tokens(),
                    "scores": relative_to(scores_dir / f"{label}.safetensors", out),
                }
                for label, names in RANKINGS.items()
            },
        },
        "pruning": pruning.records,
        "eval": {
            "split": cfg.split,
            "windows_per_lang": cfg.eval_windows,
            "seq_len": cfg.eval_seq_len,
            "seed": cfg.eval_seed if cfg.split == "eval" else cfg.dev_seed,
            "tokens_per_lang": {lang: int(inputs.windows[lang][:, 1:].numel()) for lang in LANGS},
            "quality": quality,
        },
        "paired": paired_differences(quality),
        "generations": {
            "prompts": {
                lang: [{k: p[k] for k in ("source", "ids", "text")} for p in inputs.prompts[lang]]
                for lang in LANGS
            },
            "new_tokens": cfg.gen_tokens,
            "by_model": generations,
            "summary": generation_summary(generations),
        },
        "compare": jsonable(comparison.cmp),
        "flips_by_sparsity": jsonable(comparison.flips_by_sparsity),
        "tiers": {
            "keeps": comparison.tier_keeps,
            "rows": jsonable(comparison.tiers["tiers"]),
            "answer": comparison.tiers.get("answer"),
        },
        "timing": {**clock.stages, "total": clock.total()},
        "versions": environment_versions(),
    }
    results["timing"]["total"] = clock.total()
    return jsonable(results)
