"""The flip section: the seed's flip table on our data, each ranking's retained mass, the same
pairs at the other cut points, and the retained mass by tier."""

from __future__ import annotations

from ..analysis.formatting import pct, tokens
from .config import FLIP_PAIRS
from .records import Results
from .report_tables import FLIPS_IN_REPORT, flip_table, fmt


def flips_section(res: Results) -> list[str]:
    """The seed's flip table, retained masses and the other cut points."""
    cut = res.flip_setup
    lines = [
        "",
        "## The seed's flip table on our data",
        "",
        f"Rankings cut at {cut.keep} of {cut.num_experts} experts in each of {cut.num_layers} MoE layers"
        f" ({cut.num_layers * cut.keep} kept slots). A flip is a kept slot whose expert changes. Promoted"
        f" experts (kept by the later ranking, dropped by the earlier): share routed >= {cut.threshold:g}x more"
        " often per token by zh (code) than by en, against the share among all experts.",
        "",
        "| pair | change | tokens added | flips | % of kept slots | x A->B | promoted zh-heavy (all) |"
        " promoted code-heavy (all) |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    by = {(p.earlier, p.later): p for p in res.flip_pairs}
    for p in (by[k] for k in FLIP_PAIRS if k in by):
        added = ", ".join(f"+{tokens(n)} {s}" for s, n in p.tokens_added.items()) or "-"
        xf = "n/a" if p.x_first_pair is None else f"{p.x_first_pair:.2f}x"
        zc, cc = (
            f"{pct(h[0], 0)} ({pct(h[1], 0)})" if h else "n/a" for h in (p.zh_heavy, p.code_heavy)
        )
        lines.append(
            f"| {p.earlier} -> {p.later} | {p.change} | {added} | {p.flips} |"
            f" {p.pct_of_kept_slots:.2f}% | {xf} | {zc} | {cc} |"
        )
    lines += [
        "",
        "Retained REAP saliency mass of each ranking under its own plan (the seed: 62.6% under B,"
        " 62.5% under C):",
        "",
        "| ranking | corpus | retained mass |",
        "|---|---|---:|",
    ]
    for r in res.ranking_masses:
        lines.append(f"| {r.label} | {r.corpus} | {pct(r.retained_mass, 2)} |")
    bc = by.get(("B", "C"))
    if bc is not None:
        sup = bc.support_en
        lines += [
            "",
            f"B -> C: B's saliency keeps {pct(bc.mass_under_later_plan, 2)} of its"
            f" mass under C's plan (vs {pct(bc.mass_own, 2)} under its own); promoted experts'"
            " English routing rate is"
            f" {fmt(sup.get('median_ratio_to_layer_median'), 2)}x the layer median (median over promoted;"
            f" {pct(sup.get('frac_below_layer_median'), 0)} below the median,"
            f" {pct(sup.get('frac_never_routed'), 0)} never routed by the English calibration text).",
        ]
    if res.cut_points:
        lines += [
            "",
            "The same pairs at other cut points (flips, % of kept slots, promoted zh-heavy / all experts):",
            "",
            *flip_table(res.cut_points, FLIPS_IN_REPORT),
        ]
    return lines + _tiers(res)


def _tiers(res: Results) -> list[str]:
    """Links to the full comparison and the retained mass by tier."""
    lines = [
        "",
        "![flips per layer](compare/flips_per_layer.png)",
        "",
        "Full comparison (all pairs, per-layer flips, support): `compare/compare.md`; mass per tier:"
        " `tiers/`.",
        "",
    ]
    if res.tiers:
        lines += [
            "Retained REAP(en+zh+code) mass by tier:",
            "",
            "| keep | pruned | retained mass |",
            "|---:|---:|---:|",
        ]
        for t in res.tiers:
            lines.append(
                f"| {t.keep} | {pct(t.pruned_fraction, 1)} | {pct(t.retained_mass_mean, 1)} |"
            )
        lines.append("")
    return lines
