"""The main job's report: ``report.md`` and the summary tables rendered from
``results.json`` alone, and the PNG plots."""

from __future__ import annotations

import math
from pathlib import Path

from ..analysis.formatting import pct, tokens
from ..reporting import save_png
from .config import ABLATION, LANGS, REFERENCE
from .provenance import describe as describe_corpora

# ----------------------------------------------------------------------------- plots


def _model_order(results: dict) -> list[str]:
    return (
        [REFERENCE]
        + list(results["pruning"])
        + [n for n in (ABLATION,) if n in results["eval"]["quality"]]
    )


def _label(results: dict, name: str) -> str:
    if name == REFERENCE:
        return "unpruned"
    if name == ABLATION:
        return "no routed experts (reference)"
    return results["pruning"][name]["label"]


def write_plots(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    q = results["eval"]["quality"]
    names = list(results["pruning"])
    x = np.arange(len(LANGS))
    width = 0.8 / max(1, len(names))
    fig, axes = plt.subplots(1, 3, figsize=(15, 5.2))
    panels = [
        ("NLL increase over unpruned (nats)", lambda n, l: q[n][l]["nll"] - q[REFERENCE][l]["nll"]),
        ("KL(unpruned || pruned) (nats / token)", lambda n, l: q[n][l]["kl"]),
        ("top-1 agreement with unpruned", lambda n, l: q[n][l]["top1_agreement"]),
    ]
    for ax, (title, fn) in zip(axes, panels):
        for i, n in enumerate(names):
            ax.bar(
                x + (i - (len(names) - 1) / 2) * width,
                [fn(n, l) for l in LANGS],
                width,
                label=_label(results, n),
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
                    label=_label(results, ABLATION) if j == 0 else None,
                )
        ax.set_xticks(x, LANGS)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    lo = min(
        q[n][l]["top1_agreement"] for n in names + [n for n in (ABLATION,) if n in q] for l in LANGS
    )
    axes[2].set_ylim(max(0.0, lo - 0.05), 1.0)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(
        handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=8, frameon=False
    )
    fig.suptitle(
        f"Expert pruning of {Path(results['model']['path']).name}: held-out quality per language"
        " (dashed: all routed experts removed)",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    save_png(fig, out / "quality.png")

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for i, n in enumerate(_model_order(results)):
        ax.bar(
            x + (i - len(names) / 2) * (0.8 / (len(names) + 1)),
            [q[n][l]["nll"] for l in LANGS],
            0.8 / (len(names) + 1),
            label=_label(results, n),
        )
    ax.set_xticks(x, LANGS)
    ax.set_ylabel("mean NLL (nats / token)")
    ax.set_title("held-out NLL per language", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    save_png(fig, out / "nll_per_language.png")


# ----------------------------------------------------------------------------- report


def _f(x: float | None, d: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{d}f}"


def pair_routing(pair: dict, a: str, b: str) -> dict | None:
    return next((r for r in pair["routing"] if r["a"] == a and r["b"] == b), None)


#: pairs of the flip table, in order: the noise floor, +zh, +code, +zh+code
FLIP_PAIRS = (("A", "B"), ("B", "C"), ("C", "D"), ("B", "D"))


def flip_rows(cmp: dict) -> list[dict]:
    by = {(p["earlier"], p["later"]): p for p in cmp["pairs"]}
    return [by[k] for k in FLIP_PAIRS if k in by]


def render_report(results: dict) -> str:
    """``report.md`` from ``results.json`` alone (every number in it comes from the dict), one
    renderer per section."""
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
    return "\n".join(line for section in sections for line in section(results))


def _title(results: dict) -> list[str]:
    cfg, pr, mdl = results["config"], results["pruning"], results["model"]
    E, k = mdl["num_experts"], next(iter(pr.values()))["num_experts_after"]
    L = len(mdl["moe_layers"])
    extra = sorted({r["sparsity"] for r in pr.values()} - {cfg["sparsity"]})
    fits = [r for r in pr.values() if r.get("router_fit")]
    fmts = next(iter(pr.values()))["verify"].get("quantization_format") or []
    lines = [
        "# REAP expert pruning: does the calibration language matter, and what does it cost?",
        "",
        f"Model `{mdl['path']}` ({mdl['model_class']}, {L} MoE layers x {E} routed experts, top-{mdl['top_k']}"
        f"{', checkpoint format ' + ', '.join(fmts) if fmts else ''}); every MoE layer pruned to {k} of {E} experts (sparsity {cfg['sparsity']:g})"
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
        + f".{' **Quick mode: tiny sizes, the numbers mean nothing.**' if cfg['quick'] else ''}",
        "",
        f"Produced by `{results.get('command') or 'reap_modifier.demo.run'}` on {results['created']} in"
        f" {results['timing']['total']:.0f} s ({cfg['threads']} CPU thread{'s' if cfg['threads'] > 1 else ''});"
        " every number below is in `results.json`.",
        "",
    ]
    return lines


def _calibration(results: dict) -> list[str]:
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
    for r in results["calibration"]["runs"]:
        src = ", ".join(
            f"{s} {tokens(n)}" for s, n in sorted(r["source_tokens"].items(), key=lambda kv: -kv[1])
        )
        lines.append(
            f"| {r['part']} | {r['source']} | {r['tokens']:,} | {r['rows']} | {src} | {r['seconds']:.1f} |"
        )
    pc = results["calibration"].get("packed_check")
    if pc:
        lines += [
            "",
            f"Every run kept the MXFP4 experts packed and dequantized one MoE layer at a time"
            f" (`dequantize: layer`). Check: part {pc['part']} calibrated again on the fully"
            f" decompressed model gives the same statistics to {pc['max_rel']:.1e} relative"
            f" ({pc['statistics']:,} values; tolerance {pc['tolerance']:g}).",
        ]
    lines += ["", "| ranking | = | tokens |", "|---|---|---|"]
    for label, r in results["calibration"]["rankings"].items():
        lines.append(
            f"| {label} | {' + '.join(r['parts'])} | "
            + ", ".join(f"{s} {tokens(n)}" for s, n in r["tokens"].items())
            + " |"
        )
    lines += [
        "",
        "REAP(en) = B, REAP(en+zh) = C, REAP(en+zh+code) = D; frequency ranks by routed-token count in D;"
        " router_l1 / router_signed_sum / random use router weights only (no data; random seeded).",
        "",
    ]
    return lines


def _quality(results: dict) -> list[str]:
    """NLL, agreement and KL against the unpruned model, and the paired differences. (Long
    because it is one report section, table after table.)"""
    q, pr, mdl, ev = (
        results["eval"]["quality"],
        results["pruning"],
        results["model"],
        results["eval"],
    )
    E = mdl["num_experts"]
    lines = [
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
            mass, ov = (
                pct(pr[name]["retained_reap_mass_D"]),
                pct(pr[name]["overlap_with_reap_en_zh_code"], 0),
            )
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
        lines.append(
            f"| {_label(results, name)} | "
            + " | ".join(pct(q[name][l]["top1_agreement"]) for l in LANGS)
            + " | "
            + " | ".join(_f(q[name][l]["kl"], 4) for l in LANGS)
            + " |"
        )
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
        if p["b"].endswith("_fit") or "_fit_" in p["b"]:
            continue  # the router-fit section shows these
        lines.append(
            f"| {_label(results, p['a'])} | {_label(results, p['b'])} | "
            + " | ".join(f"{p[l]['mean']:+.4f} +- {_f(p[l]['se'], 4)}" for l in LANGS)
            + " |"
        )
    lines += reap_losses(results)
    card = mdl.get("model_card")
    if card and card.get("loss"):
        same = card.get("same_windows")
        lines += [
            "",
            "Unpruned NLL vs the model card"
            + (" (same windows)" if same else " (different windows: not comparable)")
            + ": "
            + ", ".join(
                f"{l} {_f(q[REFERENCE][l]['nll'], 4)} vs {_f(card['loss'].get(l), 4)}"
                for l in LANGS
            )
            + ".",
        ]
        if card.get("corpora"):
            lines += ["", "Corpora vs the model card: " + describe_corpora(card["corpora"])]
    return lines


BASELINES = ("frequency", "router_l1", "router_signed_sum", "random")
#: the router fit's target: held-out KL this much lower than the same cut alone
FIT_TARGET = 0.2


def reap_losses(results: dict) -> list[str]:
    """Every (sparsity, baseline, language) where REAP(en+zh+code) has the higher held-out NLL
    than a calibration-free or frequency baseline: the paired difference, and whether it is more
    than two standard errors."""
    pr = results["pruning"]
    rows = []
    for p in results["paired"]:
        base = p["a"].rsplit("_", 1)[0] if p["a"].rsplit("_", 1)[-1].isdigit() else p["a"]
        if base not in BASELINES or not p["b"].startswith("reap_en_zh_code"):
            continue
        for lang in LANGS:
            d = p[lang]
            if d["mean"] > 0:
                big = d["mean"] > 2 * d["se"]
                rows.append(
                    f"| {pr[p['b']]['sparsity']:.0%} | {base} | {lang} | +{d['mean']:.4f} +- "
                    f"{_f(d['se'], 4)} | {'yes' if big else 'no'} |"
                )
    head = [
        "",
        "Where REAP(en+zh+code) loses to a baseline (held-out NLL, REAP minus the baseline, paired"
        " per window; `> 2 SE`: larger than two standard errors):",
        "",
    ]
    if not rows:
        return head[:2] + ["", "Nowhere: REAP(en+zh+code) has the lower NLL in every row.", ""]
    return head + [
        "| sparsity | baseline | language | NLL difference | > 2 SE |",
        "|---|---|---|---:|---|",
        *rows,
        "",
    ]


def _router_fit(results: dict) -> list[str]:
    """REAP's cut alone against the same cut with its routers fitted (``calibrate_router``):
    KL to the unpruned model and NLL per language, paired per window."""
    pr, q = results["pruning"], results["eval"]["quality"]
    rows = [p for p in results["paired"] if p["b"] in pr and pr[p["b"]].get("router_fit")]
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
        a, b, fit = p["a"], p["b"], pr[p["b"]]["router_fit"]
        for lang in LANGS:
            ka, kb = q[a][lang]["kl"], q[b][lang]["kl"]
            change = kb / ka - 1 if ka else float("nan")
            if change <= -FIT_TARGET:
                met += 1
            else:
                missed.append(f"{_label(results, a)} {lang}")
            lines.append(
                f"| {_label(results, a)} | {fit['tokens']:,} | {lang} | {_f(ka, 4)} | {_f(kb, 4)} |"
                f" {100 * change:+.1f}% |"
                f" {p['kl'][lang]['mean']:+.4f} +- {_f(p['kl'][lang]['se'], 4)} |"
                f" {p[lang]['mean']:+.4f} +- {_f(p[lang]['se'], 4)} |"
            )
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
        "| model | "
        + " | ".join(f"layer {i}" for i in range(len(results["model"]["moe_layers"])))
        + " |",
        "|---|" + "---:|" * len(results["model"]["moe_layers"]),
    ]
    for r in pr.values():
        fit = r.get("router_fit")
        if not fit:
            continue
        cells = [
            f"{v['holdout_before']:.3f} -> {v['holdout_after']:.3f}" for v in fit["layers"].values()
        ]
        lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    return lines


def _degeneration(results: dict) -> list[str]:
    cfg, gs = results["config"], results["generations"]["summary"]
    lines = [
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
        lines.append(
            f"| {_label(results, name)} | "
            + " | ".join(
                f"{gs[name][l]['max_repeat_run_tokens']} / {gs[name][l]['max_repeat_run_chars']}"
                for l in LANGS
            )
            + " | "
            + " | ".join(f"{gs[name][l]['mean_repeat_run_tokens']:.1f}" for l in LANGS)
            + " |"
        )
    return lines


def _flips(results: dict) -> list[str]:
    """The seed's flip table, retained masses, the other cut points and the tiers. (Long
    because it is one report section, table after table.)"""
    cmp = results["compare"]
    lines = [
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
    for p in flip_rows(cmp):
        added = ", ".join(f"+{tokens(n)} {s}" for s, n in p["tokens_added"].items()) or "-"
        xf = "n/a" if p["x_first_pair"] is None else f"{p['x_first_pair']:.2f}x"
        zh, code = pair_routing(p, "en", "zh"), pair_routing(p, "en", "code")
        zc = (
            f"{pct(zh['promoted_frac_more_by_b'], 0)} ({pct(zh['all_frac_more_by_b'], 0)})"
            if zh
            else "n/a"
        )
        cc = (
            f"{pct(code['promoted_frac_more_by_b'], 0)} ({pct(code['all_frac_more_by_b'], 0)})"
            if code
            else "n/a"
        )
        lines.append(
            f"| {p['earlier']} -> {p['later']} | {p['change']} | {added} | {p['flips']} |"
            f" {p['pct_of_kept_slots']:.2f}% | {xf} | {zc} | {cc} |"
        )
    lines += [
        "",
        "Retained REAP saliency mass of each ranking under its own plan (the seed: 62.6% under B,"
        " 62.5% under C):",
        "",
        "| ranking | corpus | retained mass |",
        "|---|---|---:|",
    ]
    for r in cmp["rankings"]:
        lines.append(f"| {r['label']} | {r['corpus']} | {pct(r['retained_mass'], 2)} |")
    bc = next((p for p in cmp["pairs"] if p["earlier"] == "B" and p["later"] == "C"), None)
    if bc is not None:
        sup = bc["support"].get("rate@en", {}).get("promoted", {})
        lines += [
            "",
            f"B -> C: B's saliency keeps {pct(bc['mass']['earlier_saliency_under_later_plan'], 2)} of its"
            f" mass under C's plan (vs {pct(bc['mass']['own_earlier'], 2)} under its own); promoted experts'"
            " English routing rate is"
            f" {_f(sup.get('median_ratio_to_layer_median'), 2)}x the layer median (median over promoted;"
            f" {pct(sup.get('frac_below_layer_median'), 0)} below the median,"
            f" {pct(sup.get('frac_never_routed'), 0)} never routed by the English calibration text).",
        ]
    fbs = results.get("flips_by_sparsity") or {}
    if fbs:
        lines += [
            "",
            "The same pairs at other cut points (flips, % of kept slots, promoted zh-heavy / all experts):",
            "",
            "| sparsity | keep | " + " | ".join(f"{a} -> {b}" for a, b in FLIP_PAIRS) + " |",
            "|---:|---:|" + "---:|" * len(FLIP_PAIRS),
        ]
        for sp, f in fbs.items():
            cells = []
            for a, b in FLIP_PAIRS:
                r = f["pairs"].get(f"{a}->{b}")
                cells.append(
                    "n/a"
                    if r is None
                    else f"{r['flips']} ({r['pct_of_kept_slots']:.1f}%; {pct(r['promoted_zh_heavy'], 0)}"
                    f" / {pct(r['all_zh_heavy'], 0)})"
                )
            lines.append(f"| {float(sp):g} | {f['keep']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "![flips per layer](compare/flips_per_layer.png)",
        "",
        "Full comparison (all pairs, per-layer flips, support): `compare/compare.md`; mass per tier:"
        " `tiers/`.",
        "",
    ]
    tiers = results["tiers"]["rows"] or []
    if tiers:
        lines += [
            "Retained REAP(en+zh+code) mass by tier:",
            "",
            "| keep | pruned | retained mass |",
            "|---:|---:|---:|",
        ]
        for t in tiers:
            lines.append(
                f"| {t['keep']} | {pct(t['pruned_fraction'], 1)} | {pct(t['retained_mass_mean'], 1)} |"
            )
        lines.append("")
    return lines


def _checkpoints(results: dict) -> list[str]:
    pr, mdl = results["pruning"], results["model"]
    lines = [
        "## Checkpoints",
        "",
        "Every pruned checkpoint was written by `rewrite_checkpoint` (kept experts' packed MXFP4 bytes copied"
        " verbatim from the source; the router-fit ones by `oneshot` through the same rewriter, with the"
        " fitted router tensors written from memory) and passed `verify_checkpoint(dst, source=src)`"
        " (which names every tensor that differs from its source and why):",
        "",
    ]
    if mdl.get("left_out_of_checkpoint_source"):
        lines += [
            f"(The rewriter read the source through `{mdl['checkpoint_source']}`, a byte-identical copy of every file of"
            f" the model folder except {', '.join(f'`{f}`' for f in mdl['left_out_of_checkpoint_source'])},"
            " which is not a weight shard and which the rewriter refuses.)",
            "",
        ]
    lines += [
        "| method | plan | checkpoint | experts | tensors sha256-equal to source | MB | verify | seconds |",
        "|---|---|---|---:|---:|---:|---|---:|",
    ]
    for r in pr.values():
        v = r["verify"]
        lines.append(
            f"| {r['label']} | `{r['plan']}` | `{r['checkpoint']}` | {r['num_experts_before']} -> "
            f"{r['num_experts_after']} | {v.get('tensors_matching_source')} / {v.get('tensors')} |"
            f" {r['bytes'] / 1e6:.2f} | {'OK' if v['ok'] else 'FAILED'} | {r['seconds']:.1f} |"
        )
    return lines


def _generations(results: dict) -> list[str]:
    lines = ["", "## Generations", ""]
    prompts = results["generations"]["prompts"]
    for lang in LANGS:
        for i, p in enumerate(prompts[lang][:1]):
            lines += [f"**{lang}**, prompt ({p['source']}): `{_md(p['text'])}`", ""]
            for name in _model_order(results):
                row = next(
                    r
                    for r in results["generations"]["by_model"][name]
                    if r["lang"] == lang and r["prompt"] == i
                )
                lines.append(
                    f"- {_label(results, name)} (run {row['repeat_run_tokens']} tok):"
                    f" `{_md(row['text'])}`"
                )
            lines.append("")
    return lines


def _timing_and_limits(results: dict) -> list[str]:
    t = results["timing"]
    lines = [
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
        "Versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()),
        "",
    ]
    return lines


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
            kept, mass = pr[name]["num_experts_after"], pct(pr[name]["retained_reap_mass_D"])
        kl = " | ".join("-" if name == REFERENCE else _f(q[name][l]["kl"], 4) for l in LANGS)
        t1 = "-" if name == REFERENCE else pct(q[name]["zh"]["top1_agreement"])
        lines.append(
            f"| {_label(results, name)} | {kept} | {mass} | "
            + " | ".join(_f(q[name][l]["nll"]) for l in LANGS)
            + f" | {kl} | {t1} |"
            f" {gs[name]['zh']['max_repeat_run_tokens']} / {gs[name]['zh']['mean_repeat_run_tokens']:.1f} |"
        )
    fbs = results.get("flips_by_sparsity") or {}
    if fbs:
        lines += [
            "",
            "| sparsity (keep) | " + " | ".join(f"{a} -> {b}" for a, b in FLIP_PAIRS) + " |",
            "|---|" + "---:|" * len(FLIP_PAIRS),
        ]
        for sp, f in fbs.items():
            cells = []
            for a, b in FLIP_PAIRS:
                r = f["pairs"].get(f"{a}->{b}")
                cells.append(
                    "n/a"
                    if r is None
                    else f"{r['flips']} / {f['kept_slots']} = {r['pct_of_kept_slots']:.1f}%"
                    f" (zh-heavy {pct(r['promoted_zh_heavy'], 0)})"
                )
            lines.append(f"| {float(sp):.0%} ({f['keep']}) | " + " | ".join(cells) + " |")
    lines += reap_losses(results)
    lines += [
        "Paired per-window NLL differences, second minus first (mean +- standard error):",
        "",
        "| first | second | en | zh | code |",
        "|---|---|---:|---:|---:|",
    ]
    for p in results["paired"]:
        if p["b"] in pr and pr[p["b"]].get("router_fit"):
            continue
        lines.append(
            f"| {_label(results, p['a'])} | {_label(results, p['b'])} | "
            + " | ".join(f"{p[l]['mean']:+.4f} +- {_f(p[l]['se'], 4)}" for l in LANGS)
            + " |"
        )
    lines += _router_fit(results)
    return "\n".join(lines) + "\n"


def _md(text: str) -> str:
    return text.replace("`", "'").replace("\n", " \u21b5 ").replace("|", "\\|")
