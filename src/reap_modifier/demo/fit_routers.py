"""Stage 2b of the main job: the router-fit checkpoints -- REAP's cut, then every kept router
fitted on the mix's calibration tokens (``calibrate_router``), saved through ``oneshot``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .config import FIT_PARTS, PARTS, DemoConfig, Method
from .inputs import Inputs
from .workspace import load_model


def fit_sets(cfg: DemoConfig, inputs: Inputs) -> dict[str, Any]:
    """Per calibration mix of :data:`FIT_PARTS`: the router fit's dataset, ``router_fit_tokens``
    tokens drawn evenly from the mix's calibration parts (whole windows from the start of each),
    each window's language in a ``language`` column (a string: the collator drops it)."""
    from datasets import concatenate_datasets

    language = dict(PARTS)

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
            piece = ds.select(range(rows))
            pieces.append(piece.add_column("language", [language[part]] * rows))
        out[mix] = concatenate_datasets(pieces)
    return out


def fit_router_checkpoint(
    cfg: DemoConfig, m: Method, src_dir: Path, dst: Path, scores_path: Path, plan, inputs: Inputs
) -> tuple[Any, dict]:
    """REAP's cut from ``scores_path`` (the plan the job cut, checked equal), then every kept
    router fitted on the mix's calibration tokens (``calibrate_router``; with ``m.fit`` and
    ``m.selection`` the other post-cut components), saved by ``oneshot``: expert bytes copied from
    the source, fitted tensors written from memory. Returns the plan the run cut (``plan`` itself
    unless a block-error selection re-chose the kept experts) and the fit's record."""
    from llmcompressor import oneshot

    from ..modifier import REAPPruningModifier

    dataset = fit_sets(cfg, inputs)[m.calibration]
    tokens = int(sum(len(r) for r in dataset["input_ids"]))
    model = load_model(src_dir, packed=True, dtype=cfg.dtype)
    modifier = REAPPruningModifier(
        sparsity=m.sparsity,
        scores_in=str(scores_path),
        seed=cfg.seed,
        calibrate_router="router" in m.fit,
        calibrate_bias="bias" in m.fit,
        compensate="dense" in m.fit,
        selection=m.selection,
        **({"selection_groups": "language"} if m.groups else {}),
        router_fit_tokens=tokens,
        router_fit_steps=cfg.router_fit_steps,
        router_fit_lr=cfg.router_fit_lr,
        **(
            dict(compensation_steps=cfg.compensation_steps, compensation_lr=cfg.compensation_lr)
            if "dense" in m.fit
            else {}
        ),
    )
    if dst.exists():
        import shutil

        shutil.rmtree(dst)
    import torch

    # oneshot shuffles the calibration samples with torch's global generator, and which of
    # them are held out to validate the fit follows that order: seeded here, every fit of a
    # mix draws the same order, whatever ran before it in the job
    torch.manual_seed(cfg.seed)
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
    if m.selection == "saliency" and modifier.plan.kept != plan.kept:
        raise RuntimeError(f"{m.name}: the router-fit run cut a different plan than {m.ranking}'s")
    fit = modifier.router_fit
    return modifier.plan, {
        "tokens": tokens,
        "parts": list(FIT_PARTS[m.calibration]),
        "method": fit.get("method"),
        "steps": cfg.router_fit_steps,
        "lr": cfg.router_fit_lr,
        "components": fit.get("components", []),
        "selection": {k: v for k, v in (fit.get("selection") or {}).items() if k != "layers"}
        or None,
        "validation": fit.get("validation"),
        "layers": {
            layer: {k: v for k, v in rec.items() if isinstance(v, int | float)}
            for layer, rec in fit.get("layers", {}).items()
        },
    }
