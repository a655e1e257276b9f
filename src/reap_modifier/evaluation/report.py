"""The evaluation's outputs: ``eval.json`` (the stable interface), ``eval.md`` (tables a person
reads), ``eval.png`` (NLL cost and KL per candidate and label), and the main table as text.

JSON schema (``format: reap-eval``, ``version: 1``; documented in ``docs/evaluation.md``):
``models[<model path as given>][<label>]`` holds ``nll`` (mean nats per predicted token),
``nll_se`` (standard error over windows), ``ppl``, ``top1`` (fraction in [0, 1]), ``kl`` (nats per
token, ``null`` for the reference; an estimate when the top-level ``kl_exact`` is false),
``repeat_run_max`` / ``repeat_run_mean`` (tokens),
``tokens``, ``windows``, ``nll_per_window`` and, for candidates, ``vs_reference`` (paired NLL
difference: ``mean``, ``se``, ``n``) and, with an estimated KL, ``kl_tail_mass``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from ..fileio import write_atomic

__all__ = ["kl_label", "lm_eval_table", "main_table", "render_markdown", "write_outputs"]


def _f(v, fmt: str = ".4f") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v, fmt)


def _pm(d: dict | None) -> str:
    if not d:
        return "-"
    return f"{d['mean']:+.4f} ± {_f(d['se'])}"


def kl_label(res: dict) -> str:
    """What the KL column holds: ``KL``, or ``KL (top-20 estimate, lower bound)`` when it was
    estimated from the reference's top-N log-probs (a cached reference, or vLLM)."""
    if res.get("kl_exact", True):
        return "KL"
    return f"KL (top-{res['settings']['top_n']} estimate, lower bound)"


def _kl_cell(m: dict) -> str:
    tail = m.get("kl_tail_mass")
    return _f(m["kl"]) + ("" if tail is None or m["kl"] is None else f" (tail {100 * tail:.0f}%)")


def table_rows(res: dict) -> list[list[str]]:
    """Rows of the main table: model, label, NLL ± se, PPL, ΔNLL vs reference ± se, top-1, KL,
    max / mean repeat run."""
    rows = []
    for name, by_label in res["models"].items():
        for label, m in by_label.items():
            rows.append(
                [
                    name + (" (reference)" if name == res["reference"] else ""),
                    label,
                    f"{m['nll']:.4f} ± {_f(m['nll_se'])}",
                    _f(m["ppl"], ".3f"),
                    _pm(m.get("vs_reference")),
                    "-" if m["top1"] is None else f"{100 * m['top1']:.2f}%",
                    _kl_cell(m),
                    f"{_f(m['repeat_run_max'], 'd')} / {_f(m['repeat_run_mean'], '.1f')}",
                ]
            )
    return rows


def header(res: dict) -> list[str]:
    """The main table's column titles."""
    return [
        "model",
        "text",
        "NLL ± se",
        "PPL",
        "ΔNLL vs ref ± se",
        "top-1",
        kl_label(res),
        "repeat max / mean",
    ]


def main_table(res: dict) -> str:
    """The main table as a markdown table (also what stdout shows). An estimated KL is
    labelled so in its column title and each cell gives the reference's probability mass
    outside the compared tokens (``tail``)."""
    head = header(res)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(res)]
    return "\n".join(lines)


def lm_eval_table(res: dict) -> str:
    """lm-evaluation-harness results as a markdown table: model, task, metric, value ± stderr."""
    out = ["| model | task | metric | value ± stderr |", "|---|---|---|---|"]
    for name, tasks in res["lm_eval"]["results"].items():
        for task, metrics in (tasks or {}).items():
            for metric, v in metrics.items():
                out.append(f"| {name} | {task} | {metric} | {_f(v['value'])} ± {_f(v['stderr'])} |")
    return "\n".join(out)


def render_markdown(res: dict) -> str:
    s = res["settings"]
    out = [
        "# reap eval",
        "",
        f"Reference `{res['reference']}`, {len(res['candidates'])} candidate(s); backend "
        f"**{res['backend']}**, dtype {res['dtype']}; {s['windows']} windows x {s['window_tokens']} "
        f"tokens per text (seed {s['seed']}); KL: {res['kl_method']}"
        + ("; reference from the cache" if res.get("reference_from_cache") else "")
        + ".",
        "",
        main_table(res),
        "",
        "NLL: mean next-token negative log-likelihood (nats); ΔNLL: the candidate's minus the "
        "reference's, paired per window (± standard error over windows); top-1: share of "
        "positions where the candidate's most likely next token is the reference's; KL: "
        "KL(reference || candidate) per token; repeat: longest run of back-to-back copies of one "
        "substring in greedy continuations (tokens).",
    ]
    if res.get("paired"):
        labels = list(res["texts"])
        out += ["", "## Candidates against each other (ΔNLL = b - a, paired per window)", ""]
        out.append("| a | b | " + " | ".join(labels) + " |")
        out.append("|---|---|" + "---|" * len(labels))
        for p in res["paired"]:
            out.append(f"| {p['a']} | {p['b']} | " + " | ".join(_pm(p[lb]) for lb in labels) + " |")
    if any(m.get("kl_tail_mass") is not None for by in res["models"].values() for m in by.values()):
        out += [
            "",
            "KL was estimated from top-N log-probs: the estimate is a lower bound; tail (and "
            "`kl_tail_mass` in eval.json) is the reference's probability mass the estimate could "
            "not compare.",
        ]
    if res.get("throughput"):
        out += [
            "",
            "## Throughput (vLLM)",
            "",
            "| model | prompt tok/s | generated tok/s | server start s |",
            "|---|---|---|---|",
        ]
        for name, t in res["throughput"].items():
            out.append(
                f"| {name} | {_f(t.get('prompt_tokens_per_s'), '.1f')} | "
                f"{_f(t.get('generated_tokens_per_s'), '.1f')} | {_f(t.get('server_start_s'), '.1f')} |"
            )
    if res.get("lm_eval"):
        out += ["", "## lm-evaluation-harness", "", lm_eval_table(res)]
    gens = res.get("generations") or {}
    if any(gens.values()):
        out += ["", "## Greedy continuations (first prompt per text)", ""]
        for name, by_label in gens.items():
            for label, rows in by_label.items():
                if rows:
                    text = rows[0]["text"].replace("\n", "⏎")[:200]
                    out.append(f"- `{name}` / {label} (run {rows[0]['repeat_run_tokens']}): {text}")
    for warning in res.get("warnings") or []:
        out.append(f"\nWarning: {warning}")
    for note in res.get("notes") or []:
        out.append(f"\nNote: {note}")
    return "\n".join(out) + "\n"


def _se0(v) -> float:
    return v if isinstance(v, float) and math.isfinite(v) else 0.0


def plot(res: dict, path: Path) -> Path:
    """ΔNLL vs the reference (± se) and KL per candidate, one group of bars per text label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from ..reporting import save_png

    labels = list(res["texts"])
    cands = res["candidates"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(cands))
    x = np.arange(len(labels))
    for k, c in enumerate(cands):
        d = [res["models"][c][lb]["vs_reference"] for lb in labels]
        axes[0].bar(
            x + k * width,
            [v["mean"] for v in d],
            width,
            yerr=[_se0(v["se"]) for v in d],
            label=Path(c).name or c,
        )
        axes[1].bar(
            x + k * width,
            [res["models"][c][lb]["kl"] or 0.0 for lb in labels],
            width,
            label=Path(c).name or c,
        )
    kl_title = "KL(reference || candidate) (nats/token)"
    if not res.get("kl_exact", True):
        kl_title = kl_label(res).replace("KL", kl_title, 1)
    for ax, title in zip(axes, ("ΔNLL vs reference (nats/token, ± se)", kl_title)):
        ax.set_xticks(x + width * (len(cands) - 1) / 2, labels)
        ax.set_title(title, fontsize=10)
        ax.axhline(0, color="k", lw=0.5)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return save_png(fig, path)


def write_outputs(res: dict, out_dir: str | os.PathLike) -> dict[str, Path]:
    """``eval.json``, ``eval.md`` and ``eval.png`` under ``out_dir`` (each written atomically)."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    paths = {"json": d / "eval.json", "md": d / "eval.md", "png": d / "eval.png"}
    from ..reporting import jsonable

    text = json.dumps(jsonable(res), indent=1, ensure_ascii=False, allow_nan=False)
    write_atomic(paths["json"], text + "\n")
    write_atomic(paths["md"], render_markdown(res))
    plot(res, paths["png"])
    return paths
