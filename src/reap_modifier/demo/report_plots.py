"""The main job's PNG plots, drawn from ``results.json`` alone (read into the typed records of
:mod:`.records`)."""

from __future__ import annotations

from pathlib import Path

from ..reporting import save_png
from .config import ABLATION, LANGS, REFERENCE
from .records import read_results


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
