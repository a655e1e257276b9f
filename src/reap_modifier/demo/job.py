"""The main job (issue 5): does the calibration corpus change what REAP prunes, and what does that
do to quality -- measured end to end on the bundled MXFP4 Kimi-K3-architecture model.

    python -m reap_modifier.demo [--model PATH] [--out out/demo] [--quick]

1. **Calibrate** REAP with ``oneshot`` + :class:`~reap_modifier.modifier.REAPPruningModifier`,
   once per corpus (English part 1, English part 2, Chinese, code; every run reloads the model from
   its directory and keeps only the scores file), then merge the files: ``A`` = en1, ``B`` = en1+en2
   (REAP(en)), ``C`` = B+zh, ``D`` = C+code (REAP(en+zh+code)).
2. **Prune** to 50% with REAP(en), REAP(en+zh), REAP(en+zh+code), frequency (from D), router_l1,
   router_signed_sum and random -- and REAP(en), REAP(en+zh+code), random also to 75% (where the
   seed's build collapsed in Chinese): each plan by :func:`~reap_modifier.plan.plan_from_scores`,
   each checkpoint by :func:`~reap_modifier.checkpoint.rewrite_checkpoint` (kept MXFP4 bytes copied
   verbatim) and checked by :func:`~reap_modifier.verify.verify_checkpoint` against the source.
3. **Evaluate** the unpruned model, every pruned checkpoint and (for scale) the unpruned model with
   every routed expert's output zeroed on held-out English / Chinese / code windows
   (:mod:`reap_modifier.evaluate`): NLL / perplexity, top-1 agreement and KL to the unpruned model,
   longest repeat run in greedy generations.
4. **Flip table** of rankings A, B, C, D at 50% (and 25% / 75%)
   (:func:`~reap_modifier.compare.compare_rankings`).
5. **Write** ``report.md`` (rendered from ``results.json`` only), ``results.json``, PNG plots, the
   score files, plans and pruned checkpoints (with manifests) under ``--out``.

``--quick`` shrinks every size (for the smoke test); the numbers it gives mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO / "models" / "tiny-k3-bilingual"
DEFAULT_OUT = Path("out") / "demo"

#: calibration runs: (part name, language / calibration_source label)
PARTS: tuple[tuple[str, str], ...] = (("en1", "en"), ("en2", "en"), ("zh", "zh"), ("code", "code"))
#: rankings of the flip table: label -> parts merged
RANKINGS: dict[str, tuple[str, ...]] = {
    "A": ("en1",),
    "B": ("en1", "en2"),
    "C": ("en1", "en2", "zh"),
    "D": ("en1", "en2", "zh", "code"),
}
LANGS: tuple[str, ...] = ("en", "zh", "code")
REFERENCE = "unpruned"


@dataclass(frozen=True)
class Method:
    name: str  # directory / key
    label: str  # table label
    kind: str  # "calibrated" or "weights"
    saliency: str
    ranking: str | None = None  # calibrated: which merged scores file (A..D)
    calibration: str = "none"
    sparsity: float | None = None  # None: the job's sparsity (50%)


METHODS: tuple[Method, ...] = (
    Method("reap_en", "REAP(en)", "calibrated", "reap", "B", "en"),
    Method("reap_en_zh", "REAP(en+zh)", "calibrated", "reap", "C", "en+zh"),
    Method("reap_en_zh_code", "REAP(en+zh+code)", "calibrated", "reap", "D", "en+zh+code"),
    Method("frequency", "frequency", "calibrated", "frequency", "D", "en+zh+code"),
    Method("router_l1", "router_l1", "weights", "router_l1"),
    Method("router_signed_sum", "router_signed_sum", "weights", "router_signed_sum"),
    Method("random", "random", "weights", "random"),
)
#: also pruned at the extra (harsher) sparsity: the calibration-language question where the seed's
#: 75% build collapsed in Chinese, against random at the same sparsity
EXTRA_METHODS: tuple[str, ...] = ("reap_en", "reap_en_zh_code", "random")
YARDSTICK = "D"  # retained REAP mass of every plan is measured in this ranking's saliency
ABLATION = "no_routed"  # evaluation-only reference: every routed expert outputs zero
#: sparsities of the flip table (the seed: "the same pattern holds at 25% and 75% pruning")
FLIP_SPARSITIES = (0.25, 0.5, 0.75)


@dataclass
class DemoConfig:
    model: str = str(DEFAULT_MODEL)
    out: str = str(DEFAULT_OUT)
    data_dir: str | None = None  # None: the repository's data/ (built if missing)
    sparsity: float = 0.5
    extra_sparsity: float | None = 0.75  # EXTRA_METHODS again at this sparsity (None: skip)
    tokens_per_part: int = 32768  # calibration tokens of each part (en1, en2, zh, code)
    calib_seq_len: int = 256
    eval_windows: int = 64  # per language
    eval_seq_len: int = 256
    eval_seed: int = 1234  # = the model card's window seed
    eval_chunk: int = 8
    prompts_per_lang: int = 8
    prompt_tokens: int = 16
    gen_tokens: int = 48
    seed: int = 0
    threads: int = 1
    quick: bool = False


QUICK = dict(tokens_per_part=512, calib_seq_len=64, eval_windows=2, eval_seq_len=32, eval_chunk=2,
             prompts_per_lang=2, prompt_tokens=6, gen_tokens=6)


def job_methods(cfg: "DemoConfig") -> list[Method]:
    """METHODS at the job's sparsity, then EXTRA_METHODS at ``extra_sparsity`` (named
    ``<name>_<percent>``, e.g. ``reap_en_75``)."""
    out = [Method(**{**asdict(m), "sparsity": cfg.sparsity}) for m in METHODS]
    if cfg.extra_sparsity is not None and cfg.extra_sparsity != cfg.sparsity:
        pct = round(100 * cfg.extra_sparsity)
        for m in METHODS:
            if m.name in EXTRA_METHODS:
                out.append(Method(**{**asdict(m), "name": f"{m.name}_{pct}", "label": f"{m.label} {pct}%",
                                     "sparsity": cfg.extra_sparsity}))
    return out


# ----------------------------------------------------------------------------- helpers


class _Clock:
    def __init__(self) -> None:
        self.t0 = time.time()
        self.stages: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str, log: Callable[[str], None]):
        log(f"== {name}")
        t = time.time()
        yield
        self.stages[name] = round(time.time() - t, 2)
        log(f"   {name}: {self.stages[name]:.1f} s")

    def total(self) -> float:
        return round(time.time() - self.t0, 2)


def _log(msg: str) -> None:
    print(msg, flush=True)


_QUIET = False


def _quiet_libraries() -> None:
    """Keep the console to our progress bars, oneshot's and stage lines (warnings still show;
    model loading runs with stderr muted)."""
    global _QUIET
    _QUIET = True
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except Exception:  # pragma: no cover
        pass
    try:
        import llmcompressor  # noqa: F401  (configures its loguru handler on import: replace it)
        from loguru import logger

        logger.remove()
        logger.add(sys.stderr, level="WARNING", filter=lambda r: "No accelerator" not in r["message"]
                   and "limited support for models already quantized" not in r["message"])
    except Exception:  # pragma: no cover
        pass
    import warnings

    warnings.filterwarnings("ignore", message=".*TypedStorage.*")
    warnings.filterwarnings("ignore", category=FutureWarning)


def _versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("reap-modifier", "torch", "transformers", "llmcompressor", "compressed-tensors"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def _register_kimi() -> None:
    from . import compat

    compat.register_kimi_auto_classes()


def load_model(path: str | os.PathLike):
    """A checkpoint from its directory with transformers, bf16, eval mode. compressed-tensors
    checkpoints (MXFP4 experts) are decompressed on load (``run_compressed=False``): the weights
    are the exact MXFP4 values in bf16, the forward is the same as the compressed module's, and
    llm-compressor's calibration pipeline can hook the plain Linear experts."""
    import torch
    from transformers import AutoModelForCausalLM

    _register_kimi()
    kwargs: dict[str, Any] = {"dtype": torch.bfloat16}
    cfg = json.loads((Path(path) / "config.json").read_text())
    if (cfg.get("quantization_config") or {}).get("quant_method") == "compressed-tensors":
        from transformers.utils.quantization_config import CompressedTensorsConfig

        kwargs["quantization_config"] = CompressedTensorsConfig(run_compressed=False)
    if _QUIET:  # transformers' and compressed-tensors' per-load progress bars
        import contextlib
        import io

        with contextlib.redirect_stderr(io.StringIO()):
            return AutoModelForCausalLM.from_pretrained(str(path), **kwargs).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), **kwargs).eval()


def _rel(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path)


def ensure_corpora(data_dir: Path, default: bool, log: Callable[[str], None] = _log) -> None:
    from .data import corpora_available

    if corpora_available(data_dir):
        return
    if not default:
        raise SystemExit(f"corpora not found in {data_dir} (data/<lang>/<split>.jsonl); build them with "
                         f"`python scripts/build_corpora.py --data-dir {data_dir}`")
    script = REPO / "scripts" / "build_corpora.py"
    log(f"corpora not found in {data_dir}: building them with {script.relative_to(REPO)} (a few minutes)")
    subprocess.run([sys.executable, str(script), "--data-dir", str(data_dir)], check=True)
    if not corpora_available(data_dir):
        raise SystemExit(f"{script} ran but {data_dir} is still incomplete")


def checkpoint_source(model_dir: Path, out: Path, log: Callable[[str], None] = _log) -> tuple[Path, list[str]]:
    """The directory the checkpoint rewriter reads. Normally ``model_dir`` itself. The rewriter
    refuses a directory holding safetensors files that are not weight shards (e.g. an evaluation
    slice saved next to a single ``model.safetensors``); then the job reads the checkpoint through
    ``out/source``: copies of every file of ``model_dir`` except those extra safetensors files
    (same bytes, so hashes and the bit-exact checks are unaffected; copies, not symlinks, because
    the rewriter resolves shard paths). Returns the directory and the files left out."""
    from .checkpoint import CheckpointError, inspect_checkpoint

    try:
        layout = inspect_checkpoint(model_dir)
        extra = list(layout.unindexed_files)
    except CheckpointError:
        index = model_dir / "model.safetensors.index.json"
        if index.is_file() or not (model_dir / "model.safetensors").is_file():
            raise
        extra = sorted(p.relative_to(model_dir).as_posix() for p in model_dir.rglob("*.safetensors")
                       if p.name != "model.safetensors" or p.parent != model_dir)
    if not extra:
        return model_dir, []
    view = out / "source"
    view.mkdir(parents=True)
    for f in sorted(model_dir.iterdir()):
        if f.relative_to(model_dir).as_posix() in extra or (f.is_dir() and any(
                e.startswith(f.name + "/") for e in extra)):
            continue
        if f.is_dir():
            shutil.copytree(f, view / f.name)
        else:
            shutil.copy2(f, view / f.name)
    log(f"   {model_dir} also holds {', '.join(extra)} (not weight shards; the checkpoint rewriter refuses"
        f" those): reading the checkpoint through {view} (a copy of every other file)")
    return view, extra


OUT_MARKER = ".reap-demo"
OUT_ENTRIES = ("source", "scores", "plans", "pruned", "compare", "tiers", "report.md", "results.json", "quality.png",
               "nll_per_language.png")


def prepare_out_dir(out: Path) -> None:
    """Create ``out`` or clear the previous demo run in it. A non-empty folder that holds no earlier
    run (no ``.reap-demo`` marker) is refused, so ``--out`` can never delete unrelated files."""
    if out.exists() and any(out.iterdir()) and not (out / OUT_MARKER).is_file():
        raise SystemExit(f"refusing to write into {out}: it is not empty and holds no earlier demo run "
                         f"(no {OUT_MARKER} marker); choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    for name in OUT_ENTRIES:
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    (out / OUT_MARKER).write_text("written by python -m reap_modifier.demo; the folder is replaced on rerun\n")


# ----------------------------------------------------------------------------- 1. calibration


def calibration_sets(records: dict[str, list], tokenizer, cfg: DemoConfig) -> dict[str, Any]:
    """One ``datasets.Dataset`` per part. English calibration paragraphs are shuffled with the seed
    and dealt alternately into two disjoint halves (parts en1 / en2), each sampled across sources."""
    from .data import calibration_dataset, shuffled

    en = shuffled(records["en"], cfg.seed + 11)
    pools = {"en1": en[0::2], "en2": en[1::2], "zh": records["zh"], "code": records["code"]}
    out = {}
    for k, (part, lang) in enumerate(PARTS):
        out[part] = calibration_dataset({lang: pools[part]}, tokenizer, cfg.tokens_per_part,
                                        seq_len=cfg.calib_seq_len, seed=cfg.seed + 101 * k)
    return out


def calibrate(model_dir: str, part: str, lang: str, dataset, tokenizer, scores_path: Path, cfg: DemoConfig) -> dict:
    """REAP calibration of one part through ``oneshot``; only the scores file is kept."""
    from llmcompressor import oneshot

    from .modifier import REAPPruningModifier

    model = load_model(model_dir)
    modifier = REAPPruningModifier(sparsity=cfg.sparsity, saliency="reap", scores_path=str(scores_path),
                                   calibration_source=lang, seed=cfg.seed)
    t = time.time()
    oneshot(model=model, recipe=[modifier], processor=tokenizer, dataset=dataset,
            num_calibration_samples=len(dataset), moe_calibrate_all_experts=False)
    seconds = time.time() - t
    del model
    meta = json.loads(dataset.info.description or "{}")
    return {"part": part, "source": lang, "rows": len(dataset),
            "tokens": int(sum(len(r) for r in dataset["input_ids"])),
            "source_tokens": meta.get("source_tokens", {}).get(lang, {}),
            "scores": str(scores_path), "seconds": round(seconds, 2)}


# ----------------------------------------------------------------------------- 3. prompts


def pick_prompts(records: list, tokenizer, n: int, prompt_tokens: int, seed: int) -> list[dict]:
    """``n`` prompts (the first ``prompt_tokens`` tokens of held-out paragraphs), sources taken in
    turn (seeded)."""
    from .data import encode, shuffled

    out = []
    for r in shuffled(records, seed, mix="balanced"):
        ids = encode(tokenizer, r["text"])
        if len(ids) >= prompt_tokens + 4:
            out.append({"source": r["source"], "ids": ids[:prompt_tokens],
                        "text": tokenizer.decode(ids[:prompt_tokens])})
            if len(out) == n:
                return out
    raise ValueError(f"fewer than {n} held-out paragraphs hold {prompt_tokens + 4} tokens")


# ----------------------------------------------------------------------------- the job


def run(cfg: DemoConfig, log: Callable[[str], None] = _log, command: str | None = None) -> dict:
    """Run the whole job; returns the results dict (also written to ``out/results.json``).
    ``command`` is recorded as the command line that produced the report."""
    clock = _Clock()
    import numpy as np
    import torch
    from tqdm.auto import tqdm

    from . import data as D
    from .baselines import scores_from_weights
    from .checkpoint import rewrite_checkpoint
    from .compare import Ranking, compare_rankings, write_compare_report
    from .evaluate import (
        evaluate_models,
        greedy_generate,
        paired_difference,
        repetition_stats,
        zero_routed_experts,
    )
    from .plan import plan_from_scores, retained_mass
    from .scores import ExpertScores
    from .tiers import jsonable, tiers_report, write_tiers_report
    from .verify import verify_checkpoint

    if cfg.quick:
        cfg = DemoConfig(**{**asdict(cfg), **QUICK})
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    model_dir = Path(cfg.model)
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"model not found: {model_dir} has no config.json (pass --model PATH)")
    out = Path(cfg.out)
    prepare_out_dir(out)
    data_dir = Path(cfg.data_dir) if cfg.data_dir else D.default_data_dir()

    from transformers import AutoTokenizer

    with clock.stage("corpora", log):
        ensure_corpora(data_dir, default=cfg.data_dir is None, log=log)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        calib = {lang: D.load_split(data_dir, lang, "calib") for lang in LANGS}
        evals = {lang: D.load_split(data_dir, lang, "eval") for lang in LANGS}
        sets = calibration_sets(calib, tokenizer, cfg)
        windows = {lang: D.eval_windows(evals[lang], tokenizer, cfg.eval_windows, seq_len=cfg.eval_seq_len,
                                        seed=cfg.eval_seed) for lang in LANGS}
        prompts = {lang: pick_prompts(evals[lang], tokenizer, cfg.prompts_per_lang, cfg.prompt_tokens,
                                      cfg.seed + 7) for lang in LANGS}

    # -- 1. calibration ------------------------------------------------------------------------
    scores_dir = out / "scores"
    calib_runs = []
    with clock.stage("calibrate", log):
        for part, lang in tqdm(PARTS, desc="calibrate (oneshot per corpus)", unit="run", dynamic_ncols=True):
            calib_runs.append(calibrate(str(model_dir), part, lang, sets[part], tokenizer,
                                        scores_dir / f"{part}.safetensors", cfg))
        parts = {p: ExpertScores.load(scores_dir / f"{p}.safetensors") for p, _ in PARTS}
        merged: dict[str, ExpertScores] = {}
        for label, names in RANKINGS.items():
            s = parts[names[0]]
            for n in names[1:]:
                s = s.merge(parts[n])
            merged[label] = s
            s.save(scores_dir / f"{label}.safetensors")

    # -- 2. plans, checkpoints, verification ---------------------------------------------------
    pruned_dir, plans_dir = out / "pruned", out / "plans"
    src_dir, left_out = checkpoint_source(model_dir, out, log)
    yard = merged[YARDSTICK].saliency("reap")
    plans, pruning = {}, {}
    pruned_dir.mkdir(parents=True, exist_ok=True)
    with clock.stage("prune + verify", log):
        for m in tqdm(job_methods(cfg), desc="prune (checkpoint rewrite) + verify", unit="ckpt",
                      dynamic_ncols=True):
            t = time.time()
            if m.kind == "calibrated":
                spath = scores_dir / f"{m.ranking}.safetensors"
                scores = merged[m.ranking]
            else:
                spath = scores_dir / f"{m.saliency}.safetensors"
                if not spath.is_file():
                    scores_from_weights(src_dir, m.saliency, seed=cfg.seed).save(spath)
                scores = ExpertScores.load(spath)
            plan = plan_from_scores(scores, sparsity=m.sparsity, saliency=m.saliency,
                                    params={"demo_method": m.name, "calibration": m.calibration})
            plan.save(plans_dir / f"{m.name}.json")
            plans[m.name] = plan
            dst = pruned_dir / m.name
            rewrite_checkpoint(src_dir, plan, dst, scores_path=spath, force=True,
                               method=f"{m.label} via reap_modifier.demo (checkpoint rewrite)",
                               progress=False, hash_cache=False)
            rewrite_s = time.time() - t
            rep = verify_checkpoint(dst, source=src_dir)
            if not rep.ok:
                raise RuntimeError(f"verification of {dst} failed:\n{rep.summary()}")
            pruning[m.name] = {
                "label": m.label,
                "kind": m.kind,
                "saliency": m.saliency,
                "calibration": m.calibration,
                "sparsity": m.sparsity,
                "scores": _rel(spath, out),
                "plan": _rel(plans_dir / f"{m.name}.json", out),
                "checkpoint": _rel(dst, out),
                "num_experts_before": plan.num_experts,
                "num_experts_after": plan.num_kept,
                "retained_own_mass": float(np.mean(list(plan.retained.values()))),
                "retained_reap_mass_D": float(np.mean([retained_mass(yard[l], ids) for l, ids in plan.kept.items()])),
                "kept": plan.kept,
                "verify": {"ok": rep.ok, "warnings": rep.warnings, **{k: rep.info.get(k) for k in (
                    "moe_layers", "num_experts", "tensors", "tensors_matching_source", "checked_against_source",
                    "quantization_format")}},
                "bytes": sum(f.stat().st_size for f in dst.rglob("*") if f.is_file()),
                "seconds": round(rewrite_s, 2),
            }
        for name, plan in plans.items():  # overlap with REAP(en+zh+code) at the same sparsity
            ref = next(plans[n] for n, r in pruning.items() if r["sparsity"] == pruning[name]["sparsity"]
                       and r["saliency"] == "reap" and r["calibration"] == "en+zh+code")
            shared = [len(set(plan.kept[l]) & set(ref.kept[l])) for l in plan.kept]
            pruning[name]["overlap_with_reap_en_zh_code"] = sum(shared) / (len(shared) * plan.num_kept)

    # -- 3. evaluation ---------------------------------------------------------------------------
    quality: dict[str, dict[str, dict]] = {}
    generations: dict[str, list[dict]] = {}
    with clock.stage("evaluate", log):
        models = {REFERENCE: load_model(model_dir)}
        for name in pruning:
            models[name] = load_model(pruned_dir / name)
        models[ABLATION] = load_model(model_dir)
        zero_routed_experts(models[ABLATION])
        total = sum(int(w.shape[0]) for w in windows.values()) * len(models)
        with tqdm(total=total, desc="evaluate (windows x models)", unit="win", dynamic_ncols=True) as bar:
            for lang in LANGS:
                res = evaluate_models(models, windows[lang], REFERENCE, chunk=cfg.eval_chunk, progress=bar.update)
                for name, r in res.items():
                    quality.setdefault(name, {})[lang] = r
    with clock.stage("generate", log):
        batch = torch.tensor([p["ids"] for lang in LANGS for p in prompts[lang]], dtype=torch.long)
        where = [(lang, i) for lang in LANGS for i in range(len(prompts[lang]))]
        with tqdm(total=len(models) * cfg.gen_tokens, desc="greedy generations", unit="tok",
                  dynamic_ncols=True) as bar:
            for name, model in models.items():
                gen = greedy_generate(model, batch, cfg.gen_tokens, progress=bar.update)
                rows = []
                for (lang, i), ids in zip(where, gen.tolist()):
                    text = tokenizer.decode(ids)
                    rows.append({"lang": lang, "prompt": i, "ids": ids, "text": text, **repetition_stats(ids, text)})
                generations[name] = rows
        del models

    # -- 4. flip table ---------------------------------------------------------------------------
    with clock.stage("compare + tiers", log):
        rankings = [Ranking(label, merged[label], path=_rel(scores_dir / f"{label}.safetensors", out))
                    for label in RANKINGS]
        per_source = {"en": merged["B"], "zh": parts["zh"], "code": parts["code"]}
        cmp = compare_rankings(rankings, sparsity=cfg.sparsity, per_source=per_source)
        write_compare_report(cmp, out / "compare", rankings=rankings, per_source=per_source)
        flips_by_sparsity = {}
        for sp in sorted(set(FLIP_SPARSITIES) | {cfg.sparsity}):
            c = cmp if sp == cfg.sparsity else compare_rankings(rankings, sparsity=sp, per_source=per_source)
            flips_by_sparsity[f"{sp:g}"] = _flip_summary(c)
        E = merged["D"].num_experts
        tier_keeps = sorted({max(merged["D"].metadata.get("top_k", 1), round(E * f)) for f in (0.75, 0.5, 0.375, 0.25)},
                            reverse=True)
        tiers = tiers_report(merged["D"], tier_keeps)
        write_tiers_report(tiers, out / "tiers")

    # -- 5. results + report -----------------------------------------------------------------------
    card = None
    card_path = model_dir / "model_card.json"
    if card_path.is_file():
        c = json.loads(card_path.read_text())
        ev = c.get("eval", {})
        card = {"loss": ev.get("loss"), "windows_per_lang": ev.get("windows_per_lang"),
                "seq_len": ev.get("seq_len"), "window_seed": ev.get("window_seed")}
        card["same_windows"] = (card["windows_per_lang"] == cfg.eval_windows and card["seq_len"] == cfg.eval_seq_len
                                and card["window_seed"] == cfg.eval_seed)
    eval_paragraphs = {lang: D.source_counts(evals[lang]) for lang in LANGS}
    results = {
        "format": "reap-demo-results",
        "version": 1,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "config": asdict(cfg),
        "model": {"path": str(model_dir), "model_card": card,
                  "checkpoint_source": _rel(src_dir, out) if src_dir != model_dir else str(model_dir),
                  "left_out_of_checkpoint_source": left_out,
                  "num_experts": merged["D"].num_experts, "top_k": merged["D"].metadata.get("top_k"),
                  "moe_layers": merged["D"].layer_names, "model_class": merged["D"].metadata.get("model_class")},
        "data": {"dir": str(data_dir), "eval_paragraphs_per_source": eval_paragraphs},
        "calibration": {"runs": calib_runs,
                        "rankings": {label: {"parts": list(names), "tokens": merged[label].source_tokens(),
                                             "scores": _rel(scores_dir / f"{label}.safetensors", out)}
                                     for label, names in RANKINGS.items()}},
        "pruning": pruning,
        "eval": {"windows_per_lang": cfg.eval_windows, "seq_len": cfg.eval_seq_len, "seed": cfg.eval_seed,
                 "tokens_per_lang": {lang: int(windows[lang][:, 1:].numel()) for lang in LANGS},
                 "quality": quality},
        "paired": _paired(quality, paired_difference),
        "generations": {"prompts": {lang: [{k: p[k] for k in ("source", "ids", "text")} for p in prompts[lang]]
                                    for lang in LANGS},
                        "new_tokens": cfg.gen_tokens, "by_model": generations,
                        "summary": _gen_summary(generations)},
        "compare": jsonable(cmp),
        "flips_by_sparsity": jsonable(flips_by_sparsity),
        "tiers": {"keeps": tier_keeps, "rows": jsonable(tiers["tiers"]), "answer": tiers.get("answer")},
        "timing": {**clock.stages, "total": clock.total()},
        "versions": _versions(),
    }
    results["timing"]["total"] = clock.total()
    results = jsonable(results)
    _plots(results, out)
    (out / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    (out / "report.md").write_text(render_report(results))
    log(f"wrote {out / 'report.md'} and {out / 'results.json'} ({results['timing']['total']:.0f} s)")
    return results


def _flip_summary(cmp: dict) -> dict:
    """The flip-table pairs of one comparison: flips, % of kept slots, x the A->B floor, and the
    share of promoted experts routed >= threshold x more by zh / code than en."""
    out = {"keep": cmp["keep"], "kept_slots": cmp["num_layers"] * cmp["keep"], "pairs": {}}
    for p in _flip_rows(cmp):
        zh, code = _routing(p, "en", "zh"), _routing(p, "en", "code")
        out["pairs"][f"{p['earlier']}->{p['later']}"] = {
            "flips": p["flips"], "pct_of_kept_slots": p["pct_of_kept_slots"], "x_first_pair": p["x_first_pair"],
            "promoted_zh_heavy": zh["promoted_frac_more_by_b"] if zh else None,
            "all_zh_heavy": zh["all_frac_more_by_b"] if zh else None,
            "promoted_code_heavy": code["promoted_frac_more_by_b"] if code else None,
            "all_code_heavy": code["all_frac_more_by_b"] if code else None,
        }
    return out


def _paired(quality: dict, paired_difference) -> list[dict]:
    """NLL differences that answer the questions, paired per window."""
    pairs = [("reap_en", "reap_en_zh_code"), ("reap_en", "reap_en_zh"), ("reap_en_zh", "reap_en_zh_code"),
             ("frequency", "reap_en_zh_code"), ("router_l1", "reap_en_zh_code"),
             ("router_signed_sum", "reap_en_zh_code"), ("random", "reap_en_zh_code")]
    pct = sorted({n.rsplit("_", 1)[1] for n in quality if n.rsplit("_", 1)[-1].isdigit()})
    for p in pct:
        pairs += [(f"reap_en_{p}", f"reap_en_zh_code_{p}"), (f"random_{p}", f"reap_en_zh_code_{p}")]
    out = []
    for a, b in pairs:
        if a not in quality or b not in quality:
            continue
        row = {"a": a, "b": b}
        for lang in LANGS:
            row[lang] = paired_difference(quality[a][lang]["nll_per_window"], quality[b][lang]["nll_per_window"])
        out.append(row)
    return out


def _gen_summary(generations: dict) -> dict:
    out = {}
    for name, rows in generations.items():
        s = {}
        for lang in LANGS:
            rs = [r for r in rows if r["lang"] == lang]
            s[lang] = {"max_repeat_run_tokens": max((r["repeat_run_tokens"] for r in rs), default=0),
                       "max_repeat_run_chars": max((r["repeat_run_chars"] for r in rs), default=0)}
        for lang in LANGS:
            rs = [r for r in rows if r["lang"] == lang]
            s[lang]["mean_repeat_run_tokens"] = sum(r["repeat_run_tokens"] for r in rs) / max(1, len(rs))
        s["all"] = {k: max(s[lang][k] for lang in LANGS) for k in ("max_repeat_run_tokens", "max_repeat_run_chars")}
        out[name] = s
    return out


# ----------------------------------------------------------------------------- plots


def _model_order(results: dict) -> list[str]:
    return [REFERENCE] + list(results["pruning"]) + [n for n in (ABLATION,) if n in results["eval"]["quality"]]


def _label(results: dict, name: str) -> str:
    if name == REFERENCE:
        return "unpruned"
    if name == ABLATION:
        return "no routed experts (reference)"
    return results["pruning"][name]["label"]


def _plots(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    q = results["eval"]["quality"]
    names = list(results["pruning"])
    x = np.arange(len(LANGS))
    width = 0.8 / max(1, len(names))
    fig, axes = plt.subplots(1, 3, figsize=(15, 5.2))
    panels = [("NLL increase over unpruned (nats)", lambda n, l: q[n][l]["nll"] - q[REFERENCE][l]["nll"]),
              ("KL(unpruned || pruned) (nats / token)", lambda n, l: q[n][l]["kl"]),
              ("top-1 agreement with unpruned", lambda n, l: q[n][l]["top1_agreement"])]
    for ax, (title, fn) in zip(axes, panels):
        for i, n in enumerate(names):
            ax.bar(x + (i - (len(names) - 1) / 2) * width, [fn(n, l) for l in LANGS], width,
                   label=_label(results, n))
        if ABLATION in q:  # the no-routed-experts reference, for scale
            for j, l in enumerate(LANGS):
                ax.hlines(fn(ABLATION, l), j - 0.42, j + 0.42, colors="black", linestyles="dashed", linewidth=1,
                          label=_label(results, ABLATION) if j == 0 else None)
        ax.set_xticks(x, LANGS)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    lo = min(q[n][l]["top1_agreement"] for n in names + [n for n in (ABLATION,) if n in q] for l in LANGS)
    axes[2].set_ylim(max(0.0, lo - 0.05), 1.0)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=8, frameon=False)
    fig.suptitle(f"Expert pruning of {Path(results['model']['path']).name}: held-out quality per language"
                 " (dashed: all routed experts removed)", fontsize=11)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(out / "quality.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for i, n in enumerate(_model_order(results)):
        ax.bar(x + (i - len(names) / 2) * (0.8 / (len(names) + 1)), [q[n][l]["nll"] for l in LANGS],
               0.8 / (len(names) + 1), label=_label(results, n))
    ax.set_xticks(x, LANGS)
    ax.set_ylabel("mean NLL (nats / token)")
    ax.set_title("held-out NLL per language", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "nll_per_language.png", dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- report


def _pct(x: float | None, d: int = 1) -> str:
    return "n/a" if x is None else f"{100 * x:.{d}f}%"


def _f(x: float | None, d: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{d}f}"


def _tok(n: int) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else str(n)


def _routing(pair: dict, a: str, b: str) -> dict | None:
    return next((r for r in pair["routing"] if r["a"] == a and r["b"] == b), None)


#: pairs of the flip table, in order: the noise floor, +zh, +code, +zh+code
FLIP_PAIRS = (("A", "B"), ("B", "C"), ("C", "D"), ("B", "D"))


def _flip_rows(cmp: dict) -> list[dict]:
    by = {(p["earlier"], p["later"]): p for p in cmp["pairs"]}
    return [by[k] for k in FLIP_PAIRS if k in by]


def render_report(results: dict) -> str:
    """``report.md`` from ``results.json`` alone (every number in it comes from the dict)."""
    cfg = results["config"]
    q = results["eval"]["quality"]
    pr = results["pruning"]
    mdl = results["model"]
    gs = results["generations"]["summary"]
    cmp = results["compare"]
    E, k = mdl["num_experts"], next(iter(pr.values()))["num_experts_after"]
    L = len(mdl["moe_layers"])
    extra = sorted({r["sparsity"] for r in pr.values()} - {cfg["sparsity"]})
    fmts = next(iter(pr.values()))["verify"].get("quantization_format") or []
    lines = [
        "# REAP expert pruning: does the calibration language matter, and what does it cost?",
        "",
        f"Model `{mdl['path']}` ({mdl['model_class']}, {L} MoE layers x {E} routed experts, top-{mdl['top_k']}"
        f"{', checkpoint format ' + ', '.join(fmts) if fmts else ''}); every MoE layer pruned to {k} of {E} experts (sparsity {cfg['sparsity']:g})"
        + (f", and REAP(en), REAP(en+zh+code) and random also at sparsity {', '.join(f'{x:g}' for x in extra)}"
           if extra else "")
        + f".{' **Quick mode: tiny sizes, the numbers mean nothing.**' if cfg['quick'] else ''}",
        "",
        f"Produced by `{results.get('command') or 'reap_modifier.demo.run'}` on {results['created']} in"
        f" {results['timing']['total']:.0f} s ({cfg['threads']} CPU thread{'s' if cfg['threads'] > 1 else ''});"
        " every number below is in `results.json`.",
        "",
        "## Calibration",
        "",
        "REAP scores from `oneshot` + `REAPPruningModifier`, one run per corpus (model reloaded from its"
        " directory each time; only the scores file kept), sampled with a seed across all sources of the"
        " calibration split, then merged by adding sums (`ExpertScores.merge`):",
        "",
        "| part | corpus | tokens | windows | sources (tokens) | seconds |",
        "|---|---|---:|---:|---|---:|",
    ]
    for r in results["calibration"]["runs"]:
        src = ", ".join(f"{s} {_tok(n)}" for s, n in sorted(r["source_tokens"].items(), key=lambda kv: -kv[1]))
        lines.append(f"| {r['part']} | {r['source']} | {r['tokens']:,} | {r['rows']} | {src} | {r['seconds']:.1f} |")
    lines += ["", "| ranking | = | tokens |", "|---|---|---|"]
    for label, r in results["calibration"]["rankings"].items():
        lines.append(f"| {label} | {' + '.join(r['parts'])} | "
                     + ", ".join(f"{s} {_tok(n)}" for s, n in r["tokens"].items()) + " |")
    ev = results["eval"]
    lines += [
        "",
        "REAP(en) = B, REAP(en+zh) = C, REAP(en+zh+code) = D; frequency ranks by routed-token count in D;"
        " router_l1 / router_signed_sum / random use router weights only (no data; random seeded).",
        "",
        "## Quality after pruning",
        "",
        f"Held-out windows: {ev['windows_per_lang']} x {ev['seq_len']} tokens per language from the eval split"
        f" (never trained on, never calibrated on; `data.eval_windows`, seed {ev['seed']}), mean next-token NLL"
        " in nats (perplexity in brackets). `REAP(D) mass`: fraction of REAP(en+zh+code) saliency the plan keeps"
        " (layer mean) -- one yardstick for every method. `overlap`: kept experts shared with REAP(en+zh+code)"
        " at the same sparsity. The last row zeroes every routed expert's output (shared experts kept): what"
        " losing all of them would cost, for scale.",
        "",
        "| model | experts kept | REAP(D) mass | overlap | NLL en | NLL zh | NLL code |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in _model_order(results):
        if name == REFERENCE:
            kept, mass, ov = f"{E}", "100%", "-"
        elif name == ABLATION:
            kept, mass, ov = "0", "0%", "-"
        else:
            kept = f"{pr[name]['num_experts_after']}"
            mass, ov = _pct(pr[name]["retained_reap_mass_D"]), _pct(pr[name]["overlap_with_reap_en_zh_code"], 0)
        cells = " | ".join(f"{_f(q[name][l]['nll'])} ({_f(q[name][l]['ppl'], 1)})" for l in LANGS)
        lines.append(f"| {_label(results, name)} | {kept} | {mass} | {ov} | {cells} |")
    lines += [
        "",
        "Against the unpruned model on the same windows (top-1: fraction of positions where the argmax"
        " next token agrees; KL(unpruned || pruned) in nats per token):",
        "",
        "| model | top-1 en | top-1 zh | top-1 code | KL en | KL zh | KL code |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in _model_order(results)[1:]:
        lines.append(f"| {_label(results, name)} | "
                     + " | ".join(_pct(q[name][l]["top1_agreement"]) for l in LANGS) + " | "
                     + " | ".join(_f(q[name][l]["kl"], 4) for l in LANGS) + " |")
    lines += [
        "",
        "![quality per language](quality.png)",
        "",
        "Paired per-window NLL differences (second minus first; mean +- standard error over windows;"
        " positive = the second is worse):",
        "",
        "| first | second | en | zh | code |",
        "|---|---|---:|---:|---:|",
    ]
    for p in results["paired"]:
        lines.append(f"| {_label(results, p['a'])} | {_label(results, p['b'])} | "
                     + " | ".join(f"{p[l]['mean']:+.4f} +- {_f(p[l]['se'], 4)}" for l in LANGS) + " |")
    card = mdl.get("model_card")
    if card and card.get("loss"):
        same = card.get("same_windows")
        lines += ["", "Unpruned NLL vs the model card"
                  + (" (same windows)" if same else " (different windows: not comparable)") + ": "
                  + ", ".join(f"{l} {_f(q[REFERENCE][l]['nll'], 4)} vs {_f(card['loss'].get(l), 4)}" for l in LANGS)
                  + "."]
    lines += [
        "",
        "## Degeneration check (the seed's)",
        "",
        f"Greedy continuations of {cfg['prompts_per_lang']} held-out prompt(s) per language"
        f" ({cfg['prompt_tokens']} prompt tokens, {results['generations']['new_tokens']} new tokens): the longest"
        " run of back-to-back copies of one substring (the seed: 3 in healthy output, thousands in a collapsed"
        " one): the maximum over the prompts in tokens / in characters, and the mean over prompts in tokens."
        " Read it against the unpruned row: greedy decoding of a model this small loops on its own.",
        "",
        "| model | en max tok / chr | zh max tok / chr | code max tok / chr | en mean | zh mean | code mean |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in _model_order(results):
        lines.append(f"| {_label(results, name)} | "
                     + " | ".join(f"{gs[name][l]['max_repeat_run_tokens']} / {gs[name][l]['max_repeat_run_chars']}"
                                  for l in LANGS) + " | "
                     + " | ".join(f"{gs[name][l]['mean_repeat_run_tokens']:.1f}" for l in LANGS) + " |")
    lines += [
        "",
        "## The seed's flip table on our data",
        "",
        f"Rankings cut at {cmp['keep']} of {cmp['num_experts']} experts in each of {cmp['num_layers']} MoE layers"
        f" ({cmp['num_layers'] * cmp['keep']} kept slots). A flip is a kept slot whose expert changes. Promoted"
        f" experts (kept by the later ranking, dropped by the earlier): share routed >= {cmp['threshold']:g}x more"
        " often per token by zh (code) than by en, against the share among all experts.",
        "",
        "| pair | change | tokens added | flips | % of kept slots | x A->B | promoted zh-heavy (all) |"
        " promoted code-heavy (all) |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for p in _flip_rows(cmp):
        added = ", ".join(f"+{_tok(n)} {s}" for s, n in p["tokens_added"].items()) or "-"
        xf = "n/a" if p["x_first_pair"] is None else f"{p['x_first_pair']:.2f}x"
        zh, code = _routing(p, "en", "zh"), _routing(p, "en", "code")
        zc = f"{_pct(zh['promoted_frac_more_by_b'], 0)} ({_pct(zh['all_frac_more_by_b'], 0)})" if zh else "n/a"
        cc = f"{_pct(code['promoted_frac_more_by_b'], 0)} ({_pct(code['all_frac_more_by_b'], 0)})" if code else "n/a"
        lines.append(f"| {p['earlier']} -> {p['later']} | {p['change']} | {added} | {p['flips']} |"
                     f" {p['pct_of_kept_slots']:.2f}% | {xf} | {zc} | {cc} |")
    lines += ["", "Retained REAP saliency mass of each ranking under its own plan (the seed: 62.6% under B,"
              " 62.5% under C):", "", "| ranking | corpus | retained mass |", "|---|---|---:|"]
    for r in cmp["rankings"]:
        lines.append(f"| {r['label']} | {r['corpus']} | {_pct(r['retained_mass'], 2)} |")
    bc = next((p for p in cmp["pairs"] if p["earlier"] == "B" and p["later"] == "C"), None)
    if bc is not None:
        sup = bc["support"].get("rate@en", {}).get("promoted", {})
        lines += ["", f"B -> C: B's saliency keeps {_pct(bc['mass']['earlier_saliency_under_later_plan'], 2)} of its"
                  f" mass under C's plan (vs {_pct(bc['mass']['own_earlier'], 2)} under its own); promoted experts'"
                  " English routing rate is"
                  f" {_f(sup.get('median_ratio_to_layer_median'), 2)}x the layer median (median over promoted;"
                  f" {_pct(sup.get('frac_below_layer_median'), 0)} below the median,"
                  f" {_pct(sup.get('frac_never_routed'), 0)} never routed by the English calibration text)."]
    fbs = results.get("flips_by_sparsity") or {}
    if fbs:
        lines += ["", "The same pairs at other cut points (flips, % of kept slots, promoted zh-heavy / all experts):",
                  "", "| sparsity | keep | " + " | ".join(f"{a} -> {b}" for a, b in FLIP_PAIRS) + " |",
                  "|---:|---:|" + "---:|" * len(FLIP_PAIRS)]
        for sp, f in fbs.items():
            cells = []
            for a, b in FLIP_PAIRS:
                r = f["pairs"].get(f"{a}->{b}")
                cells.append("n/a" if r is None else
                             f"{r['flips']} ({r['pct_of_kept_slots']:.1f}%; {_pct(r['promoted_zh_heavy'], 0)}"
                             f" / {_pct(r['all_zh_heavy'], 0)})")
            lines.append(f"| {float(sp):g} | {f['keep']} | " + " | ".join(cells) + " |")
    lines += ["", "![flips per layer](compare/flips_per_layer.png)", "",
              "Full comparison (all pairs, per-layer flips, support): `compare/compare.md`; mass per tier:"
              " `tiers/`.", ""]
    tiers = results["tiers"]["rows"] or []
    if tiers:
        lines += ["Retained REAP(en+zh+code) mass by tier:", "", "| keep | pruned | retained mass |", "|---:|---:|---:|"]
        for t in tiers:
            lines.append(f"| {t['keep']} | {_pct(t['pruned_fraction'], 1)} | {_pct(t['retained_mass_mean'], 1)} |")
        lines.append("")
    lines += [
        "## Checkpoints",
        "",
        "Every pruned checkpoint was written by `rewrite_checkpoint` (kept experts' packed MXFP4 bytes copied"
        " verbatim from the source) and passed `verify_checkpoint(dst, source=src)`:",
        "",
    ]
    if mdl.get("left_out_of_checkpoint_source"):
        lines += [f"(The rewriter read the source through `{mdl['checkpoint_source']}`, a byte-identical copy of every file of"
                  f" the model folder except {', '.join(f'`{f}`' for f in mdl['left_out_of_checkpoint_source'])},"
                  " which is not a weight shard and which the rewriter refuses.)", ""]
    lines += [
        "| method | plan | checkpoint | experts | tensors sha256-equal to source | MB | verify | seconds |",
        "|---|---|---|---:|---:|---:|---|---:|",
    ]
    for name, r in pr.items():
        v = r["verify"]
        lines.append(f"| {r['label']} | `{r['plan']}` | `{r['checkpoint']}` | {r['num_experts_before']} -> "
                     f"{r['num_experts_after']} | {v.get('tensors_matching_source')} / {v.get('tensors')} |"
                     f" {r['bytes'] / 1e6:.2f} | {'OK' if v['ok'] else 'FAILED'} | {r['seconds']:.1f} |")
    lines += ["", "## Generations", ""]
    prompts = results["generations"]["prompts"]
    for lang in LANGS:
        for i, p in enumerate(prompts[lang][:1]):
            lines += [f"**{lang}**, prompt ({p['source']}): `{_md(p['text'])}`", ""]
            for name in _model_order(results):
                row = next(r for r in results["generations"]["by_model"][name] if r["lang"] == lang and r["prompt"] == i)
                lines.append(f"- {_label(results, name)} (run {row['repeat_run_tokens']} tok):"
                             f" `{_md(row['text'])}`")
            lines.append("")
    t = results["timing"]
    lines += [
        "## Timing",
        "",
        " | ".join(f"{k} {v:.0f} s" for k, v in t.items() if k != "total") + f" | **total {t['total']:.0f} s**",
        "",
        "## Limits",
        "",
        "A model of a few million parameters trained for minutes on a few million tokens: the effects show"
        " direction on a real routed model, not the size they would have on Kimi K3. The held-out windows,"
        " calibration samples and prompts are small; the standard errors above are over windows of one text"
        " stream and understate the uncertainty. Greedy continuations of a model this weak are poor even"
        " unpruned, so the repeat runs separate collapse from non-collapse, not good text from bad.",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()),
        "",
    ]
    return "\n".join(lines)


def summary_tables(results: dict) -> str:
    """The compact tables docs/README-demo.md shows (quality per model, the flip table), from a
    run's ``results.json``: ``python -m reap_modifier.demo --tables out/demo/results.json``."""
    q, pr, gs = results["eval"]["quality"], results["pruning"], results["generations"]["summary"]
    E = results["model"]["num_experts"]
    lines = [
        "| model | experts kept | REAP mass kept | NLL en | NLL zh | NLL code | KL en | KL zh | KL code |"
        " top-1 zh | zh repeat run, max / mean |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in _model_order(results):
        if name == REFERENCE:
            kept, mass = E, "100%"
        elif name == ABLATION:
            kept, mass = 0, "0%"
        else:
            kept, mass = pr[name]["num_experts_after"], _pct(pr[name]["retained_reap_mass_D"])
        kl = " | ".join("-" if name == REFERENCE else _f(q[name][l]["kl"], 4) for l in LANGS)
        t1 = "-" if name == REFERENCE else _pct(q[name]["zh"]["top1_agreement"])
        lines.append(f"| {_label(results, name)} | {kept} | {mass} | "
                     + " | ".join(_f(q[name][l]["nll"]) for l in LANGS) + f" | {kl} | {t1} |"
                     f" {gs[name]['zh']['max_repeat_run_tokens']} / {gs[name]['zh']['mean_repeat_run_tokens']:.1f} |")
    fbs = results.get("flips_by_sparsity") or {}
    if fbs:
        lines += ["", "| sparsity (keep) | " + " | ".join(f"{a} -> {b}" for a, b in FLIP_PAIRS) + " |",
                  "|---|" + "---:|" * len(FLIP_PAIRS)]
        for sp, f in fbs.items():
            cells = []
            for a, b in FLIP_PAIRS:
                r = f["pairs"].get(f"{a}->{b}")
                cells.append("n/a" if r is None else f"{r['flips']} / {f['kept_slots']} = {r['pct_of_kept_slots']:.1f}%"
                             f" (zh-heavy {_pct(r['promoted_zh_heavy'], 0)})")
            lines.append(f"| {float(sp):.0%} ({f['keep']}) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _md(text: str) -> str:
    return text.replace("`", "'").replace("\n", " \u21b5 ").replace("|", "\\|")


# ----------------------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m reap_modifier.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="MXFP4 MoE checkpoint directory (with tokenizer)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="output folder (its demo files are replaced)")
    ap.add_argument("--data-dir", default=None, help="corpora folder (default: the repository's data/, built if missing)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test); the numbers mean nothing")
    ap.add_argument("--sparsity", type=float, default=DemoConfig.sparsity)
    ap.add_argument("--extra-sparsity", default=str(DemoConfig.extra_sparsity),
                    help="also prune REAP(en), REAP(en+zh+code) and random to this sparsity ('none': skip)")
    ap.add_argument("--tokens-per-part", type=int, default=DemoConfig.tokens_per_part,
                    help="calibration tokens of each part (en1, en2, zh, code)")
    ap.add_argument("--eval-windows", type=int, default=DemoConfig.eval_windows, help="per language")
    ap.add_argument("--gen-tokens", type=int, default=DemoConfig.gen_tokens)
    ap.add_argument("--prompts", type=int, default=DemoConfig.prompts_per_lang, help="per language")
    ap.add_argument("--seed", type=int, default=DemoConfig.seed)
    ap.add_argument("--threads", type=int, default=DemoConfig.threads)
    ap.add_argument("--verbose", action="store_true", help="keep library logging")
    ap.add_argument("--tables", metavar="RESULTS_JSON", default=None,
                    help="only print the summary tables of an earlier run's results.json (for the README)")
    a = ap.parse_args(argv)
    if a.tables:
        print(summary_tables(json.loads(Path(a.tables).read_text())), end="")
        return 0
    if not a.verbose:
        _quiet_libraries()
    extra = None if str(a.extra_sparsity).lower() in ("none", "") else float(a.extra_sparsity)
    cfg = DemoConfig(model=a.model, out=a.out, data_dir=a.data_dir, sparsity=a.sparsity, extra_sparsity=extra,
                     tokens_per_part=a.tokens_per_part, eval_windows=a.eval_windows, gen_tokens=a.gen_tokens,
                     prompts_per_lang=a.prompts, seed=a.seed, threads=a.threads, quick=a.quick)
    run(cfg, command="python -m reap_modifier.demo" + "".join(f" {x}" for x in (argv if argv is not None else sys.argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
