"""How far two score sets of the same layers differ, statistic by statistic (e.g. the
main job's packed calibration against the decompressed one)."""

from __future__ import annotations

import torch

from .scores_file import ExpertScores

__all__ = ["scores_difference"]


def scores_difference(got: ExpertScores, ref: ExpertScores) -> dict:
    """Largest relative difference of every statistic between two score sets of the same
    layers (e.g. packed vs decompressed calibration): ``{"max_rel": x, "by_stat": {...},
    "statistics": n}``; entries equal to zero in both count as equal."""
    if set(got.layers) != set(ref.layers):
        raise ValueError("the two score sets cover different layers")
    by_stat: dict[str, float] = {}
    count = 0
    for layer, stats in ref.layers.items():
        if set(got.layers[layer]) != set(stats):
            raise ValueError(f"{layer}: different statistics")
        for name, value in stats.items():
            other = got.layers[layer][name].to(torch.float64)
            value = value.to(torch.float64)
            diff = (other - value).abs()
            rel = torch.where(
                diff == 0, torch.zeros_like(diff), diff / value.abs().clamp_min(1e-300)
            )
            by_stat[name] = max(by_stat.get(name, 0.0), float(rel.max()) if rel.numel() else 0.0)
            count += value.numel()
    return {"max_rel": max(by_stat.values(), default=0.0), "by_stat": by_stat, "statistics": count}
