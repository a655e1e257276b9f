"""``reap`` subcommands for scores files: merge, show, from-weights, cut, tiers, compare.

Options that take several values accept them space-separated after one flag
(``--keep 672 448 384 224``, ``--corpus-of B=en C=en+zh``) or repeated
(``--keep 672 --keep 448``). Put positional arguments (files) before such options.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperCommand

from .plan import PlanError
from .scores import ExpertScores, ScoresError

__all__ = ["register"]

console = Console()
if not console.is_terminal:  # pipes, CI logs, CliRunner: do not squeeze tables to 80 columns
    console.width = max(console.width, 160)
err_console = Console(stderr=True)

#: options that consume every following value up to the next ``-``-prefixed token
_GREEDY = ("--keep", "--sparsity", "--corpus-of", "--per-source")


class _GreedyCommand(TyperCommand):
    """Expands ``--opt v1 v2 v3`` into ``--opt v1 --opt v2 --opt v3`` for the options of
    this command that take several values (typer/click options take one per flag)."""

    greedy: tuple[str, ...] = ()

    def parse_args(self, ctx, args):
        out: list[str] = []
        i = 0
        while i < len(args):
            tok = args[i]
            out.append(tok)
            i += 1
            if tok in self.greedy:
                first = True
                while i < len(args) and (first or not args[i].startswith("-")):
                    if not first:
                        out.append(tok)
                    out.append(args[i])
                    i += 1
                    first = False
        return super().parse_args(ctx, out)


def _greedy(*names: str) -> type[_GreedyCommand]:
    return type("GreedyCommand", (_GreedyCommand,), {"greedy": names})


def _fail(exc: Exception) -> None:
    err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=1)


def _load(path: Path) -> ExpertScores:
    return ExpertScores.load(path)


_ERRORS = (ScoresError, PlanError)


def _fmt_int(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


# -- reap scores ... ----------------------------------------------------------------

scores_app = typer.Typer(
    help="Scores files: merge per-corpus files, inspect one, or make a baseline from weights.",
    no_args_is_help=True,
)


@scores_app.command("merge")
def merge_cmd(
    inputs: list[Path] = typer.Argument(..., help="two or more scores files from the same model"),
    output: Path = typer.Option(..., "-o", "--output", help="merged scores file to write"),
) -> None:
    """Add calibration statistics: sums and counts add, per-source counts and token
    counts add, max_norm takes the max. scores(en+zh) == merge(scores(en), scores(zh))."""
    try:
        if len(inputs) < 2:
            raise ScoresError("merge needs at least two scores files")
        merged = _load(inputs[0])
        for path in inputs[1:]:
            other = _load(path)
            try:
                merged = merged.merge(other)
            except ScoresError as exc:
                raise ScoresError(f"{path} vs {inputs[0]}: {exc}") from exc
        merged.metadata["merged_from"] = [str(p) for p in inputs]
        merged.validate().save(output)
    except _ERRORS as exc:
        _fail(exc)
    toks = ", ".join(f"{s}={n:,}" for s, n in merged.source_tokens().items())
    console.print(
        f"wrote {output}: {len(merged.layers)} layers x {merged.num_experts} experts, "
        f"tokens {toks or 'n/a'}"
    )


@scores_app.command("show")
def show_cmd(
    path: Path = typer.Argument(..., help="scores file"),
) -> None:
    """Metadata, total tokens and per-layer support (routed tokens per expert)."""
    try:
        s = _load(path)
    except _ERRORS as exc:
        _fail(exc)
    import torch

    meta = Table(title=escape(str(path)), show_header=False)
    meta.add_column("key", style="bold")
    meta.add_column("value")
    meta.add_row("kind", s.kind + (f" ({s.method})" if s.method else ""))
    for key in ("model_class", "num_experts", "top_k", "n_group", "topk_group",
                "num_moe_layers", "runs", "seed", "source_checkpoint"):
        if s.metadata.get(key) is not None:
            meta.add_row(key, str(s.metadata[key]))
    meta.add_row("layers in file", str(len(s.layers)))
    if s.kind == "calibration":
        for src, n in s.source_tokens().items():
            meta.add_row(escape(f"tokens[{src}]"), f"{n:,}")
        meta.add_row("total tokens", f"{s.total_tokens():,}")
    for key, value in s.metadata.items():
        if key in ("tokens", "kind", "method") or key in {
            "model_class", "num_experts", "top_k", "n_group", "topk_group",
            "num_moe_layers", "runs", "seed", "source_checkpoint",
        }:
            continue
        text = str(value)
        meta.add_row(escape(key), escape(text if len(text) < 120 else text[:117] + "..."))
    console.print(meta)

    if s.kind != "calibration":
        table = Table(title=f"{s.method} saliency per layer")
        table.add_column("layer", no_wrap=True)
        for col in ("min", "median", "max"):
            table.add_column(col, justify="right")
        for layer, stats in s.layers.items():
            v = stats[s.method]
            table.add_row(layer, f"{float(v.min()):.4g}", f"{float(torch.quantile(v, 0.5)):.4g}",
                          f"{float(v.max()):.4g}")
        console.print(table)
        return

    sources = s.sources
    support = s.support()
    table = Table(
        title="support: routed tokens per expert",
        caption="last row: median of the layer medians, min, max, never-routed total",
    )
    table.add_column("layer", no_wrap=True)
    for col in ("median", "min", "max", "never routed"):
        table.add_column(col, justify="right")
    for src in sources:
        table.add_column(f"median @{src}", justify="right")
    for layer, sup in support.items():
        row = [layer, _fmt_int(sup["median"]), _fmt_int(sup["min"]), _fmt_int(sup["max"]),
               str(sup["never_routed"])]
        for src in sources:
            c = s.layers[layer].get(f"count@{src}")
            row.append("-" if c is None else _fmt_int(float(torch.quantile(c, 0.5))))
        table.add_row(*row)
    meds = [v["median"] for v in support.values()]
    never = sum(v["never_routed"] for v in support.values())
    table.add_section()
    table.add_row(
        f"all {len(support)} layers",
        _fmt_int(float(torch.quantile(torch.tensor(meds, dtype=torch.float64), 0.5))),
        _fmt_int(min(v["min"] for v in support.values())),
        _fmt_int(max(v["max"] for v in support.values())),
        f"{never} of {len(support) * s.num_experts}",
        *["" for _ in sources],
    )
    console.print(table)


@scores_app.command("from-weights")
def from_weights_cmd(
    checkpoint: Path = typer.Argument(..., help="safetensors checkpoint folder (or one file)"),
    method: str = typer.Option(..., "--method", help="router_l1 | router_signed_sum | random"),
    seed: int = typer.Option(0, "--seed", help="seed of the random baseline"),
    output: Path = typer.Option(..., "-o", "--output", help="scores file to write"),
) -> None:
    """A calibration-free baseline scores file computed from router weights alone
    (reads only the router tensors; the model is never loaded)."""
    from .baselines import scores_from_weights

    try:
        s = scores_from_weights(checkpoint, method, seed=seed)
        s.save(output)
    except _ERRORS as exc:
        _fail(exc)
    console.print(
        f"wrote {output}: {method} for {len(s.layers)} MoE layers x {s.num_experts} experts "
        f"({s.metadata.get('model_class') or 'unknown class'}, top_k={s.metadata.get('top_k')})"
    )


# -- reap cut / tiers / compare -------------------------------------------------------------


def cut_cmd(
    scores: Path = typer.Argument(..., help="scores file"),
    keep: Optional[int] = typer.Option(None, "--keep", help="experts to keep per layer"),
    sparsity: Optional[float] = typer.Option(None, "--sparsity", help="fraction of experts to drop"),
    divisible_by: Optional[int] = typer.Option(None, "--divisible-by", help="kept count multiple"),
    saliency: Optional[str] = typer.Option(
        None, "--saliency",
        help="reap | frequency | weighted_frequency | ean | ean_mean | max_norm "
             "(calibration files; default reap) or the method of a baseline file",
    ),
    output: Path = typer.Option(..., "-o", "--output", help="plan.json to write"),
) -> None:
    """Cut a scores file into a pruning plan (any tier, no recalibration), with the same
    keep-count rule as the modifier. The plan is what `reap prune --plan` and the
    modifier's `plan_in:` accept."""
    from .fileio import sha256_file
    from .plan import plan_from_scores

    t0 = time.perf_counter()
    try:
        s = _load(scores)
        plan = plan_from_scores(
            s, sparsity=sparsity, num_experts_to_keep=keep, divisible_by=divisible_by,
            saliency=saliency,
            params={"scores": {"path": str(scores), "sha256": sha256_file(scores)}},
        )
        plan.save(output)
    except _ERRORS as exc:
        _fail(exc)
    dt = time.perf_counter() - t0
    masses = list(plan.retained.values())
    console.print(
        f"wrote {output}: keep {plan.num_kept} of {plan.num_experts} experts in "
        f"{len(plan.kept)} layers by {plan.saliency}; retained saliency mass mean "
        f"{100 * sum(masses) / len(masses):.1f}% (min {100 * min(masses):.1f}%) [{dt * 1000:.0f} ms]"
    )
    for note in plan.params.get("adjustments", []):
        console.print(f"  keep count: {note}")
    if plan.never_routed:
        n = sum(len(v) for v in plan.never_routed.values())
        console.print(f"  [yellow]{n} never-routed (layer, expert) pairs (score 0, dropped first)[/]")
    if plan.ties:
        console.print(f"  [yellow]{sum(plan.ties.values())} experts tied at the cut (lower index kept)[/]")


def tiers_cmd(
    scores: Path = typer.Argument(..., help="scores file"),
    keep: Optional[list[int]] = typer.Option(None, "--keep", help="keep counts (several)"),
    sparsity: Optional[list[float]] = typer.Option(None, "--sparsity", help="sparsities (several)"),
    saliency: Optional[str] = typer.Option(None, "--saliency", help="criterion (default reap)"),
    out_dir: Optional[Path] = typer.Option(None, "-o", "--out", help="write tiers.json/.md/.png here"),
) -> None:
    """Retained saliency mass per tier, marginal cost per pruned expert, and whether
    the saliency curve has a knee."""
    from .tiers import tiers_report, write_tiers_report

    try:
        if not keep and not sparsity:
            raise ScoresError("give tiers with --keep N [N ...] and/or --sparsity S [S ...]")
        s = _load(scores)
        report = tiers_report(s, keep or [], sparsities=sparsity or [], saliency=saliency)
    except _ERRORS as exc:
        _fail(exc)
    table = Table(title=f"retained {report['saliency']} mass ({report['num_layers']} layers x "
                        f"{report['num_experts']} experts)")
    for col in ("keep", "pruned", "retained (mean)", "min layer", "cost/expert since prev tier"):
        table.add_column(col, justify="right")
    between = {b["to_keep"]: b for b in report["between_tiers"]}
    for t in report["tiers"]:
        b = between.get(t["keep"])
        table.add_row(
            str(t["keep"]), f"{100 * t['pruned_fraction']:.1f}%",
            f"{100 * t['retained_mass_mean']:.1f}%", f"{100 * t['retained_mass_min']:.1f}%",
            "-" if b is None else f"{100 * b['cost_per_expert']:.4f}% ({b['cost_per_expert_vs_uniform']:.2f}x uniform)",
        )
    console.print(table)
    console.print(f"[bold]Is there a knee?[/] {report['answer']}", soft_wrap=True)
    if out_dir is not None:
        paths = write_tiers_report(report, out_dir)
        console.print("wrote " + ", ".join(str(p) for p in paths.values()))


def _key_values(items: list[str] | None, what: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise typer.BadParameter(f"{what} expects KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def compare_cmd(
    files: list[Path] = typer.Argument(..., help="scores files A B [C ...], earlier first"),
    keep: Optional[int] = typer.Option(None, "--keep", help="experts kept per layer"),
    sparsity: Optional[float] = typer.Option(None, "--sparsity", help="or a sparsity"),
    divisible_by: Optional[int] = typer.Option(None, "--divisible-by"),
    saliency: Optional[str] = typer.Option(None, "--saliency", help="criterion for calibration files"),
    corpus_of: Optional[list[str]] = typer.Option(
        None, "--corpus-of", help="LABEL=corpus, e.g. B=en C=en+zh (label A, B, ... or file name)"),
    per_source: Optional[list[str]] = typer.Option(
        None, "--per-source", help="SOURCE=FILE scores calibrated on one source, e.g. en=SA zh=SB"),
    threshold: float = typer.Option(1.5, "--ratio", help="routing-rate ratio threshold"),
    out_dir: Path = typer.Option(..., "-o", "--out", help="report folder"),
) -> None:
    """Compare rankings pairwise: keep/drop flips per layer and overall, retained mass,
    and promoted experts' routing ratio between corpora and support."""
    from .compare import Ranking, compare_rankings, write_compare_report

    try:
        if len(files) < 2:
            raise ScoresError("compare needs at least two scores files")
        corpora = _key_values(corpus_of, "--corpus-of")
        sources = _key_values(per_source, "--per-source")
        rankings = []
        for i, path in enumerate(files):
            label = chr(ord("A") + i) if i < 26 else f"R{i}"
            corpus = None
            for key in (label, path.stem, path.name, str(path)):
                corpus = corpora.pop(key, None) or corpus
            rankings.append(Ranking(label=label, scores=_load(path), path=str(path), corpus=corpus))
        if corpora:
            raise ScoresError(
                f"--corpus-of names unknown rankings {sorted(corpora)}; use the labels "
                f"{[r.label for r in rankings]} or the file names"
            )
        per = {src: _load(Path(p)) for src, p in sources.items()} or None
        result = compare_rankings(
            rankings, keep, sparsity=sparsity, divisible_by=divisible_by, saliency=saliency,
            per_source=per, threshold=threshold,
        )
        paths = write_compare_report(result, out_dir, rankings, per)
    except _ERRORS as exc:
        _fail(exc)
    table = Table(title=f"keep/drop flips at keep {result['keep']} ({result['num_layers']} layers)")
    for col in ("pair", "change", "flips", "% kept slots", "x first", "mass earlier/later",
                "promoted >=%gx by b (all)" % result["threshold"]):
        table.add_column(col, justify="left" if col in ("pair", "change") else "right")
    for p in result["pairs"]:
        m = p["mass"]
        mass = " / ".join("n/a" if v is None else f"{100 * v:.1f}%"
                          for v in (m["own_earlier"], m["own_later"]))
        route = "; ".join(
            f"{r['b']}/{r['a']}: "
            + ("n/a" if r["promoted_frac_more_by_b"] is None else f"{100 * r['promoted_frac_more_by_b']:.0f}%")
            + f" ({100 * r['all_frac_more_by_b']:.0f}%)"
            for r in p["routing"]
        ) or "-"
        table.add_row(
            f"{p['earlier']} -> {p['later']}", p["change"], f"{p['flips']:,}",
            f"{p['pct_of_kept_slots']:.2f}%",
            "-" if p["x_first_pair"] is None else f"{p['x_first_pair']:.2f}x", mass, route,
        )
    console.print(table)
    console.print("wrote " + ", ".join(str(p) for p in paths.values()))


def register(app: typer.Typer) -> None:
    """Add ``scores {merge,show,from-weights}``, ``cut``, ``tiers``, ``compare`` to ``app``."""
    app.add_typer(scores_app, name="scores")
    app.command("cut")(cut_cmd)
    app.command("tiers", cls=_greedy("--keep", "--sparsity"))(tiers_cmd)
    app.command("compare", cls=_greedy("--corpus-of", "--per-source"))(compare_cmd)
