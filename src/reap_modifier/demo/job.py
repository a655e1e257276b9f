"""The main job's stages: calibrate once per corpus, merge, cut plans, prune bit-exact,
verify, evaluate, compare rankings; :func:`run` ties them together (see the package
docstring for the whole story)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..reporting import jsonable
from .config import (
    ABLATION,
    FIT_PARTS,
    FLIP_SPARSITIES,
    LANGS,
    PARTS,
    QUICK,
    RANKINGS,
    REFERENCE,
    YARDSTICK,
    DemoConfig,
    choose_threads,
    job_methods,
)
from .provenance import compare_corpora, corpus_manifest
from .report import flip_rows, pair_routing, render_report, write_plots
from .workspace import (
    Clock,
    checkpoint_source,
    ensure_corpora,
    environment_versions,
    load_model,
    log_line,
    prepare_out_dir,
    relative_to,
)

# ----------------------------------------------------------------------------- 1. calibration


def calibration_sets(records: dict[str, list], tokenizer, cfg: DemoConfig) -> dict[str, Any]:
    """One ``datasets.Dataset`` per part. English calibration paragraphs are shuffled with the seed
    and dealt alternately into two disjoint halves (parts en1 / en2), each sampled across sources."""
    from .data import calibration_dataset, shuffled

    en = shuffled(records["en"], cfg.seed + 11)
    pools = {"en1": en[0::2], "en2": en[1::2], "zh": records["zh"], "code": records["code"]}
    out = {}
    for k, (part, lang) in enumerate(PARTS):
        out[part] = calibration_dataset(
            {lang: pools[part]},
            tokenizer,
            cfg.tokens_per_part,
            seq_len=cfg.calib_seq_len,
            seed=cfg.seed + 101 * k,
        )
    return out


def calibrate(
    model_dir: str,
    part: str,
    lang: str,
    dataset,
    tokenizer,
    scores_path: Path,
    cfg: DemoConfig,
    dequantize: str = "layer",
) -> dict:
    """REAP calibration of one part through ``oneshot``; only the scores file is kept. The model is
    loaded with its MXFP4 experts packed and calibrated one MoE layer dense at a time
    (``dequantize="layer"``), or fully decompressed (``dequantize="model"``, the dense path)."""
    from llmcompressor import oneshot

    from ..modifier import REAPPruningModifier

    model = load_model(model_dir, packed=dequantize != "model", dtype=cfg.dtype)
    modifier = REAPPruningModifier(
        sparsity=cfg.sparsity,
        saliency="reap",
        scores_path=str(scores_path),
        calibration_source=lang,
        seed=cfg.seed,
        dequantize=dequantize,
    )
    t = time.time()
    oneshot(
        model=model,
        recipe=[modifier],
        processor=tokenizer,
        dataset=dataset,
        num_calibration_samples=len(dataset),
        moe_calibrate_all_experts=False,
    )
    seconds = time.time() - t
    del model
    meta = json.loads(dataset.info.description or "{}")
    packed = modifier.packed.stats if modifier.packed is not None else None
    return {
        "part": part,
        "source": lang,
        "rows": len(dataset),
        "tokens": int(sum(len(r) for r in dataset["input_ids"])),
        "source_tokens": meta.get("source_tokens", {}).get(lang, {}),
        "scores": str(scores_path),
        "seconds": round(seconds, 2),
        "dequantize": dequantize,
        "dequantized_modules": packed.dequantized_modules if packed else None,
        "peak_dense_expert_mib": round(packed.peak_dense_bytes / 2**20, 3) if packed else None,
    }


def check_packed_scores(
    model_dir: str, part: str, lang: str, dataset, tokenizer, packed_scores: Path, cfg: DemoConfig
) -> dict:
    """Calibrate ``part`` again on the fully decompressed model and compare every statistic with the
    packed run's; raises when any differs by more than 1e-6 relative."""
    from ..scores import ExpertScores, scores_difference

    dense_path = packed_scores.with_name(f"{packed_scores.stem}.dense-check.safetensors")
    run = calibrate(model_dir, part, lang, dataset, tokenizer, dense_path, cfg, dequantize="model")
    diff = scores_difference(ExpertScores.load(packed_scores), ExpertScores.load(dense_path))
    check = {
        "part": part,
        "dense_scores": str(dense_path),
        "dense_seconds": run["seconds"],
        "tolerance": 1e-6,
        **diff,
        "equal": diff["max_rel"] <= 1e-6,
    }
    if not check["equal"]:
        raise RuntimeError(
            f"packed calibration of {part} differs from the dense path by "
            f"{diff['max_rel']:.3g} relative ({diff['by_stat']})"
        )
    return check


# ----------------------------------------------------------------------------- 3. prompts


def pick_prompts(records: list, tokenizer, n: int, prompt_tokens: int, seed: int) -> list[dict]:
    """``n`` prompts (the first ``prompt_tokens`` tokens of held-out paragraphs, sources taken in
    turn, seeded: :func:`reap_modifier.evaluation.texts.pick_prompts`) with their text."""
    from ..evaluation.texts import pick_prompts as pick

    out = pick(records, tokenizer, n, prompt_tokens, seed)
    if len(out) < n:
        raise ValueError(f"fewer than {n} held-out paragraphs hold {prompt_tokens + 4} tokens")
    return [{**p, "text": tokenizer.decode(p["ids"])} for p in out]


# ----------------------------------------------------------------------------- the job


@dataclass
class Inputs:
    """Stage 0: the tokenizer, the corpora's held-out records, the calibration sets per part, the
    evaluation windows and the generation prompts per language."""

    tokenizer: Any
    evals: dict[str, list]
    sets: dict[str, Any]
    windows: dict[str, Any]
    prompts: dict[str, list[dict]]


@dataclass
class Calibration:
    """Stage 1: one oneshot run per part, the packed-vs-dense check, the parts' and the merged
    rankings' scores (also written under ``out/scores``)."""

    runs: list[dict]
    packed_check: dict
    parts: dict[str, Any]
    merged: dict[str, Any]


@dataclass
class Pruning:
    """Stage 2: each method's plan and its record (checkpoint, verification, masses, overlap)."""

    src_dir: Path  # the checkpoint the rewriter reads
    left_out: Any  # files of the model folder left out of it
    plans: dict[str, Any]  # by method
    records: dict[str, dict]  # by method


@dataclass
class Comparison:
    """Stage 4: the rankings' comparison, flips per sparsity and the tiers report."""

    cmp: dict
    flips_by_sparsity: dict
    tier_keeps: list[int]
    tiers: dict


def run(cfg: DemoConfig, log: Callable[[str], None] = log_line, command: str | None = None) -> dict:
    """Run the whole job; returns the results dict (also written to ``out/results.json``).
    ``command`` is recorded as the command line that produced the report."""
    import torch

    from . import data as D

    clock = Clock()
    if cfg.quick:
        cfg = DemoConfig(**{**asdict(cfg), **QUICK})
    threads, why = choose_threads(cfg.threads)
    cfg = replace(cfg, threads=threads)
    log(why)
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    model_dir = Path(cfg.model)
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"model not found: {model_dir} has no config.json (pass --model PATH)")
    out = Path(cfg.out)
    prepare_out_dir(out)
    data_dir = Path(cfg.data_dir) if cfg.data_dir else D.default_data_dir()

    with clock.stage("corpora", log):
        inputs = load_inputs(cfg, model_dir, data_dir, log)
    with clock.stage("calibrate", log):
        calib = calibrate_parts(cfg, model_dir, inputs, out / "scores", log)
    src_dir, left_out = checkpoint_source(model_dir, out, log)
    (out / "pruned").mkdir(parents=True, exist_ok=True)
    with clock.stage("prune + verify", log):
        pruning = prune_and_verify(cfg, src_dir, left_out, out, calib, inputs)
    with clock.stage("evaluate", log):
        models = load_models(cfg, model_dir, out / "pruned", pruning)
        quality = evaluate_quality(cfg, models, inputs.windows)
    with clock.stage("generate", log):
        generations = generate_texts(cfg, models, inputs)
        del models
    with clock.stage("compare + tiers", log):
        comparison = compare_and_tiers(cfg, out, calib)

    results = assemble_results(
        cfg, command, model_dir, data_dir, out, inputs, calib, pruning, quality, generations,
        comparison, clock,
    )  # fmt: skip
    write_plots(results, out)
    (out / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    (out / "report.md").write_text(render_report(results))
    log(
        f"wrote {out / 'report.md'} and {out / 'results.json'} ({results['timing']['total']:.0f} s)"
    )
    return results


def load_inputs(cfg: DemoConfig, model_dir: Path, data_dir: Path, log) -> Inputs:
    """Stage 0: corpora (fetched on first run), tokenizer, calibration sets, windows, prompts."""
    from transformers import AutoTokenizer

    from . import data as D

    ensure_corpora(data_dir, default=cfg.data_dir is None, log=log)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    calib = {lang: D.load_split(data_dir, lang, "calib") for lang in LANGS}
    evals = {lang: D.load_split(data_dir, lang, "eval") for lang in LANGS}
    sets = calibration_sets(calib, tokenizer, cfg)
    windows = {
        lang: D.eval_windows(
            evals[lang],
            tokenizer,
            cfg.eval_windows,
            seq_len=cfg.eval_seq_len,
            seed=cfg.eval_seed,
        )
        for lang in LANGS
    }
    prompts = {
        lang: pick_prompts(
            evals[lang], tokenizer, cfg.prompts_per_lang, cfg.prompt_tokens, cfg.seed + 7
        )
        for lang in LANGS
    }
    return Inputs(tokenizer, evals, sets, windows, prompts)


def calibrate_parts(
    cfg: DemoConfig, model_dir: Path, inputs: Inputs, scores_dir: Path, log
) -> Calibration:
    """Stage 1: REAP through ``oneshot`` once per part, on the packed experts; part 1 again on the
    decompressed model as a check; the rankings' scores merged from the parts."""
    from tqdm.auto import tqdm

    from ..scores import ExpertScores

    def arguments(part: str, lang: str) -> tuple:
        scores_path = scores_dir / f"{part}.safetensors"
        return str(model_dir), part, lang, inputs.sets[part], inputs.tokenizer, scores_path, cfg

    runs = [
        calibrate(*arguments(part, lang))
        for part, lang in tqdm(
            PARTS, desc="calibrate (oneshot per corpus)", unit="run", dynamic_ncols=True
        )
    ]
    part, lang = PARTS[0]  # the packed experts gave the dense path's scores (1e-6, every statistic)
    packed_check = check_packed_scores(*arguments(part, lang))
    log(
        f"   packed vs dense calibration of {part}: every statistic within "
        f"{packed_check['max_rel']:.1e} relative ({packed_check['statistics']:,} values)"
    )
    parts = {p: ExpertScores.load(scores_dir / f"{p}.safetensors") for p, _ in PARTS}
    merged: dict[str, ExpertScores] = {}
    for label, names in RANKINGS.items():
        s = parts[names[0]]
        for n in names[1:]:
            s = s.merge(parts[n])
        merged[label] = s
        s.save(scores_dir / f"{label}.safetensors")
    return Calibration(runs, packed_check, parts, merged)


def prune_and_verify(
    cfg: DemoConfig, src_dir: Path, left_out, out: Path, calib: Calibration, inputs: Inputs
) -> Pruning:
    """Stage 2: per method, a plan, the bit-exact rewrite and ``verify --source``; then each
    plan's overlap with REAP(en+zh+code) at the same sparsity."""
    from tqdm.auto import tqdm

    from ..scores.plan import retained_mass

    yard = calib.merged[YARDSTICK].saliency("reap")
    plans, records = {}, {}
    for m in tqdm(
        job_methods(cfg),
        desc="prune (checkpoint rewrite) + verify",
        unit="ckpt",
        dynamic_ncols=True,
    ):
        plans[m.name], records[m.name] = prune_one(
            cfg, m, src_dir, out, calib, yard, retained_mass, inputs
        )
    for name, plan in plans.items():  # overlap with REAP(en+zh+code) at the same sparsity
        ref = next(
            plans[n]
            for n, r in records.items()
            if r["sparsity"] == records[name]["sparsity"]
            and r["saliency"] == "reap"
            and r["calibration"] == "en+zh+code"
            and not r.get("router_fit")
        )
        shared = [len(set(plan.kept[l]) & set(ref.kept[l])) for l in plan.kept]
        records[name]["overlap_with_reap_en_zh_code"] = sum(shared) / (len(shared) * plan.num_kept)
    return Pruning(src_dir, left_out, plans, records)


def prune_one(
    cfg: DemoConfig,
    m,
    src_dir: Path,
    out: Path,
    calib: Calibration,
    yard,
    retained_mass,
    inputs: Inputs | None = None,
):
    """One method: its scores (calibrated, or from the router weights), plan, checkpoint and
    verification; returns ``(plan, record)``. A router-fit method cuts the same plan and saves
    through ``oneshot`` + ``calibrate_router`` (:func:`fit_router_checkpoint`)."""
    import numpy as np

    from ..checkpoint import prepare_rewrite
    from ..checkpoint.verify import verify_checkpoint
    from ..scores import ExpertScores
    from ..scores.baselines import scores_from_weights
    from ..scores.plan import plan_from_scores

    scores_dir, plans_dir, pruned_dir = out / "scores", out / "plans", out / "pruned"
    t = time.time()
    if m.kind == "calibrated":
        spath = scores_dir / f"{m.ranking}.safetensors"
        scores = calib.merged[m.ranking]
    else:
        spath = scores_dir / f"{m.saliency}.safetensors"
        if not spath.is_file():
            scores_from_weights(src_dir, m.saliency, seed=cfg.seed).save(spath)
        scores = ExpertScores.load(spath)
    plan = plan_from_scores(
        scores,
        sparsity=m.sparsity,
        saliency=m.saliency,
        params={"demo_method": m.name, "calibration": m.calibration},
    )
    plan.save(plans_dir / f"{m.name}.json")
    dst = pruned_dir / m.name
    fit = None
    if m.router_fit:
        fit = fit_router_checkpoint(cfg, m, src_dir, dst, spath, plan, inputs)
    else:
        prepare_rewrite(
            src_dir,
            plan,
            dst,
            scores_path=spath,
            force=True,
            method=f"{m.label} via reap_modifier.demo (checkpoint rewrite)",
            progress=False,
            hash_cache=False,
        ).run()
    rewrite_s = time.time() - t
    rep = verify_checkpoint(dst, source=src_dir)
    if not rep.ok:
        raise RuntimeError(f"verification of {dst} failed:\n{rep.summary()}")
    record = {
        "label": m.label,
        "kind": m.kind,
        "saliency": m.saliency,
        "calibration": m.calibration,
        "sparsity": m.sparsity,
        "router_fit": fit,
        "scores": relative_to(spath, out),
        "plan": relative_to(plans_dir / f"{m.name}.json", out),
        "checkpoint": relative_to(dst, out),
        "num_experts_before": plan.num_experts,
        "num_experts_after": plan.num_kept,
        "retained_own_mass": float(np.mean(list(plan.retained.values()))),
        "retained_reap_mass_D": float(
            np.mean([retained_mass(yard[l], ids) for l, ids in plan.kept.items()])
        ),
        "kept": plan.kept,
        "verify": {
            "ok": rep.ok,
            "warnings": rep.warnings,
            **{
                k: rep.info.get(k)
                for k in (
                    "moe_layers",
                    "num_experts",
                    "tensors",
                    "tensors_matching_source",
                    "checked_against_source",
                    "quantization_format",
                    "differs_from_source",
                )
            },
        },
        "bytes": sum(f.stat().st_size for f in dst.rglob("*") if f.is_file()),
        "seconds": round(rewrite_s, 2),
    }
    return plan, record


def fit_sets(cfg: DemoConfig, inputs: Inputs) -> dict[str, Any]:
    """Per calibration mix of :data:`FIT_PARTS`: the router fit's dataset, ``router_fit_tokens``
    tokens drawn evenly from the mix's calibration parts (whole windows from the start of each)."""
    from datasets import concatenate_datasets

    out = {}
    for mix, parts in FIT_PARTS.items():
        share = cfg.router_fit_tokens // len(parts)
        pieces = []
        for part in parts:
            ds, n, rows = inputs.sets[part], 0, 0
            for ids in ds["input_ids"]:
                if n >= share:
                    break
                n, rows = n + len(ids), rows + 1
            pieces.append(ds.select(range(rows)))
        out[mix] = concatenate_datasets(pieces)
    return out


def fit_router_checkpoint(
    cfg: DemoConfig, m, src_dir: Path, dst: Path, scores_path: Path, plan, inputs: Inputs
) -> dict:
    """REAP's cut from ``scores_path`` (the plan the job cut, checked equal), then every kept
    router fitted on the mix's calibration tokens (``calibrate_router``), saved by ``oneshot``:
    expert bytes copied from the source, fitted router rows written from memory."""
    from llmcompressor import oneshot

    from ..modifier import REAPPruningModifier

    dataset = fit_sets(cfg, inputs)[m.calibration]
    tokens = int(sum(len(r) for r in dataset["input_ids"]))
    model = load_model(src_dir, packed=True, dtype=cfg.dtype)
    modifier = REAPPruningModifier(
        sparsity=m.sparsity,
        scores_in=str(scores_path),
        seed=cfg.seed,
        calibrate_router=True,
        router_fit_tokens=tokens,
        router_fit_steps=cfg.router_fit_steps,
        router_fit_lr=cfg.router_fit_lr,
    )
    if dst.exists():
        import shutil

        shutil.rmtree(dst)
    oneshot(
        model=model,
        recipe=[modifier],
        processor=inputs.tokenizer,
        dataset=dataset,
        num_calibration_samples=len(dataset),
        output_dir=str(dst),
        moe_calibrate_all_experts=False,
    )
    del model
    if modifier.plan.kept != plan.kept:
        raise RuntimeError(f"{m.name}: the router-fit run cut a different plan than {m.ranking}'s")
    fit = modifier.router_fit
    return {
        "tokens": tokens,
        "parts": list(FIT_PARTS[m.calibration]),
        "method": fit.get("method"),
        "steps": cfg.router_fit_steps,
        "lr": cfg.router_fit_lr,
        "layers": {
            layer: {k: v for k, v in rec.items() if isinstance(v, int | float)}
            for layer, rec in fit.get("layers", {}).items()
        },
    }


def load_models(cfg: DemoConfig, model_dir: Path, pruned_dir: Path, pruning: Pruning) -> dict:
    """The unpruned model, every pruned checkpoint, and the no-routed-experts ablation."""
    from ..evaluation import zero_routed_experts

    models = {REFERENCE: load_model(model_dir, dtype=cfg.dtype)}
    for name in pruning.records:
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


def compare_and_tiers(cfg: DemoConfig, out: Path, calib: Calibration) -> Comparison:
    """Stage 4: the flip table (rankings compared at each sparsity) and the tiers report."""
    from ..analysis.compare import Ranking, compare_rankings
    from ..analysis.reports import write_compare_report, write_tiers_report
    from ..analysis.tiers import tiers_report

    merged, parts, scores_dir = calib.merged, calib.parts, out / "scores"
    rankings = [
        Ranking(label, merged[label], path=relative_to(scores_dir / f"{label}.safetensors", out))
        for label in RANKINGS
    ]
    per_source = {"en": merged["B"], "zh": parts["zh"], "code": parts["code"]}
    cmp = compare_rankings(rankings, sparsity=cfg.sparsity, per_source=per_source)
    write_compare_report(cmp, out / "compare", rankings=rankings, per_source=per_source)
    flips_by_sparsity = {}
    for sp in sorted(set(FLIP_SPARSITIES) | {cfg.sparsity}):
        c = (
            cmp
            if sp == cfg.sparsity
            else compare_rankings(rankings, sparsity=sp, per_source=per_source)
        )
        flips_by_sparsity[f"{sp:g}"] = _flip_summary(c)
    E = merged["D"].num_experts
    tier_keeps = sorted(
        {max(merged["D"].metadata.get("top_k", 1), round(E * f)) for f in (0.75, 0.5, 0.375, 0.25)},
        reverse=True,
    )
    tiers = tiers_report(merged["D"], tier_keeps)
    write_tiers_report(tiers, out / "tiers")
    return Comparison(cmp, flips_by_sparsity, tier_keeps, tiers)


def _model_card_eval(model_dir: Path, cfg: DemoConfig, data_dir: Path) -> dict | None:
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
        card["windows_per_lang"] == cfg.eval_windows
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
    from ..evaluation import paired_difference
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
            "model_card": _model_card_eval(model_dir, cfg, data_dir),
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
            "windows_per_lang": cfg.eval_windows,
            "seq_len": cfg.eval_seq_len,
            "seed": cfg.eval_seed,
            "tokens_per_lang": {lang: int(inputs.windows[lang][:, 1:].numel()) for lang in LANGS},
            "quality": quality,
        },
        "paired": _paired(quality, paired_difference),
        "generations": {
            "prompts": {
                lang: [{k: p[k] for k in ("source", "ids", "text")} for p in inputs.prompts[lang]]
                for lang in LANGS
            },
            "new_tokens": cfg.gen_tokens,
            "by_model": generations,
            "summary": _gen_summary(generations),
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


def _flip_summary(cmp: dict) -> dict:
    """The flip-table pairs of one comparison: flips, % of kept slots, x the A->B floor, and the
    share of promoted experts routed >= threshold x more by zh / code than en."""
    out = {"keep": cmp["keep"], "kept_slots": cmp["num_layers"] * cmp["keep"], "pairs": {}}
    for p in flip_rows(cmp):
        zh, code = pair_routing(p, "en", "zh"), pair_routing(p, "en", "code")
        out["pairs"][f"{p['earlier']}->{p['later']}"] = {
            "flips": p["flips"],
            "pct_of_kept_slots": p["pct_of_kept_slots"],
            "x_first_pair": p["x_first_pair"],
            "promoted_zh_heavy": zh["promoted_frac_more_by_b"] if zh else None,
            "all_zh_heavy": zh["all_frac_more_by_b"] if zh else None,
            "promoted_code_heavy": code["promoted_frac_more_by_b"] if code else None,
            "all_code_heavy": code["all_frac_more_by_b"] if code else None,
        }
    return out


def _paired(quality: dict, paired_difference) -> list[dict]:
    """Differences that answer the questions, paired per window, at every sparsity the job ran:
    REAP(en+zh+code) against each other method (NLL), and each REAP cut against the same cut with
    its router fitted (NLL and KL to the unpruned model)."""
    others = (
        "reap_en",
        "reap_en_zh",
        "frequency",
        "router_l1",
        "router_signed_sum",
        "random",
    )
    suffixes = [""] + sorted(
        {"_" + n.rsplit("_", 1)[1] for n in quality if n.rsplit("_", 1)[-1].isdigit()}
    )
    pairs = [("reap_en", "reap_en_zh", ("nll",)), ("reap_en_zh", "reap_en_zh_code", ("nll",))]
    out = []
    for sfx in suffixes:
        rows = [(f"{o}{sfx}", f"reap_en_zh_code{sfx}", ("nll",)) for o in others]
        rows += [
            (f"{r}{sfx}", f"{r}_fit{sfx}", ("nll", "kl")) for r in ("reap_en", "reap_en_zh_code")
        ]
        rows = [(f"{a}{sfx}", f"{b}{sfx}", m) for a, b, m in pairs] + rows
        for a, b, metrics in rows:
            if a not in quality or b not in quality or (a, b) in {(r["a"], r["b"]) for r in out}:
                continue
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


def _gen_summary(generations: dict) -> dict:
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
