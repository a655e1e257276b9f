"""Stage 1 of the main job: REAP calibration through ``oneshot`` once per corpus part, the
packed-vs-dense check, and the rankings' scores merged from the parts."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import PARTS, RANKINGS, DemoConfig
from .inputs import Inputs
from .workspace import load_model


@dataclass
class Calibration:
    """Stage 1: one oneshot run per part, the packed-vs-dense check, the parts' and the merged
    rankings' scores (also written under ``out/scores``)."""

    runs: list[dict]
    packed_check: dict
    parts: dict[str, Any]
    merged: dict[str, Any]


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
