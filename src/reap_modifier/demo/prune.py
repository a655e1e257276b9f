"""Stage 2 of the main job: per method of :func:`~.config.job_methods`, a plan cut from its scores,
the bit-exact checkpoint rewrite (or, for a router-fit method, :mod:`.fit_routers`) and
``verify_checkpoint`` against the source; then each plan's overlap with
:data:`~.config.HEADLINE_METHOD`'s at the same sparsity."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .calibrate import Calibration
from .config import HEADLINE_METHOD, YARDSTICK, DemoConfig, Method, job_methods, method_base
from .fit_routers import fit_router_checkpoint
from .inputs import Inputs
from .workspace import relative_to

#: the verification report's facts kept in each method's record
VERIFY_KEYS = (
    "moe_layers",
    "num_experts",
    "tensors",
    "tensors_matching_source",
    "checked_against_source",
    "quantization_format",
    "differs_from_source",
)


@dataclass
class Pruning:
    """Stage 2: each method's plan and its record (checkpoint, verification, masses, overlap)."""

    src_dir: Path  # the checkpoint the rewriter reads
    left_out: Any  # files of the model folder left out of it
    plans: dict[str, Any]  # by method
    records: dict[str, dict]  # by method


def prune_and_verify(
    cfg: DemoConfig, src_dir: Path, left_out, out: Path, calib: Calibration, inputs: Inputs
) -> Pruning:
    """Stage 2: per method, a plan, the bit-exact rewrite and ``verify --source``; then each
    plan's overlap with REAP(en+zh+code) at the same sparsity."""
    from tqdm.auto import tqdm

    methods = job_methods(cfg)
    yard = calib.merged[YARDSTICK].saliency("reap")
    plans, records = {}, {}
    for m in tqdm(
        methods, desc="prune (checkpoint rewrite) + verify", unit="ckpt", dynamic_ncols=True
    ):
        plans[m.name], records[m.name] = prune_one(cfg, m, src_dir, out, calib, yard, inputs)
    headline = {m.sparsity: m.name for m in methods if method_base(m.name) == HEADLINE_METHOD}
    for m in methods:  # overlap with REAP(en+zh+code) at the same sparsity
        plan, ref = plans[m.name], plans[headline[m.sparsity]]
        shared = [len(set(plan.kept[l]) & set(ref.kept[l])) for l in plan.kept]
        records[m.name]["overlap_with_reap_en_zh_code"] = sum(shared) / (
            len(shared) * plan.num_kept
        )
    return Pruning(src_dir, left_out, plans, records)


def method_scores(cfg: DemoConfig, m: Method, src_dir: Path, out: Path, calib: Calibration):
    """``(scores, path)``: a calibrated method's merged ranking, or the router-weight scores of a
    weights method (computed once, then read from ``out/scores``)."""
    from ..scores import ExpertScores
    from ..scores.baselines import scores_from_weights

    if m.kind == "calibrated":
        return calib.merged[m.ranking], out / "scores" / f"{m.ranking}.safetensors"
    spath = out / "scores" / f"{m.saliency}.safetensors"
    if not spath.is_file():
        scores_from_weights(src_dir, m.saliency, seed=cfg.seed).save(spath)
    return ExpertScores.load(spath), spath


def prune_one(
    cfg: DemoConfig,
    m: Method,
    src_dir: Path,
    out: Path,
    calib: Calibration,
    yard,
    inputs: Inputs | None = None,
):
    """One method: its scores (calibrated, or from the router weights), plan, checkpoint and
    verification; returns ``(plan, record)``. A router-fit method cuts the same plan and saves
    through ``oneshot`` + ``calibrate_router`` (:func:`~.fit_routers.fit_router_checkpoint`)."""
    from ..checkpoint import prepare_rewrite
    from ..checkpoint.verify import verify_checkpoint
    from ..scores.plan import plan_from_scores

    t = time.time()
    scores, spath = method_scores(cfg, m, src_dir, out, calib)
    plan = plan_from_scores(
        scores,
        sparsity=m.sparsity,
        saliency=m.saliency,
        params={"demo_method": m.name, "calibration": m.calibration},
    )
    plan_path = out / "plans" / f"{m.name}.json"
    plan.save(plan_path)
    dst = out / "pruned" / m.name
    fit = None
    if m.router_fit:
        plan, fit = fit_router_checkpoint(cfg, m, src_dir, dst, spath, plan, inputs)
        plan.save(plan_path)  # a block-error selection re-chose the kept experts
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
    paths = {"scores": spath, "plan": plan_path, "checkpoint": dst}
    return plan, method_record(m, plan, fit, rep, yard, out, paths, rewrite_s)


def method_record(
    m: Method, plan, fit: dict | None, rep, yard, out: Path, paths: dict[str, Path], seconds: float
) -> dict:
    """A method's entry of ``results.json``'s ``pruning``: what it is, where its files are (relative
    to ``out``), its plan's masses and kept experts, the verification and the checkpoint's size."""
    import numpy as np

    from ..scores.plan import retained_mass

    dst = paths["checkpoint"]
    return {
        "label": m.label,
        "kind": m.kind,
        "saliency": m.saliency,
        "calibration": m.calibration,
        "sparsity": m.sparsity,
        "router_fit": fit,
        **{k: relative_to(p, out) for k, p in paths.items()},
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
            **{k: rep.info.get(k) for k in VERIFY_KEYS},
        },
        "bytes": sum(f.stat().st_size for f in dst.rglob("*") if f.is_file()),
        "seconds": round(seconds, 2),
    }
