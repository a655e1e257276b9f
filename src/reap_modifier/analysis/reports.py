"""Written reports of the analysis: markdown tables, JSON and PNGs for ``reap tiers``
and ``reap compare``."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..fileio import write_atomic, write_json_atomic
from ..reporting import jsonable
from ..scores import ExpertScores
from .compare import Ranking, rate_ratio, routing_rates
from .formatting import pct, tokens
from .plots import plot_flips, plot_routing_ratio, plot_tiers

__all__ = ["compare_markdown", "tiers_markdown", "write_compare_report", "write_tiers_report"]


def tiers_markdown(report: dict) -> str:
    lines = [
        f"# Tiers: retained saliency mass ({report['saliency']})",
        "",
        f"{report['num_layers']} MoE layers x {report['num_experts']} experts.",
        "",
        "| keep | pruned | retained mass (mean) | min layer | max layer |",
        "|---:|---:|---:|---:|---:|",
    ]
    for t in report["tiers"]:
        lines.append(
            f"| {t['keep']} | {100 * t['pruned_fraction']:.1f}% | "
            f"{pct(t['retained_mass_mean'])} | {pct(t['retained_mass_min'])} | "
            f"{pct(t['retained_mass_max'])} |"
        )
    lines += [
        "",
        "Marginal cost per pruned expert between tiers (mass lost / experts pruned):",
        "",
        "| from keep | to keep | mass lost | per expert | x uniform share |",
        "|---:|---:|---:|---:|---:|",
    ]
    for b in report["between_tiers"]:
        lines.append(
            f"| {b['from_keep']} | {b['to_keep']} | {pct(b['mass_lost'])} | "
            f"{100 * b['cost_per_expert']:.4f}% | {b['cost_per_expert_vs_uniform']:.2f} |"
        )
    lines += [
        "",
        "## Is there a knee?",
        "",
        report["answer"],
        "",
        f"Test: {report['knee_definition']}.",
        "",
        "![tiers](tiers.png)",
        "",
    ]
    return "\n".join(lines)


def write_tiers_report(report: dict, out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write ``tiers.json``, ``tiers.md`` and ``tiers.png`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": write_json_atomic(out / "tiers.json", jsonable(report)),
        "png": plot_tiers(report, out / "tiers.png"),
    }
    write_atomic(out / "tiers.md", tiers_markdown(report))
    paths["markdown"] = out / "tiers.md"
    return paths


def compare_markdown(result: dict) -> str:
    """``compare.md`` from a :func:`compare_rankings` result: its sections in order."""
    out = [
        *_rankings_section(result),
        *_flips_section(result),
        *_mass_section(result),
        *_promoted_section(result),
        *_support_section(result),
        *_definitions_section(result),
    ]
    return "\n".join(out)


def _rankings_section(result: dict) -> list[str]:
    """The title and one row per ranking: corpus, tokens, saliency, retained mass."""
    k, L, E = result["keep"], result["num_layers"], result["num_experts"]
    out = [
        "# Ranking comparison",
        "",
        f"Keep {k} of {E} experts in each of {L} MoE layers ({L * k:,} kept slots).",
        "",
        "| ranking | corpus | tokens | saliency | retained mass at keep |",
        "|---|---|---:|---|---:|",
    ]
    for r in result["rankings"]:
        toks = ", ".join(f"{s} {tokens(n)}" for s, n in r["tokens"].items()) or "-"
        out.append(
            f"| {r['label']} | {r['corpus']} | {toks} | {r['saliency']} | "
            f"{pct(r['retained_mass'])} |"
        )
    return out


def _flips_section(result: dict) -> list[str]:
    """Keep/drop flips per consecutive pair of rankings, and their spread over layers."""
    out = [
        "",
        "## Keep/drop flips",
        "",
        "A flip is a kept slot whose expert changes (promoted = kept by the later ranking, "
        "dropped by the earlier; there are as many demoted). `x first` divides by the first "
        "consecutive pair (the noise floor when it adds more of the same corpus).",
        "",
        "| change | tokens added | flips | % of kept slots | % of all slots | x first |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for p in result["pairs"]:
        added = (
            ", ".join(
                f"{'+' if n > 0 else ''}{tokens(n)} {s}" for s, n in p["tokens_added"].items()
            )
            or "-"
        )
        xf = "n/a" if p["x_first_pair"] is None else f"{p['x_first_pair']:.2f}x"
        out.append(
            f"| {p['earlier']} -> {p['later']}: {p['change']} | {added} | {p['flips']:,} | "
            f"{p['pct_of_kept_slots']:.2f}% | {p['pct_of_all_slots']:.2f}% | {xf} |"
        )
    out += [
        "",
        "Per layer (% of kept slots): "
        + "; ".join(
            f"{p['earlier']}->{p['later']} min {min(p['pct_per_layer']):.1f}, median "
            f"{float(np.median(p['pct_per_layer'])):.1f}, max {max(p['pct_per_layer']):.1f}"
            for p in result["pairs"]
        ),
        "",
        "![flips per layer](flips_per_layer.png)",
    ]
    return out


def _mass_section(result: dict) -> list[str]:
    """Retained saliency mass of each pair, own plans and crossed."""
    out = [
        "",
        "## Retained saliency mass",
        "",
        "| pair | earlier, own | later, own | earlier's saliency under later plan | "
        "later's saliency under earlier plan |",
        "|---|---:|---:|---:|---:|",
    ]
    for p in result["pairs"]:
        m = p["mass"]
        out.append(
            f"| {p['earlier']} -> {p['later']} | {pct(m['own_earlier'])} | "
            f"{pct(m['own_later'])} | {pct(m['earlier_saliency_under_later_plan'])} | "
            f"{pct(m['later_saliency_under_earlier_plan'])} |"
        )
    return out


def _promoted_section(result: dict) -> list[str]:
    """How much more often the promoted experts are routed by one source than another
    (skipped, saying why, without per-source counts)."""
    out = ["", "## Promoted experts", ""]
    if not result["routing_sources"]:
        out.append(
            "No per-source routing counts were available (give `--per-source en=S1 zh=S2` or "
            "rankings whose files carry per-source counts), so the routing-ratio view is skipped."
        )
    else:
        out.append(
            "Per-token routing rate of source s: routed count on s / tokens of s. Sources: "
            + "; ".join(f"{s}: {o}" for s, o in result["routing_sources"].items())
            + "."
        )
        out += [
            "",
            f"| pair | sources a / b | promoted | promoted >= {result['threshold']:g}x more by b | "
            f"all experts >= {result['threshold']:g}x more by b | promoted >= "
            f"{result['threshold']:g}x more by a | all experts >= {result['threshold']:g}x more by a |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for p in result["pairs"]:
            for r in p["routing"]:
                out.append(
                    f"| {p['earlier']} -> {p['later']} | {r['a']} / {r['b']} | {p['flips']:,} | "
                    f"{pct(r['promoted_frac_more_by_b'])} | {pct(r['all_frac_more_by_b'])} | "
                    f"{pct(r['promoted_frac_more_by_a'])} | {pct(r['all_frac_more_by_a'])} |"
                )
        out += ["", "![routing ratio](routing_ratio.png)"]
    return out


def _support_section(result: dict) -> list[str]:
    """Routed tokens of promoted and demoted experts relative to their layer's median."""
    out = [
        "",
        "Support of promoted experts (routed tokens) relative to the median expert of their "
        "layer (1.0 = median):",
        "",
        "| pair | support measured in | promoted: median ratio | promoted below median | "
        "demoted: median ratio | all: below median |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for p in result["pairs"]:
        for where, s in p["support"].items():
            label = f"{p['earlier']}'s counts" if where == "earlier_count" else where
            med = s["promoted"]["median_ratio_to_layer_median"]
            dmed = s["demoted"]["median_ratio_to_layer_median"]
            out.append(
                f"| {p['earlier']} -> {p['later']} | {label} | "
                f"{'n/a' if med is None else f'{med:.2f}'} | "
                f"{pct(s['promoted']['frac_below_layer_median'])} | "
                f"{'n/a' if dmed is None else f'{dmed:.2f}'} | "
                f"{pct(s['all']['frac_below_layer_median'])} |"
            )
    return out


def _definitions_section(result: dict) -> list[str]:
    """The keep rule as applied and what each number means."""
    rule = result["keep_rule"]
    return [
        "",
        "## Definitions",
        "",
        f"- keep {result['keep']} (requested {rule['requested']}"
        + (f"; {'; '.join(rule['adjustments'])}" if rule["adjustments"] else "")
        + "); "
        "selection as `reap cut`: highest saliency per layer, ties to the lower index"
        + (f", equal count per group (n_group={rule['n_group']})" if rule["n_group"] else "")
        + ".",
        "- retained mass: layer mean of kept saliency / layer saliency.",
        f"- routed >= {result['threshold']:g}x more often by b: rate_b / rate_a >= "
        f"{result['threshold']:g} (an expert routed by b but never by a counts; never routed "
        "by either does not).",
        "- every number is in compare.json.",
        "",
    ]


def write_compare_report(
    result: dict,
    out_dir: str | os.PathLike,
    rankings: list[Ranking] | None = None,
    per_source: dict[str, ExpertScores] | None = None,
) -> dict[str, Path]:
    """Write ``compare.md``, ``compare.json``, ``flips_per_layer.png`` and (with routing
    data) ``routing_ratio.png``. ``rankings``/``per_source`` rebuild the per-expert
    ratios for the histogram (the JSON keeps the summaries and the promoted ids)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": write_json_atomic(out / "compare.json", jsonable(result))}
    write_atomic(out / "compare.md", compare_markdown(result))
    paths["markdown"] = out / "compare.md"
    paths["flips_png"] = plot_flips(result, out / "flips_per_layer.png")
    panels = []
    if rankings is not None and result["routing_sources"]:
        layers = result["layers"]
        rates, _ = routing_rates(rankings, per_source, layers)
        L, E = result["num_layers"], result["num_experts"]
        for p in result["pairs"]:
            promoted = np.zeros((L, E), dtype=bool)
            for li, name in enumerate(layers):
                promoted[li, p["promoted"][name]] = True
            for r in p["routing"]:
                ratio = rate_ratio(rates[r["b"]], rates[r["a"]])
                panels.append(
                    (
                        f"{p['earlier']}->{p['later']}: {r['b']}/{r['a']}; promoted >= "
                        f"{result['threshold']:g}x by {r['b']}: {pct(r['promoted_frac_more_by_b'])} "
                        f"(all {pct(r['all_frac_more_by_b'])})",
                        ratio,
                        promoted,
                    )
                )
    png = plot_routing_ratio(result, panels, out / "routing_ratio.png")
    if png:
        paths["routing_png"] = png
    return paths
