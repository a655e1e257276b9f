"""Stage 3 of the main job: every model (unpruned, each pruned checkpoint, the no-routed-experts
ablation) evaluated against the unpruned one on held-out windows, and greedy generations with
their repetition statistics."""

from __future__ import annotations

from pathlib import Path

from .config import ABLATION, LANGS, REFERENCE, DemoConfig
from .inputs import Inputs
from .workspace import load_model


def load_models(cfg: DemoConfig, model_dir: Path, pruned_dir: Path, names: list[str]) -> dict:
    """The unpruned model, the pruned checkpoint of each of ``names``, and the no-routed-experts
    ablation."""
    from ..evaluation import zero_routed_experts

    models = {REFERENCE: load_model(model_dir, dtype=cfg.dtype)}
    for name in names:
        models[name] = load_model(pruned_dir / name, dtype=cfg.dtype)
    models[ABLATION] = load_model(model_dir, dtype=cfg.dtype)
    zero_routed_experts(models[ABLATION])
    return models


def evaluate_quality(cfg: DemoConfig, models: dict, windows: dict) -> dict[str, dict[str, dict]]:
    """Stage 3: every model against the unpruned one on each language's held-out windows."""
    from tqdm.auto import tqdm

    from ..evaluation import evaluate_models

    quality: dict[str, dict[str, dict]] = {}
    total = sum(int(w.shape[0]) for w in windows.values()) * len(models)
    with tqdm(
        total=total, desc="evaluate (windows x models)", unit="win", dynamic_ncols=True
    ) as bar:
        for lang in LANGS:
            res = evaluate_models(
                models, windows[lang], REFERENCE, chunk=cfg.eval_chunk, progress=bar.update
            )
            for name, r in res.items():
                quality.setdefault(name, {})[lang] = r
    return quality


def generate_texts(cfg: DemoConfig, models: dict, inputs: Inputs) -> dict[str, list[dict]]:
    """Stage 3b: greedy generations of every model from the same prompts, with repetition stats."""
    import torch
    from tqdm.auto import tqdm

    from ..evaluation import greedy_generate, repetition_stats

    prompts = inputs.prompts
    generations: dict[str, list[dict]] = {}
    batch = torch.tensor([p["ids"] for lang in LANGS for p in prompts[lang]], dtype=torch.long)
    where = [(lang, i) for lang in LANGS for i in range(len(prompts[lang]))]
    with tqdm(
        total=len(models) * cfg.gen_tokens,
        desc="greedy generations",
        unit="tok",
        dynamic_ncols=True,
    ) as bar:
        for name, model in models.items():
            gen = greedy_generate(model, batch, cfg.gen_tokens, progress=bar.update)
            rows = []
            for (lang, i), ids in zip(where, gen.tolist()):
                text = inputs.tokenizer.decode(ids)
                rows.append(
                    {
                        "lang": lang,
                        "prompt": i,
                        "ids": ids,
                        "text": text,
                        **repetition_stats(ids, text),
                    }
                )
            generations[name] = rows
    return generations


def generation_summary(generations: dict) -> dict:
    """Per model and language: the longest repeat run over the prompts (tokens, characters) and
    the mean over prompts (tokens); ``all``: the maxima over languages."""
    out = {}
    for name, rows in generations.items():
        s = {}
        for lang in LANGS:
            rs = [r for r in rows if r["lang"] == lang]
            s[lang] = {
                "max_repeat_run_tokens": max((r["repeat_run_tokens"] for r in rs), default=0),
                "max_repeat_run_chars": max((r["repeat_run_chars"] for r in rs), default=0),
            }
        for lang in LANGS:
            rs = [r for r in rows if r["lang"] == lang]
            s[lang]["mean_repeat_run_tokens"] = sum(r["repeat_run_tokens"] for r in rs) / max(
                1, len(rs)
            )
        s["all"] = {
            k: max(s[lang][k] for lang in LANGS)
            for k in ("max_repeat_run_tokens", "max_repeat_run_chars")
        }
        out[name] = s
    return out
