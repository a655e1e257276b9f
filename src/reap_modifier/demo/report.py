"""The main job's report: ``report.md`` and the summary tables rendered from ``results.json``
alone (read once into the typed records of :mod:`.records`; one renderer per section, each table
that appears twice rendered by one function), and the PNG plots."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..analysis.formatting import pct, tokens
from ..analysis.plots import save_png
from .config import (
    ABLATION,
    BASELINES,
    FLIP_PAIRS,
    HEADLINE_METHOD,
    LANGS,
    METHODS,
    REFERENCE,
    method_base,
)
from .provenance import describe as describe_corpora
from .records import CutPoint, FlipCell, Results, read_results

#: the router fit's target: held-out KL this much lower than the same cut alone
FIT_TARGET = 0.2
#: the label of the method every other is compared against
HEADLINE_LABEL = next(m.label for m in METHODS if m.name == HEADLINE_METHOD)

# ----------------------------------------------------------------------------- plots


def write_plots(results: dict, out: Path) -> None:
    """``quality.png`` (NLL increase, KL and top-1 per language and method) and
    ``nll_per_language.png`` under ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    res = read_results(results)
    q = {m.name: m.quality for m in res.models}
    names = [c.name for c in res.pruned]
    x = np.arange(len(LANGS))
    width = 0.8 / max(1, len(names))
    fig, axes = plt.subplots(1, 3, figsize=(15, 5.2))
    panels = [
        ("NLL increase over unpruned (nats)", lambda n, l: q[n][l].nll - q[REFERENCE][l].nll),
        ("KL(unpruned || pruned) (nats / token)", lambda n, l: q[n][l].kl),
        ("top-1 agreement with unpruned", lambda n, l: q[n][l].top1),
    ]
    for ax, (title, fn) in zip(axes, panels):
        for i, n in enumerate(names):
            ax.bar(
                x + (i - (len(names) - 1) / 2) * width,
                [fn(n, l) for l in LANGS],
                width,
                label=res.label(n),
            )
        if ABLATION in q:  # the no-routed-experts reference, for scale
            for j, l in enumerate(LANGS):
                ax.hlines(
                    fn(ABLATION, l),
                    j - 0.42,
                    j + 0.42,
                    colors="black",
                    linestyles="dashed",
                    linewidth=1,
                    label=res.label(ABLATION) if j == 0 else None,
                )
        ax.set_xticks(x, LANGS)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    lo = min(q[n][l].top1 for n in names + [n for n in (ABLATION,) if n in q] for l in LANGS)
    axes[2].set_ylim(max(0.0, lo - 0.05), 1.0)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(
        handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=8, frameon=False
    )
    fig.suptitle(
        f"Expert pruning of {Path(res.model_info.path).name}: held-out quality per language"
        " (dashed: all routed experts removed)",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    save_png(fig, out / "quality.png")

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for i, m in enumerate(res.models):
        ax.bar(
            x + (i - len(names) / 2) * (0.8 / (len(names) + 1)),
            [m.quality[l].nll for l in LANGS],
            0.8 / (len(names) + 1),
            label=m.label,
        )
    ax.set_xticks(x, LANGS)
    ax.set_ylabel("mean NLL (nats / token)")
    ax.set_title("held-out NLL per language", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    save_png(fig, out / "nll_per_language.png")


# ----------------------------------------------------------------------------- shared tables


def _f(x: float | None, d: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{d}f}"


def _is_fit(res: Results, name: str) -> bool:
    """Whether model ``name`` is a cut with its routers fitted (its paired rows are the router-fit
    section's)."""
    pruned = res.model(name).pruned
    return pruned is not None and pruned.fit is not None


@dataclass(frozen=True)
class FlipLayout:
    """How a flip table at several cut points is laid out: the first column's header, its
    alignment row, its cell, and each pair's cell."""

    head: str
    align: str
    lead: Callable[[CutPoint], str]
    cell: Callable[[CutPoint, FlipCell], str]


#: the report's layout: flips (% of kept slots; promoted zh-heavy / all experts zh-heavy)
FLIPS_IN_REPORT = FlipLayout(
    "sparsity | keep",
    "|---:|---:|",
    lambda pt: f"{pt.sparsity:g} | {pt.keep}",
    lambda pt, c: (
        f"{c.flips} ({c.pct_of_kept_slots:.1f}%; {pct(c.promoted_zh_heavy, 0)}"
        f" / {pct(c.all_zh_heavy, 0)})"
    ),
)
#: the summary's layout: flips / kept slots = % (zh-heavy share of the promoted)
FLIPS_IN_SUMMARY = FlipLayout(
    "sparsity (keep)",
    "|---|",
    lambda pt: f"{pt.sparsity:.0%} ({pt.keep})",
    lambda pt, c: (
        f"{c.flips} / {pt.kept_slots} = {c.pct_of_kept_slots:.1f}%"
        f" (zh-heavy {pct(c.promoted_zh_heavy, 0)})"
    ),
)


def flip_table(cut_points: tuple[CutPoint, ...], layout: FlipLayout) -> list[str]:
    """The pairs of :data:`~.config.FLIP_PAIRS` at each cut point, one row per sparsity."""
    lines = [
        f"| {layout.head} | " + " | ".join(f"{a} -> {b}" for a, b in FLIP_PAIRS) + " |",
        layout.align + "---:|" * len(FLIP_PAIRS),
    ]
    for pt in cut_points:
        cells = [
            "n/a" if (c := pt.pairs.get(f"{a}->{b}")) is None else layout.cell(pt, c)
            for a, b in FLIP_PAIRS
        ]
        lines.append(f"| {layout.lead(pt)} | " + " | ".join(cells) + " |")
    return lines


def paired_nll_table(res: Results) -> list[str]:
    """Every paired NLL difference but the router fits' (their section shows those)."""
    lines = ["| first | second | en | zh | code |", "|---|---|---:|---:|---:|"]
    for p in res.paired:
        if _is_fit(res, p.b):
            continue
        lines.append(
            f"| {res.label(p.a)} | {res.label(p.b)} | "
            + " | ".join(f"{p.nll[l].mean:+.4f} +- {_f(p.nll[l].se, 4)}" for l in LANGS)
            + " |"
        )
    return lines


def reap_losses(res: Results) -> list[str]:
    """Every (sparsity, baseline, language) where REAP(en+zh+code) has the higher held-out NLL
    than a calibration-free or frequency baseline: the paired difference, and whether it is more
    than two standard errors."""
    rows = []
    for p in res.paired:
        base = method_base(p.a)
        if base not in BASELINES or method_base(p.b) != HEADLINE_METHOD:
            continue
        for lang in LANGS:
            d = p.nll[lang]
            if d.mean > 0:
                big = d.mean > 2 * d.se
                rows.append(
                    f"| {res.model(p.b).pruned.sparsity:.0%} | {base} | {lang} | +{d.mean:.4f} +- "
                    f"{_f(d.se, 4)} | {'yes' if big else 'no'} |"
                )
    head = [
        "",
        f"Where {HEADLINE_LABEL} loses to a baseline (held-out NLL, REAP minus the baseline, paired"
        " per window; `> 2 SE`: larger than two standard errors):",
        "",
    ]
    if not rows:
        return head[:2] + ["", f"Nowhere: {HEADLINE_LABEL} has the lower NLL in every row.", ""]
    return head + [
        "| sparsity | baseline | language | NLL difference | > 2 SE |",
        "|---|---|---|---:|---|",
        *rows,
        "",
    ]


# ----------------------------------------------------------------------------- report


def render_report(results: dict) -> str:
    """``report.md`` from ``results.json`` alone (every number in it comes from the dict), one
    renderer per section."""
    res = read_results(results)
    sections = (
        _title,
        _calibration,
        _quality,
        _router_fit,
        _degeneration,
        _flips,
        _checkpoints,
        _generations,
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
        f"{mixes}; frequency ranks by routed-token count in D;"
        " router_l1 / router_signed_sum / random use router weights only (no data; random seeded).",
        "",
    ]
    return lines


def _quality(res: Results) -> list[str]:
    """NLL, agreement and KL against the unpruned model, the paired differences, where REAP loses
    to a baseline, and the model card's NLL."""
    run, E = res.run, res.model_info.num_experts
    lines = [
        "## Quality after pruning",
        "",
        f"Held-out windows: {run.windows_per_lang} x {run.seq_len} tokens per language from the eval split"
        f" (never trained on, never calibrated on; `data.eval_windows`, seed {run.eval_seed}), mean next-token NLL"
        " in nats (perplexity in brackets). `REAP(D) mass`: fraction of REAP(en+zh+code) saliency the plan keeps"
        " (layer mean) -- one yardstick for every method. `overlap`: kept experts shared with REAP(en+zh+code)"
        " at the same sparsity. The last row zeroes every routed expert's output (shared experts kept): what"
        " losing all of them would cost, for scale.",
        "",
        "| model | experts kept | REAP(D) mass | overlap | NLL en | NLL zh | NLL code |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in res.models:
        if m.pruned is not None:
            kept, mass = f"{m.pruned.experts_after}", pct(m.pruned.reap_mass_d)
            ov = pct(m.pruned.overlap, 0)
        else:
            kept, mass, ov = (f"{E}", "100%", "-") if m.name == REFERENCE else ("0", "0%", "-")
        cells = " | ".join(f"{_f(m.quality[l].nll)} ({_f(m.quality[l].ppl, 1)})" for l in LANGS)
        lines.append(f"| {m.label} | {kept} | {mass} | {ov} | {cells} |")
    lines += [
        "",
        "Against the unpruned model on the same windows (top-1: fraction of positions where the argmax"
        " next token agrees; KL(unpruned || pruned) in nats per token):",
        "",
        "| model | top-1 en | top-1 zh | top-1 code | KL en | KL zh | KL code |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in res.models[1:]:
        lines.append(
            f"| {m.label} | "
            + " | ".join(pct(m.quality[l].top1) for l in LANGS)
            + " | "
            + " | ".join(_f(m.quality[l].kl, 4) for l in LANGS)
            + " |"
        )
    lines += [
        "",
        "![quality per language](quality.png)",
        "",
        "Paired per-window NLL differences (second minus first; mean +- standard error over windows;"
        " positive = the second is worse):",
        "",
        *paired_nll_table(res),
    ]
    return lines + reap_losses(res) + _model_card(res)


def _model_card(res: Results) -> list[str]:
    """The unpruned NLL against the bundled model card's, and the corpora against the card's."""
    card = res.model_info.card
    if card is None:
        return []
    ref = res.model(REFERENCE)
    lines = [
        "",
        "Unpruned NLL vs the model card"
        + (" (same windows)" if card.same_windows else " (different windows: not comparable)")
        + ": "
        + ", ".join(f"{l} {_f(ref.quality[l].nll, 4)} vs {_f(card.loss.get(l), 4)}" for l in LANGS)
        + ".",
    ]
    if card.corpora:
        lines += ["", "Corpora vs the model card: " + describe_corpora(card.corpora)]
    return lines


def _router_fit(res: Results) -> list[str]:
    """REAP's cut alone against the same cut with its routers fitted (``calibrate_router``):
    KL to the unpruned model and NLL per language, paired per window."""
    rows = [p for p in res.paired if _is_fit(res, p.b)]
    if not rows:
        return []
    lines = [
        "",
        "## Router calibration after the cut",
        "",
        "The same REAP cut, alone and with every kept router fitted afterwards so the pruned block's"
        " output matches the unpruned block's on calibration tokens (`calibrate_router`; experts"
        " untouched, their bytes copied from the source). Fitted on the calibration split only,"
        " judged on the held-out windows above. KL(unpruned || model) in nats per token; the paired"
        " differences are fit minus alone (negative: the fit is closer to the unpruned model / has"
        " lower NLL), mean +- standard error over windows.",
        "",
        "| cut | fit tokens | language | KL alone | KL fit | KL change | dKL +- SE | dNLL +- SE |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    met, missed = 0, []
    for p in rows:
        alone, fitted = res.model(p.a), res.model(p.b)
        for lang in LANGS:
            ka, kb = alone.quality[lang].kl, fitted.quality[lang].kl
            change = kb / ka - 1 if ka else float("nan")
            if change <= -FIT_TARGET:
                met += 1
            else:
                missed.append(f"{alone.label} {lang}")
            lines.append(
                f"| {alone.label} | {fitted.pruned.fit.tokens:,} | {lang} | {_f(ka, 4)} | {_f(kb, 4)} |"
                f" {100 * change:+.1f}% |"
                f" {p.kl[lang].mean:+.4f} +- {_f(p.kl[lang].se, 4)} |"
                f" {p.nll[lang].mean:+.4f} +- {_f(p.nll[lang].se, 4)} |"
            )
    n_layers = res.model_info.moe_layers
    lines += [
        "",
        f"Target (KL at least {FIT_TARGET:.0%} lower than the cut alone): met in {met} of"
        f" {met + len(missed)} rows"
        + (f"; not in {', '.join(missed)}." if missed else ".")
        + " Why a router-only fit stops there (a converged optimiser, and oracle routers that"
        " show the router's linear logits, not the data or the steps, are the limit):"
        " docs/router-calibration.md.",
        "",
        "Layer-local relative error of each fitted router (held-out calibration tokens of the fit,"
        " before -> after):",
        "",
        "| model | " + " | ".join(f"layer {i}" for i in range(n_layers)) + " |",
        "|---|" + "---:|" * n_layers,
    ]
    for c in res.pruned:
        if c.fit:
            cells = [f"{before:.3f} -> {after:.3f}" for before, after in c.fit.holdout]
            lines.append(f"| {c.label} | " + " | ".join(cells) + " |")
    return lines


def _degeneration(res: Results) -> list[str]:
    run = res.run
    lines = [
        "",
        "## Degeneration check (the seed's)",
        "",
        f"Greedy continuations of {run.prompts_per_lang} held-out prompt(s) per language"
        f" ({run.prompt_tokens} prompt tokens, {run.new_tokens} new tokens): the longest"
        " run of back-to-back copies of one substring (the seed: 3 in healthy output, thousands in a collapsed"
        " one): the maximum over the prompts in tokens / in characters, and the mean over prompts in tokens."
        " Read it against the unpruned row: greedy decoding of a model this small loops on its own.",
        "",
        "| model | en max tok / chr | zh max tok / chr | code max tok / chr | en mean | zh mean | code mean |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in res.models:
        lines.append(
            f"| {m.label} | "
            + " | ".join(f"{m.repeats[l].max_tokens} / {m.repeats[l].max_chars}" for l in LANGS)
            + " | "
            + " | ".join(f"{m.repeats[l].mean_tokens:.1f}" for l in LANGS)
            + " |"
        )
    return lines


def _flips(res: Results) -> list[str]:
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
            f" {_f(sup.get('median_ratio_to_layer_median'), 2)}x the layer median (median over promoted;"
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


def _generations(res: Results) -> list[str]:
    lines = ["", "## Generations", ""]
    for lang in LANGS:
        for i, p in enumerate(res.prompts[lang][:1]):
            lines += [f"**{lang}**, prompt ({p.source}): `{_md(p.text)}`", ""]
            for m in res.models:
                row = next(r for r in res.generations[m.name] if r.lang == lang and r.prompt == i)
                lines.append(f"- {m.label} (run {row.repeat_run_tokens} tok): `{_md(row.text)}`")
            lines.append("")
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
    lines = _summary_quality(res)
    if res.cut_points:
        lines += ["", *flip_table(res.cut_points, FLIPS_IN_SUMMARY)]
    lines += reap_losses(res)
    lines += [
        "Paired per-window NLL differences, second minus first (mean +- standard error):",
        "",
        *paired_nll_table(res),
    ]
    lines += _router_fit(res)
    return "\n".join(lines) + "\n"


def _summary_quality(res: Results) -> list[str]:
    """One row per model: experts, REAP mass, NLL and KL per language, top-1 and repeat runs in zh."""
    E = res.model_info.num_experts
    lines = [
        "| model | experts kept | REAP mass kept | NLL en | NLL zh | NLL code | KL en | KL zh | KL code |"
        " top-1 zh | zh repeat run, max / mean |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in res.models:
        if m.pruned is not None:
            kept, mass = m.pruned.experts_after, pct(m.pruned.reap_mass_d)
        else:
            kept, mass = (E, "100%") if m.name == REFERENCE else (0, "0%")
        ref = m.name == REFERENCE
        kl = " | ".join("-" if ref else _f(m.quality[l].kl, 4) for l in LANGS)
        t1 = "-" if ref else pct(m.quality["zh"].top1)
        zh = m.repeats["zh"]
        lines.append(
            f"| {m.label} | {kept} | {mass} | "
            + " | ".join(_f(m.quality[l].nll) for l in LANGS)
            + f" | {kl} | {t1} | {zh.max_tokens} / {zh.mean_tokens:.1f} |"
        )
    return lines


def _md(text: str) -> str:
    return text.replace("`", "'").replace("\n", " \u21b5 ").replace("|", "\\|")
