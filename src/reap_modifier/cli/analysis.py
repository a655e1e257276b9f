"""``reap tiers`` and ``reap compare``: reading scores files without a model.

Both print their tables to stdout; report files (markdown, JSON, PNG) are written
only when ``-o DIR`` is given. Options that take several values accept them
space-separated after one flag (``--keep 672 448 384 224``) or repeated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import typer
from rich.table import Table

from ..scores import SALIENCY_NAMES, ScoresError
from ..scores.errors import PlanError
from .common import console, fail, greedy, key_values

__all__ = ["register"]

#: user errors: bad files or requests, file system errors included (exit 2, one line)
_ERRORS = (ScoresError, PlanError, OSError)

TIERS_EXAMPLE = "Example: reap tiers scores.safetensors --keep 672 448 384 224 [-o tiers/]"
COMPARE_EXAMPLE = (
    "Example: reap compare scores_en.safetensors scores_en_zh.safetensors --keep 448 "
    "--corpus-of A=en B=en+zh [-o cmp/]"
)


def tiers_cmd(
    scores: Path = typer.Argument(..., help="scores file"),
    keep: list[int] | None = typer.Option(None, "--keep", help="keep counts (several)"),
    sparsity: list[float] | None = typer.Option(None, "--sparsity", help="sparsities (several)"),
    saliency: Literal[SALIENCY_NAMES] | None = typer.Option(
        None, "--saliency", help="criterion (default reap)"
    ),
    out_dir: Path | None = typer.Option(None, "-o", "--out", help="write tiers.json/.md/.png here"),
) -> None:
    """Retained saliency mass per tier, marginal cost per pruned expert, and whether
    the saliency curve has a knee."""
    from ..analysis.reports import write_tiers_report
    from ..analysis.tiers import tiers_report
    from ..scores import ExpertScores

    try:
        if not keep and not sparsity:
            raise ScoresError("give tiers with --keep N [N ...] and/or --sparsity S [S ...]")
        s = ExpertScores.load(scores)
        report = tiers_report(s, keep or [], sparsities=sparsity or [], saliency=saliency)
    except _ERRORS as exc:
        fail(exc)
    table = Table(
        title=f"retained {report['saliency']} mass ({report['num_layers']} layers x "
        f"{report['num_experts']} experts)"
    )
    for col in ("keep", "pruned", "retained (mean)", "min layer", "cost/expert since prev tier"):
        table.add_column(col, justify="right")
    between = {b["to_keep"]: b for b in report["between_tiers"]}
    for t in report["tiers"]:
        b = between.get(t["keep"])
        table.add_row(
            str(t["keep"]),
            f"{100 * t['pruned_fraction']:.1f}%",
            f"{100 * t['retained_mass_mean']:.1f}%",
            f"{100 * t['retained_mass_min']:.1f}%",
            "-"
            if b is None
            else f"{100 * b['cost_per_expert']:.4f}% ({b['cost_per_expert_vs_uniform']:.2f}x uniform)",
        )
    console.print(table)
    console.print(f"[bold]Is there a knee?[/] {report['answer']}", soft_wrap=True)
    if out_dir is not None:
        paths = write_tiers_report(report, out_dir)
        console.print("wrote " + ", ".join(str(p) for p in paths.values()))


def compare_cmd(
    files: list[Path] = typer.Argument(..., help="scores files A B [C ...], earlier first"),
    keep: int | None = typer.Option(None, "--keep", help="experts kept per layer"),
    sparsity: float | None = typer.Option(None, "--sparsity", help="or a sparsity"),
    divisible_by: int | None = typer.Option(None, "--divisible-by"),
    saliency: Literal[SALIENCY_NAMES] | None = typer.Option(
        None, "--saliency", help="criterion for calibration files (default reap)"
    ),
    corpus_of: list[str] | None = typer.Option(
        None, "--corpus-of", help="LABEL=corpus, e.g. B=en C=en+zh (label A, B, ... or file name)"
    ),
    per_source: list[str] | None = typer.Option(
        None, "--per-source", help="SOURCE=FILE scores calibrated on one source, e.g. en=SA zh=SB"
    ),
    threshold: float = typer.Option(1.5, "--ratio", help="routing-rate ratio threshold"),
    out_dir: Path | None = typer.Option(
        None, "-o", "--out", help="also write compare.md/.json and PNGs into this folder"
    ),
) -> None:
    """Compare rankings pairwise: keep/drop flips per layer and overall, retained mass,
    and promoted experts' routing ratio between corpora and support."""
    from ..analysis.compare import compare_rankings
    from ..analysis.reports import write_compare_report

    try:
        rankings, per = _load_rankings(files, corpus_of, per_source)
        result = compare_rankings(
            rankings,
            keep,
            sparsity=sparsity,
            divisible_by=divisible_by,
            saliency=saliency,
            per_source=per,
            threshold=threshold,
        )
    except _ERRORS as exc:
        fail(exc)
    console.print(_flip_table(result))
    if out_dir is not None:
        paths = write_compare_report(result, out_dir, rankings, per)
        console.print("wrote " + ", ".join(str(p) for p in paths.values()))


def _load_rankings(files: list[Path], corpus_of, per_source):
    """The rankings ``A, B, ...`` (with their ``--corpus-of`` labels) and the
    ``--per-source`` scores files."""
    from ..analysis.compare import Ranking
    from ..scores import ExpertScores

    if len(files) < 2:
        raise ScoresError("compare needs at least two scores files")
    corpora = key_values(corpus_of, "--corpus-of")
    sources = key_values(per_source, "--per-source")
    rankings = []
    for i, path in enumerate(files):
        label = chr(ord("A") + i) if i < 26 else f"R{i}"
        corpus = None
        for key in (label, path.stem, path.name, str(path)):
            corpus = corpora.pop(key, None) or corpus
        rankings.append(
            Ranking(label=label, scores=ExpertScores.load(path), path=str(path), corpus=corpus)
        )
    if corpora:
        raise ScoresError(
            f"--corpus-of names unknown rankings {sorted(corpora)}; use the labels "
            f"{[r.label for r in rankings]} or the file names"
        )
    per = {src: ExpertScores.load(Path(p)) for src, p in sources.items()} or None
    return rankings, per


def _flip_table(result: dict) -> Table:
    """The pairwise flips table ``reap compare`` prints."""
    table = Table(title=f"keep/drop flips at keep {result['keep']} ({result['num_layers']} layers)")
    for col in (
        "pair",
        "change",
        "flips",
        "% kept slots",
        "x first",
        "mass earlier/later",
        "promoted >={:g}x by b (all)".format(result["threshold"]),
    ):
        table.add_column(col, justify="left" if col in ("pair", "change") else "right")
    for p in result["pairs"]:
        m = p["mass"]
        mass = " / ".join(
            "n/a" if v is None else f"{100 * v:.1f}%" for v in (m["own_earlier"], m["own_later"])
        )
        route = (
            "; ".join(
                f"{r['b']}/{r['a']}: "
                + (
                    "n/a"
                    if r["promoted_frac_more_by_b"] is None
                    else f"{100 * r['promoted_frac_more_by_b']:.0f}%"
                )
                + f" ({100 * r['all_frac_more_by_b']:.0f}%)"
                for r in p["routing"]
            )
            or "-"
        )
        table.add_row(
            f"{p['earlier']} -> {p['later']}",
            p["change"],
            f"{p['flips']:,}",
            f"{p['pct_of_kept_slots']:.2f}%",
            "-" if p["x_first_pair"] is None else f"{p['x_first_pair']:.2f}x",
            mass,
            route,
        )
    return table


def register(app: typer.Typer) -> None:
    """Add ``tiers`` and ``compare`` to ``app``."""
    app.command("tiers", cls=greedy("--keep", "--sparsity"), epilog=TIERS_EXAMPLE)(tiers_cmd)
    app.command("compare", cls=greedy("--corpus-of", "--per-source"), epilog=COMPARE_EXAMPLE)(
        compare_cmd
    )
