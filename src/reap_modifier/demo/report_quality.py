"""The quality sections: held-out NLL, agreement and KL against the unpruned model (with the
paired differences and the model card), the router fit against the cut alone, and the summary's
one-row-per-model table."""

from __future__ import annotations

from ..analysis.formatting import pct
from .config import BASELINES, BEST_METHOD, LANGS, REFERENCE, method_base
from .provenance import describe as describe_corpora
from .records import Results
from .report_tables import fmt, is_fit_pair, is_objective_pair, paired_nll_table, reap_losses

#: the router fit's target: held-out KL this much lower than the same cut alone
FIT_TARGET = 0.4


def quality_section(res: Results) -> list[str]:
    """NLL, agreement and KL against the unpruned model, the paired differences, where REAP loses
    to a baseline, and the model card's NLL."""
    run, E = res.run, res.model_info.num_experts
    lines = [
        "## Quality after pruning",
        "",
        f"Held-out windows: {run.windows_per_lang} x {run.seq_len} tokens per language from the eval split"
        f" (never trained on, never calibrated on; {_windows(run)}), mean next-token NLL"
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
        cells = " | ".join(f"{fmt(m.quality[l].nll)} ({fmt(m.quality[l].ppl, 1)})" for l in LANGS)
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
            + " | ".join(fmt(m.quality[l].kl, 4) for l in LANGS)
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


def _windows(run) -> str:
    """Which windows of the eval split the tables measure."""
    if run.split == "dev":
        return (
            f"**the development split**: `data.dev_windows`, seed {run.eval_seed}, from the"
            " paragraphs the evaluation windows never read; for choosing methods and settings,"
            " not the final tables"
        )
    return f"`data.eval_windows`, seed {run.eval_seed}"


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
        + ", ".join(
            f"{l} {fmt(ref.quality[l].nll, 4)} vs {fmt(card.loss.get(l), 4)}" for l in LANGS
        )
        + ".",
    ]
    if card.corpora:
        lines += ["", "Corpora vs the model card: " + describe_corpora(card.corpora)]
    return lines


def router_fit_section(res: Results) -> list[str]:
    """REAP's cut alone against the same cut with the post-cut fit (router rows, dense
    compensation): KL to the unpruned model and NLL per language, paired per window."""
    rows = [p for p in res.paired if is_fit_pair(p.a, p.b)]
    if not rows:
        return []
    lines = [
        "",
        "## After the cut: router fit and compensation",
        "",
        "The same REAP cut, alone and with the post-cut fit: the kept router rows"
        " (`calibrate_router`) and, for compensation, the block's dense tensors too (`compensate`:"
        " shared expert, latent up-projection), so the pruned block's output matches the unpruned"
        " block's on calibration tokens; experts untouched, their bytes copied from the source. Each"
        " component is kept only where it lowers KL on held-out calibration batches (column"
        " `kept`; `fit tokens`: the tokens fitted, those held-out batches excluded). Fitted on the"
        " calibration split only, judged on the held-out windows above."
        " KL(unpruned || model) in nats per token; the paired differences are fit minus alone"
        " (negative: the fit is closer to the unpruned model / has lower NLL), mean +- standard error"
        " over windows.",
        "",
        "| cut | fit | kept | fit tokens | language | KL alone | KL fit | KL change | dKL +- SE |"
        " dNLL +- SE |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|",
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
                missed.append(f"{alone.label}: {_fit_name(fitted.label, alone.label)} {lang}")
            lines.append(
                f"| {alone.label} | {_fit_name(fitted.label, alone.label)} |"
                f" {fitted.pruned.fit.kept} |"
                f" {fitted.pruned.fit.fitted:,} | {lang} | {fmt(ka, 4)} | {fmt(kb, 4)} |"
                f" {100 * change:+.1f}% |"
                f" {p.kl[lang].mean:+.4f} +- {fmt(p.kl[lang].se, 4)} |"
                f" {p.nll[lang].mean:+.4f} +- {fmt(p.nll[lang].se, 4)} |"
            )
    n_layers = res.model_info.moe_layers
    held = sorted({c.fit.held_out for c in res.pruned if c.fit})
    lines += [
        "",
        f"Target (KL at least {FIT_TARGET:.0%} lower than the cut alone): met in {met} of the"
        f" {met + len(missed)} rows of this table (each fit against its own cut; the baselines"
        " against the best of ours are counted in their own section)"
        + (f"; not in {', '.join(missed)}." if missed else ".")
        + " Why a router-only fit stops short of it and what compensation adds:"
        " docs/router-calibration.md."
        + (
            f" Held-out batches per fit: {' / '.join(f'{n:,}' for n in held)} tokens."
            if any(held)
            else ""
        ),
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


def decisions_section(res: Results) -> list[str]:
    """What the post-cut step kept and why: for each fitted checkpoint, the block-error
    selection against REAP's cut and each component, judged on the fit's held-out calibration
    batches (the whole model's KL to the unpruned model, before -> after, and the paired change
    +- its standard error; kept only beyond it)."""
    fits = [c for c in res.pruned if c.fit and (c.fit.decisions or c.fit.selection)]
    if not fits:
        return []
    # the step's order: the fit that tried the most components first
    ordered = sorted(fits, key=lambda c: -len(c.fit.decisions))
    names = ["selection", *dict.fromkeys(d.name for c in ordered for d in c.fit.decisions)]
    lines = [
        "",
        "## What the post-cut step kept",
        "",
        "Each change the post-cut step tried, judged on the fit's held-out calibration batches (not"
        " the evaluation windows): the whole model's KL to the unpruned model before -> after, the"
        " paired change +- its standard error, and whether it was kept (only where the drop exceeds"
        " one standard error). `selection`: REAP's cut -> the block-error selection, both scored end"
        " to end; a dropped selection leaves REAP's cut applied. Each component is judged after the"
        " ones before it, rounded to the dtype it is saved in.",
        "",
        "| model | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    kept = total = 0
    for c in fits:
        by_name = {d.name: d for d in c.fit.decisions}
        if c.fit.selection is not None:
            by_name["selection"] = c.fit.selection
        cells = []
        for n in names:
            d = by_name.get(n)
            if d is None:
                cells.append("-")
                continue
            total += 1
            kept += d.kept
            cells.append(
                f"{fmt(d.kl_before, 4)} -> {fmt(d.kl_after, 4)}, {d.change:+.4f} +- {fmt(d.se, 4)},"
                f" {'**kept**' if d.kept else 'dropped'}"
            )
        lines.append(f"| {c.label} | " + " | ".join(cells) + " |")
    lines += ["", f"Kept: {kept} of the {total} changes tried."]
    return lines


def _untagged(label: str) -> str:
    """A label without its sparsity tag (``REAP(en) 75%`` -> ``REAP(en)``)."""
    head, _, tail = label.rpartition(" ")
    return head if head and tail.endswith("%") else label


def _fit_name(label: str, cut: str) -> str:
    """``REAP(en) + router fit 75%`` of the cut ``REAP(en) 75%`` -> ``router fit``."""
    return _untagged(label).removeprefix(_untagged(cut) + " + ")


def best_section(res: Results) -> list[str]:
    """The best of ours (:data:`BEST_METHOD`) against every baseline: KL per language, paired
    per window, and whether it wins beyond two standard errors."""
    best = _best_label(res)
    rows = [
        p
        for p in res.paired
        if _untagged(res.model(p.b).label) == best and method_base(p.a) in BASELINES
    ]
    if not rows:
        return []
    lines = [
        "",
        "## The best of ours against every baseline",
        "",
        f"{_best_label(res)} against each baseline at the same sparsity: KL(unpruned || model) per"
        " language, and the paired differences best minus baseline in KL and NLL (mean +- standard"
        " error over windows; negative: ours is closer to the unpruned model / has lower NLL).",
        "",
        "| baseline | language | KL baseline | KL ours | dKL +- SE | beyond 2 SE | dNLL +- SE |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    wins = 0
    for p in rows:
        base, best = res.model(p.a), res.model(p.b)
        for lang in LANGS:
            d = p.kl[lang]
            won = d.mean + 2 * d.se < 0
            wins += won
            lines.append(
                f"| {base.label} | {lang} | {fmt(base.quality[lang].kl, 4)} |"
                f" {fmt(best.quality[lang].kl, 4)} | {d.mean:+.4f} +- {fmt(d.se, 4)} |"
                f" {'yes' if won else 'no'} | {p.nll[lang].mean:+.4f} +- {fmt(p.nll[lang].se, 4)} |"
            )
    lines += [
        "",
        f"KL wins beyond two standard errors: {wins} of the {len(rows) * len(LANGS)} rows of this"
        " table.",
    ]
    return lines


def objective_section(res: Results) -> list[str]:
    """The block-error selection's two objectives, each followed by the same fit: the
    worst-language fit minus the pooled one, KL and NLL per language, paired per window."""
    rows = [p for p in res.paired if is_objective_pair(p.a, p.b)]
    if not rows:
        return []
    lines = [
        "",
        "## Worst-language against pooled objective",
        "",
        "The block-error selection minimising the worst language's error (`selection_groups:"
        " language`) against the same selection minimising the pooled error, each followed by the"
        " same fit: paired per window, worst language minus pooled (mean +- standard error over"
        " windows; negative: the worst-language objective is closer to the unpruned model / has"
        " lower NLL).",
        "",
        "| pooled | worst language | metric | en | zh | code |",
        "|---|---|---|---:|---:|---:|",
    ]
    for p in rows:
        for metric, diffs in (("KL", p.kl), ("NLL", p.nll)):
            cells = " | ".join(f"{diffs[l].mean:+.4f} +- {fmt(diffs[l].se, 4)}" for l in LANGS)
            lines.append(f"| {res.label(p.a)} | {res.label(p.b)} | {metric} | {cells} |")
    return lines


def _best_label(res: Results) -> str | None:
    return next((_untagged(m.label) for m in res.models if m.name == BEST_METHOD), None)


def summary_quality(res: Results) -> list[str]:
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
        kl = " | ".join("-" if ref else fmt(m.quality[l].kl, 4) for l in LANGS)
        t1 = "-" if ref else pct(m.quality["zh"].top1)
        zh = m.repeats["zh"]
        lines.append(
            f"| {m.label} | {kept} | {mass} | "
            + " | ".join(fmt(m.quality[l].nll) for l in LANGS)
            + f" | {kl} | {t1} | {zh.max_tokens} / {zh.mean_tokens:.1f} |"
        )
    return lines
