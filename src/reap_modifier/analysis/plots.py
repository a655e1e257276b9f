"""PNG plots of the analysis reports (matplotlib, Agg backend): retained mass and
marginal cost per tier, flips per layer, routing-rate ratios of promoted experts."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..reporting import save_png
from ..scores.baselines import layer_number

__all__ = ["plot_flips", "plot_routing_ratio", "plot_tiers"]


def plot_tiers(report: dict, path: str | os.PathLike) -> Path:
    """PNG: mean retained mass vs keep (tiers marked), marginal cost vs keep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    num_experts = report["num_experts"]
    keep = np.array(report["curve"]["keep"])
    mass = np.array(report["curve"]["retained_mass"])
    cost = np.array([np.nan if c is None else c for c in report["curve"]["marginal_cost"]])
    w = report["knee"]["window"]
    smooth = np.convolve(np.nan_to_num(cost[1:]), np.ones(w) / w, mode="valid")
    smooth_x = keep[1:][: smooth.size] + (w - 1) / 2
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.plot(keep, 100 * mass, color="C0")
    for t in report["tiers"]:
        ax1.scatter([t["keep"]], [100 * t["retained_mass_mean"]], color="C3", zorder=3)
        ax1.annotate(
            f"{t['keep']}: {100 * t['retained_mass_mean']:.1f}%",
            (t["keep"], 100 * t["retained_mass_mean"]),
            textcoords="offset points",
            xytext=(5, -12),
            fontsize=8,
        )
    ax1.set_xlabel("experts kept per layer")
    ax1.set_ylabel("retained saliency mass (layer mean, %)")
    ax1.set_title(f"Retained mass ({report['saliency']})")
    ax1.set_xlim(num_experts, 0)
    ax1.grid(alpha=0.3)
    ax2.plot(keep[1:], cost[1:] * num_experts, color="C1", alpha=0.35, lw=0.8, label="per expert")
    ax2.plot(smooth_x, smooth * num_experts, color="C1", label=f"{w}-expert mean")
    ax2.axhline(1.0, color="grey", ls=":", lw=1, label="uniform share (1/E)")
    for t in report["tiers"]:
        ax2.axvline(t["keep"], color="C3", ls="--", lw=0.8)
    if report["knee"].get("knee"):
        ax2.axvline(report["knee"]["keep"], color="k", lw=1.5, label="knee")
    ax2.set_xlabel("experts kept per layer (k-th expert is pruned next)")
    ax2.set_ylabel("marginal cost (share x E; 1 = average expert)")
    ax2.set_title("Marginal saliency cost per pruned expert")
    ax2.set_xlim(num_experts, 0)
    ax2.set_yscale("symlog", linthresh=0.1)
    ax2.set_ylim(bottom=0)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    return save_png(fig, path)


def _layer_axis(layers: list[str]) -> tuple[np.ndarray, str]:
    nums = [layer_number(n) for n in layers]
    if len(set(nums)) == len(nums) and max(nums) < 10_000:
        return np.array(nums), "layer number"
    return np.arange(len(layers)), "MoE layer (position)"


def plot_flips(result: dict, path: str | os.PathLike) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x, xlabel = _layer_axis(result["layers"])
    fig, ax = plt.subplots(figsize=(10, 4))
    for i, p in enumerate(result["pairs"]):
        ax.plot(
            x,
            p["pct_per_layer"],
            marker="o",
            ms=3,
            lw=1,
            ls="-" if p["consecutive"] else ":",
            color=f"C{i}",
            label=f"{p['earlier']}->{p['later']} ({p['change']}): {p['pct_of_kept_slots']:.2f}%",
        )
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"flips (% of {result['keep']} kept slots)")
    ax.set_title(f"Keep/drop flips per layer at keep {result['keep']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_png(fig, path)


def plot_routing_ratio(
    result: dict, rates_ratio: list[tuple[str, np.ndarray, np.ndarray]], path: str | os.PathLike
) -> Path | None:
    """Histogram of log2(rate_b / rate_a): all experts vs promoted, one panel per pair."""
    if not rates_ratio:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(rates_ratio)
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 4), squeeze=False)
    lim = 6.0
    bins = np.linspace(-lim, lim, 49)
    t = np.log2(result["threshold"])
    for ax, (title, ratio, promoted) in zip(axes[0], rates_ratio):
        with np.errstate(divide="ignore"):
            lr = np.log2(ratio)
        lr = np.clip(lr, -lim, lim)  # +-inf -> edges
        ok = ~np.isnan(lr)
        ax.hist(
            lr[ok].ravel(), bins=bins, density=True, alpha=0.45, color="grey", label="all experts"
        )
        sel = ok & promoted
        if sel.any():
            ax.hist(
                lr[sel].ravel(),
                bins=bins,
                density=True,
                alpha=0.6,
                color="C3",
                label=f"promoted ({int(promoted.sum())})",
            )
        for v in (-t, t):
            ax.axvline(v, color="k", ls="--", lw=0.8)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("log2 routing-rate ratio (clipped at +-6)")
        ax.set_ylabel("density")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return save_png(fig, path)
