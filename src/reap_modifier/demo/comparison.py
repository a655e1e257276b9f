"""Stage 4 of the main job: the rankings compared (the flip table at each sparsity of
:data:`~.config.FLIP_SPARSITIES`) and the tiers report."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .calibrate import Calibration
from .config import FLIP_PAIRS, FLIP_SPARSITIES, RANKINGS, DemoConfig
from .workspace import relative_to


@dataclass
class Comparison:
    """Stage 4: the rankings' comparison, flips per sparsity and the tiers report."""

    cmp: dict
    flips_by_sparsity: dict
    tier_keeps: list[int]
    tiers: dict


def pair_routing(pair: dict, a: str, b: str) -> dict | None:
    """The routing comparison of languages ``a`` / ``b`` in one flip pair, or None."""
    return next((r for r in pair["routing"] if r["a"] == a and r["b"] == b), None)


def flip_rows(cmp: dict) -> list[dict]:
    """The pairs of :data:`~.config.FLIP_PAIRS` in a comparison, in that order."""
    by = {(p["earlier"], p["later"]): p for p in cmp["pairs"]}
    return [by[k] for k in FLIP_PAIRS if k in by]


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
        flips_by_sparsity[f"{sp:g}"] = flip_summary(c)
    E = merged["D"].num_experts
    tier_keeps = sorted(
        {max(merged["D"].metadata.get("top_k", 1), round(E * f)) for f in (0.75, 0.5, 0.375, 0.25)},
        reverse=True,
    )
    tiers = tiers_report(merged["D"], tier_keeps)
    write_tiers_report(tiers, out / "tiers")
    return Comparison(cmp, flips_by_sparsity, tier_keeps, tiers)


def flip_summary(cmp: dict) -> dict:
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
