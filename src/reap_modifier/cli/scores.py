"""``reap scores merge|show|from-weights`` and ``reap cut``: the scores file commands."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import typer
from rich.markup import escape
from rich.table import Table

from ..scores import BASELINE_METHODS, SALIENCY_NAMES, ScoresError
from ..scores.errors import PlanError
from .common import OUTPUT_ALIASES, command_class, console, fail

if TYPE_CHECKING:  # torch comes with the scores file, imported where a command reads one
    from ..scores import ExpertScores

__all__ = ["register"]

#: user errors: bad files or requests, file system errors included (exit 2, one line)
_ERRORS = (ScoresError, PlanError, OSError)


def _load(path: Path) -> ExpertScores:
    from ..scores import ExpertScores

    return ExpertScores.load(path)


def _fmt_int(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def _print_calibration_runs(s: ExpertScores) -> None:
    """What each calibration run, and each rank of it, observed."""
    runs = s.calibration_runs()
    if not runs:
        return
    table = Table(
        title="calibration: what each run and rank observed",
        caption="padding: positions with attention mask 0, left out of every statistic",
    )
    for col, justify in (
        ("run", "right"),
        ("source", "left"),
        ("world size", "right"),
        ("rank", "right"),
        ("samples", "right"),
        ("tokens", "right"),
        ("padding", "right"),
    ):
        table.add_column(col, justify=justify)

    def num(value) -> str:
        return "-" if value is None else f"{int(value):,}"

    for i, run in enumerate(runs, start=1):
        source = escape(str(run.get("source", "-")))
        world = num(run.get("world_size"))
        ranks = run.get("ranks") or []
        for r in ranks:
            table.add_row(
                str(i),
                source,
                world,
                str(r.get("rank")),
                num(r.get("samples")),
                num(r.get("tokens")),
                num(r.get("padding")),
            )
        if len(ranks) != 1:  # the run's total (the only row when ranks were not recorded)
            table.add_row(
                str(i),
                source,
                world,
                "all",
                num(run.get("samples")),
                num(run.get("tokens")),
                num(run.get("padding_skipped")),
            )
        if i < len(runs):
            table.add_section()
    console.print(table)


# -- reap scores ... ----------------------------------------------------------------

scores_app = typer.Typer(
    help="Scores files: merge per-corpus files, inspect one, or make a baseline from weights.",
    no_args_is_help=True,
)

#: the commands that write one file take ``-o/--out`` (``--output``, their old spelling, too)
_WRITES = command_class(aliases=OUTPUT_ALIASES)


@scores_app.command(
    "merge",
    cls=_WRITES,
    epilog="Example: reap scores merge scores_en.safetensors scores_zh.safetensors -o scores_en_zh.safetensors",
)
def merge_cmd(
    inputs: list[Path] = typer.Argument(..., help="two or more scores files from the same model"),
    output: Path = typer.Option(..., "-o", "--out", help="merged scores file to write"),
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
        fail(exc)
    toks = ", ".join(f"{s}={n:,}" for s, n in merged.source_tokens().items())
    console.print(
        f"wrote {output}: {len(merged.layers)} layers x {merged.num_experts} experts, "
        f"tokens {toks or 'n/a'}"
    )


@scores_app.command("show", epilog="Example: reap scores show scores.safetensors")
def show_cmd(
    path: Path = typer.Argument(..., help="scores file"),
) -> None:
    """Metadata, total tokens and per-layer support (routed tokens per expert)."""
    try:
        s = _load(path)
    except _ERRORS as exc:
        fail(exc)
    _print_metadata(path, s)
    _print_calibration_runs(s)
    if s.kind != "calibration":
        _print_baseline_saliency(s)
    else:
        _print_support(s)


#: metadata shown first, in this order, by ``reap scores show``
_META_KEYS = (
    "model_class",
    "num_experts",
    "top_k",
    "n_group",
    "topk_group",
    "num_moe_layers",
    "runs",
    "seed",
    "source_checkpoint",
)


def _print_metadata(path: Path, s) -> None:
    meta = Table(title=escape(str(path)), show_header=False)
    meta.add_column("key", style="bold")
    meta.add_column("value")
    meta.add_row("kind", s.kind + (f" ({s.method})" if s.method else ""))
    for key in _META_KEYS:
        if s.metadata.get(key) is not None:
            meta.add_row(key, str(s.metadata[key]))
    meta.add_row("layers in file", str(len(s.layers)))
    if s.kind == "calibration":
        for src, n in s.source_tokens().items():
            meta.add_row(escape(f"tokens[{src}]"), f"{n:,}")
        meta.add_row("total tokens", f"{s.total_tokens():,}")
    for key, value in s.metadata.items():
        if key in ("tokens", "kind", "method", "calibration") or key in _META_KEYS:
            continue
        text = str(value)
        meta.add_row(escape(key), escape(text if len(text) < 120 else text[:117] + "..."))
    console.print(meta)


def _print_baseline_saliency(s) -> None:
    import torch

    table = Table(title=f"{s.method} saliency per layer")
    table.add_column("layer", no_wrap=True)
    for col in ("min", "median", "max"):
        table.add_column(col, justify="right")
    for layer, stats in s.layers.items():
        v = stats[s.method]
        table.add_row(
            layer,
            f"{float(v.min()):.4g}",
            f"{float(torch.quantile(v, 0.5)):.4g}",
            f"{float(v.max()):.4g}",
        )
    console.print(table)


def _print_support(s) -> None:
    import torch

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
        row = [
            layer,
            _fmt_int(sup["median"]),
            _fmt_int(sup["min"]),
            _fmt_int(sup["max"]),
            str(sup["never_routed"]),
        ]
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


@scores_app.command(
    "from-weights",
    cls=_WRITES,
    epilog="Example: reap scores from-weights /models/K3 --method router_l1 -o l1.safetensors",
)
def from_weights_cmd(
    checkpoint: Path = typer.Argument(
        ..., help="safetensors checkpoint folder (or one file), or a llama.cpp .gguf model"
    ),
    method: Literal[BASELINE_METHODS] = typer.Option(
        ...,
        "--method",
        help="the ranking: router weights' L1 norm, their signed sum, or random",
    ),
    seed: int = typer.Option(0, "--seed", help="seed of the random baseline"),
    output: Path = typer.Option(..., "-o", "--out", help="scores file to write"),
) -> None:
    """A calibration-free baseline scores file computed from router weights alone
    (reads only the router tensors; the model is never loaded)."""
    from ..gguf.layout import is_gguf
    from ..scores.baselines import scores_from_weights

    try:
        if is_gguf(checkpoint):
            from ..gguf.routers import gguf_scores_from_weights

            s = gguf_scores_from_weights(checkpoint, method, seed=seed)
        else:
            s = scores_from_weights(checkpoint, method, seed=seed)
        s.save(output)
    except _ERRORS as exc:
        fail(exc)
    console.print(
        f"wrote {output}: {method} for {len(s.layers)} MoE layers x {s.num_experts} experts "
        f"({s.metadata.get('model_class') or 'unknown class'}, top_k={s.metadata.get('top_k')})"
    )


# -- reap cut -------------------------------------------------------------------------------

CUT_EXAMPLE = "Example: reap cut scores.safetensors --keep 448 --divisible-by 8 -o plan.json"


def cut_cmd(
    scores: Path = typer.Argument(..., help="scores file"),
    keep: int | None = typer.Option(None, "--keep", help="experts to keep per layer"),
    sparsity: float | None = typer.Option(None, "--sparsity", help="fraction of experts to drop"),
    divisible_by: int | None = typer.Option(None, "--divisible-by", help="kept count multiple"),
    saliency: Literal[SALIENCY_NAMES] | None = typer.Option(
        None,
        "--saliency",
        help="the criterion: one of the calibration statistics (default reap), or the "
        "method of a baseline file",
    ),
    output: Path = typer.Option(..., "-o", "--out", help="plan.json to write"),
) -> None:
    """Cut a scores file into a pruning plan (any tier, no recalibration), with the same
    keep-count rule as the modifier. The plan is what `reap prune --plan` and the
    modifier's `plan_in:` accept."""
    from ..fileio import sha256_file
    from ..scores.keep_count import check_keep_spec
    from ..scores.plan import plan_from_scores

    t0 = time.perf_counter()
    try:
        check_keep_spec(keep, sparsity, "--keep N", "--sparsity S")
        s = _load(scores)
        plan = plan_from_scores(
            s,
            sparsity=sparsity,
            num_experts_to_keep=keep,
            divisible_by=divisible_by,
            saliency=saliency,
            params={"scores": {"path": str(scores), "sha256": sha256_file(scores)}},
        )
        plan.save(output)
    except _ERRORS as exc:
        fail(exc)
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
        console.print(
            f"  [yellow]{n} never-routed (layer, expert) pairs (score 0, dropped first)[/]"
        )
    if plan.ties:
        console.print(
            f"  [yellow]{sum(plan.ties.values())} experts tied at the cut (lower index kept)[/]"
        )


def register(app: typer.Typer) -> None:
    """Add ``scores {merge,show,from-weights}`` and ``cut`` to ``app``."""
    app.add_typer(scores_app, name="scores")
    app.command("cut", cls=_WRITES, epilog=CUT_EXAMPLE)(cut_cmd)
