"""The tables ``report.md`` and the summary tables both show, each rendered by one function, and
the cell formatting every report section uses."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ..analysis.formatting import pct
from .config import (
    BASELINES,
    FLIP_PAIRS,
    HEADLINE_METHOD,
    LANGS,
    METHODS,
    method_base,
    objective_pairs,
)
from .records import CutPoint, FlipCell, Results

#: the label of the method every other is compared against
HEADLINE_LABEL = next(m.label for m in METHODS if m.name == HEADLINE_METHOD)


def fmt(x: float | None, d: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{d}f}"


def is_fit(res: Results, name: str) -> bool:
    """Whether model ``name`` is a cut with its routers fitted (its paired rows are the router-fit
    section's)."""
    pruned = res.model(name).pruned
    return pruned is not None and pruned.fit is not None


def is_fit_pair(a: str, b: str) -> bool:
    """Whether the paired row ``(a, b)`` is a cut against the same cut with its post-cut fit
    (``b``'s method fits ``a``'s: :attr:`~.config.Method.fit_of`)."""
    fit = next((m for m in METHODS if m.name == method_base(b)), None)
    return fit is not None and fit.fit_of == method_base(a) and _suffix(a) == _suffix(b)


def is_objective_pair(a: str, b: str) -> bool:
    """Whether the paired row ``(a, b)`` is a pooled-objective fit against the same fit with the
    worst-language objective (:func:`~.config.objective_pairs`)."""
    return (method_base(a), method_base(b)) in objective_pairs() and _suffix(a) == _suffix(b)


def _suffix(name: str) -> str:
    return name.removeprefix(method_base(name))


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
        if is_fit(res, p.b):
            continue
        lines.append(
            f"| {res.label(p.a)} | {res.label(p.b)} | "
            + " | ".join(f"{p.nll[l].mean:+.4f} +- {fmt(p.nll[l].se, 4)}" for l in LANGS)
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
                    f"{fmt(d.se, 4)} | {'yes' if big else 'no'} |"
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
