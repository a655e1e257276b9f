"""The main job's report: ``report.md`` and the summary tables rendered from ``results.json``
alone (read once into the typed records of :mod:`.records`; one renderer per section, each table
that appears twice rendered by one function in :mod:`.report_tables`). The sections live by
concept: :mod:`.report_quality` (quality, router fit), :mod:`.report_flips` (flips, tiers),
:mod:`.report_generations` (degeneration, generations); the PNG plots are :mod:`.report_plots`."""

from __future__ import annotations

from ..analysis.formatting import tokens
from .config import METHODS
from .records import Results, read_results
from .report_flips import flips_section
from .report_generations import degeneration_section, generations_section
from .report_quality import (
    best_section,
    decisions_section,
    objective_section,
    quality_section,
    router_fit_section,
    summary_quality,
)
from .report_tables import FLIPS_IN_SUMMARY, flip_table, paired_nll_table, reap_losses


def render_report(results: dict) -> str:
    """``report.md`` from ``results.json`` alone (every number in it comes from the dict), one
    renderer per section."""
    res = read_results(results)
    sections = (
        _title,
        _calibration,
        quality_section,
        router_fit_section,
        decisions_section,
        best_section,
        objective_section,
        degeneration_section,
        flips_section,
        _checkpoints,
        generations_section,
        _timing_and_limits,
    )
    return "\n".join(line for section in sections for line in section(res))


def _title(res: Results) -> list[str]:
    run, mdl, pruned = res.run, res.model_info, res.pruned
    E, k, L = mdl.num_experts, pruned[0].experts_after, mdl.moe_layers
    extra = sorted({c.sparsity for c in pruned} - {run.sparsity})
    fits = [c for c in pruned if c.fit]
    fmts = pruned[0].quantization_format
    return [
        "# REAP expert pruning: does the calibration language matter, and what does it cost?",
        "",
        f"Model `{mdl.path}` ({mdl.model_class}, {L} MoE layers x {E} routed experts, top-{mdl.top_k}"
        f"{', checkpoint format ' + ', '.join(fmts) if fmts else ''}); every MoE layer pruned to {k} of {E} experts (sparsity {run.sparsity:g})"
        + (
            f", and also at sparsity {', '.join(f'{x:g}' for x in extra)} (the methods listed below)"
            if extra
            else ""
        )
        + (
            f"; {len(fits)} of the cuts also with their routers fitted after the cut"
            " (`calibrate_router`)"
            if fits
            else ""
        )
        + f".{' **Quick mode: tiny sizes, the numbers mean nothing.**' if run.quick else ''}",
        "",
        f"Produced by `{run.command or 'reap_modifier.demo.run'}` on {run.created} in"
        f" {run.timing['total']:.0f} s ({run.threads} CPU thread{'s' if run.threads > 1 else ''});"
        " every number below is in `results.json`.",
        "",
    ]


def _calibration(res: Results) -> list[str]:
    lines = [
        "## Calibration",
        "",
        "REAP scores from `oneshot` + `REAPPruningModifier`, one run per corpus (model reloaded from its"
        " directory each time; only the scores file kept), sampled with a seed across all sources of the"
        " calibration split, then merged by adding sums (`ExpertScores.merge`):",
        "",
        "| part | corpus | tokens | windows | sources (tokens) | seconds |",
        "|---|---|---:|---:|---|---:|",
    ]
    for r in res.calibration_runs:
        src = ", ".join(
            f"{s} {tokens(n)}" for s, n in sorted(r.source_tokens.items(), key=lambda kv: -kv[1])
        )
        lines.append(
            f"| {r.part} | {r.source} | {r.tokens:,} | {r.rows} | {src} | {r.seconds:.1f} |"
        )
    pc = res.packed_check
    if pc:
        lines += [
            "",
            f"Every run kept the MXFP4 experts packed and dequantized one MoE layer at a time"
            f" (`dequantize: layer`). Check: part {pc.part} calibrated again on the fully"
            f" decompressed model gives the same statistics to {pc.max_rel:.1e} relative"
            f" ({pc.statistics:,} values; tolerance {pc.tolerance:g}).",
        ]
    lines += ["", "| ranking | = | tokens |", "|---|---|---|"]
    for r in res.rankings:
        lines.append(
            f"| {r.label} | {' + '.join(r.parts)} | "
            + ", ".join(f"{s} {tokens(n)}" for s, n in r.tokens.items())
            + " |"
        )
    mixes = ", ".join(f"{m.label} = {m.ranking}" for m in METHODS if m.role == "mix")
    lines += [
        "",
        f"{mixes}; frequency ranks by routed-token count in D, EAN by the summed norm of each"
        " expert's output over the tokens routed to it in D, MAN (ean_mean) by its mean;"
        " router_l1 / router_signed_sum / random use router weights only (no data; random seeded).",
        "",
    ]
    return lines


def _checkpoints(res: Results) -> list[str]:
    mdl = res.model_info
    lines = [
        "## Checkpoints",
        "",
        "Every pruned checkpoint was written by `rewrite_checkpoint` (kept experts' packed MXFP4 bytes copied"
        " verbatim from the source; the router-fit ones by `oneshot` through the same rewriter, with the"
        " fitted router tensors written from memory) and passed `verify_checkpoint(dst, source=src)`"
        " (which names every tensor that differs from its source and why):",
        "",
    ]
    if mdl.left_out:
        lines += [
            f"(The rewriter read the source through `{mdl.checkpoint_source}`, a byte-identical copy of every file of"
            f" the model folder except {', '.join(f'`{f}`' for f in mdl.left_out)},"
            " which is not a weight shard and which the rewriter refuses.)",
            "",
        ]
    lines += [
        "| method | plan | checkpoint | experts | tensors sha256-equal to source | MB | verify | seconds |",
        "|---|---|---|---:|---:|---:|---|---:|",
    ]
    for c in res.pruned:
        lines.append(
            f"| {c.label} | `{c.plan}` | `{c.path}` | {c.experts_before} -> "
            f"{c.experts_after} | {c.tensors_matching_source} / {c.tensors} |"
            f" {c.bytes / 1e6:.2f} | {'OK' if c.verify_ok else 'FAILED'} | {c.seconds:.1f} |"
        )
    return lines


def _timing_and_limits(res: Results) -> list[str]:
    t = res.run.timing
    return [
        "## Timing",
        "",
        " | ".join(f"{k} {v:.0f} s" for k, v in t.items() if k != "total")
        + f" | **total {t['total']:.0f} s**",
        "",
        "## Limits",
        "",
        "A model of a few million parameters trained for minutes on a few million tokens: the effects show"
        " direction on a real routed model, not the size they would have on Kimi K3. The held-out windows,"
        " calibration samples and prompts are small; the standard errors above are over windows of one text"
        " stream and understate the uncertainty. Greedy continuations of a model this weak are poor even"
        " unpruned, so the repeat runs separate collapse from non-collapse, not good text from bad.",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in res.run.versions.items()),
        "",
    ]


# ----------------------------------------------------------------------------- summary


def summary_tables(results: dict) -> str:
    """The compact tables docs/README-demo.md shows (quality per model, the flip table), from a
    run's ``results.json``: ``python -m reap_modifier.demo --tables out/demo/results.json``."""
    res = read_results(results)
    lines = summary_quality(res)
    if res.cut_points:
        lines += ["", *flip_table(res.cut_points, FLIPS_IN_SUMMARY)]
    lines += reap_losses(res)
    lines += [
        "Paired per-window NLL differences, second minus first (mean +- standard error):",
        "",
        *paired_nll_table(res),
    ]
    lines += router_fit_section(res)
    lines += decisions_section(res)
    lines += best_section(res)
    lines += objective_section(res)
    return "\n".join(lines) + "\n"
