"""Retained saliency mass per tier, marginal cost per pruned expert, and the knee test.

Definitions (per MoE layer, then averaged over layers with equal weight):

- *share* of an expert: its saliency divided by the layer's total saliency.
- *retained mass* at keep ``k``: the summed share of the ``k`` highest-saliency
  experts (what ``reap cut --keep k`` keeps; 1.0 for an all-zero layer).
- *marginal cost* of the ``k``-th expert (``k`` = 1..E): its share, i.e. the mass
  lost going from keep ``k`` to keep ``k - 1`` (``mass(k) - mass(k-1)``). Experts are
  pruned in descending-cut order (lowest saliency first), so the marginal cost rises
  monotonically as ``k`` falls, in every layer: monotone growth alone is not a knee.
- *knee test*: a knee is a keep count where the cost per pruned expert *jumps*.
  With a window ``w = max(2, ceil(E / 64))`` experts, the jump at keep ``k`` is
  ``J(k) = mean cost of ranks k-w+1..k`` (the next ``w`` experts you would prune)
  ``/ mean cost of ranks k+1..k+w`` (the ``w`` pruned just before reaching ``k``).
  There is a knee in a range of keep counts when ``max J >= 2``: within ``2w``
  consecutive experts the cost per pruned expert at least doubles. A smooth curve
  (e.g. the seed's 0.074 -> 0.093 -> 0.108 -> 0.120 % per expert across its tiers)
  has ``J`` near 1 everywhere; a cluster of near-zero experts (never routed, or a
  dead group) followed by useful ones gives a large ``J`` at the cluster's edge.
  The range searched is the span of the requested tiers (the seed's question: is
  there a knee *in this region*), and the whole curve is scanned too.

Saliencies with negative values (``router_signed_sum``) have no mass fraction; they
are refused here with a clear message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..models.config_keys import group_limit
from ..scores import ExpertScores, ScoresError
from ..scores.keep_count import sparsity_to_keep

__all__ = [
    "KNEE_THRESHOLD",
    "TierCurve",
    "detect_knee",
    "knee_window",
    "mass_curve",
    "retained_mass_at",
    "tiers_report",
]

#: the jump ratio ``J`` at or above which the knee test reports a knee
KNEE_THRESHOLD = 2.0


def _stack(saliency: dict[str, torch.Tensor]) -> tuple[list[str], np.ndarray]:
    names = list(saliency)
    if not names:
        raise ScoresError("no layers to analyse")
    sizes = {saliency[n].numel() for n in names}
    if len(sizes) != 1:
        raise ScoresError(f"layers have different expert counts: {sorted(sizes)}")
    arr = np.stack([saliency[n].detach().to("cpu", torch.float64).numpy() for n in names])
    if not np.isfinite(arr).all():
        raise ScoresError("saliency holds NaN/inf values")
    return names, arr


def _require_nonnegative(arr: np.ndarray, what: str) -> None:
    if (arr < 0).any():
        raise ScoresError(
            f"{what} has negative values (e.g. router_signed_sum): a retained "
            "saliency-mass fraction is undefined for it; use a non-negative criterion"
        )


def knee_window(num_experts: int) -> int:
    """Window ``w`` of the knee test: ``max(2, ceil(E / 64))`` (14 for 896 experts)."""
    return max(2, math.ceil(num_experts / 64))


@dataclass
class TierCurve:
    """Retained mass and marginal cost for every keep count.

    ``shares[l, r]`` is the share of the ``r+1``-th ranked expert of layer ``l``;
    ``layer_mass[l, k]`` the retained mass of layer ``l`` at keep ``k`` (``k = 0..E``).
    """

    layers: list[str]
    shares: np.ndarray  # [L, E], descending per layer
    layer_mass: np.ndarray  # [L, E + 1]

    @property
    def num_experts(self) -> int:
        return self.shares.shape[1]

    @property
    def mass(self) -> np.ndarray:
        """Layer-mean retained mass at keep ``k`` (index ``k``), ``[E + 1]``."""
        return self.layer_mass.mean(axis=0)

    @property
    def marginal_cost(self) -> np.ndarray:
        """Layer-mean share of the ``k``-th ranked expert at index ``k``; index 0 is NaN."""
        out = np.full(self.num_experts + 1, np.nan)
        out[1:] = self.shares.mean(axis=0)
        return out


def mass_curve(saliency: dict[str, torch.Tensor]) -> TierCurve:
    """Build the :class:`TierCurve` of a per-layer saliency (non-negative)."""
    names, arr = _stack(saliency)
    _require_nonnegative(arr, "this saliency")
    desc = -np.sort(-arr, axis=1)
    totals = desc.sum(axis=1, keepdims=True)
    zero = totals[:, 0] == 0
    shares = np.divide(desc, totals, out=np.zeros_like(desc), where=totals > 0)
    layer_mass = np.concatenate([np.zeros((len(names), 1)), np.cumsum(shares, axis=1)], axis=1)
    # exact endpoints (cumsum rounding) and the all-zero convention of retained_mass
    layer_mass[:, -1] = 1.0
    layer_mass[zero, 1:] = 1.0
    return TierCurve(names, shares, layer_mass)


def retained_mass_at(
    saliency: dict[str, torch.Tensor], keep: int, n_group: int | None = None
) -> np.ndarray:
    """Per-layer retained mass at ``keep`` with the selection ``reap cut`` makes
    (equal count per group when ``n_group`` is given)."""
    _, arr = _stack(saliency)
    _require_nonnegative(arr, "this saliency")
    num_layers, num_experts = arr.shape
    groups = n_group if n_group and n_group > 1 else 1
    per = keep // groups
    grouped = arr.reshape(num_layers, groups, num_experts // groups)
    top = -np.sort(-grouped, axis=2)[:, :, :per]
    kept = top.sum(axis=(1, 2))
    totals = arr.sum(axis=1)
    return np.where(totals > 0, kept / np.where(totals > 0, totals, 1.0), 1.0)


def _jumps(cost: np.ndarray, w: int) -> np.ndarray:
    """``J(k)`` for every keep ``k`` (index ``k``; NaN where the windows do not fit).

    ``cost`` is ``[..., E]`` with ``cost[..., r]`` = share of rank ``r + 1``.
    """
    num_experts = cost.shape[-1]
    csum = np.concatenate(
        [np.zeros(cost.shape[:-1] + (1,)), np.cumsum(cost, axis=-1)], axis=-1
    )  # csum[..., r] = sum of ranks 1..r
    out = np.full(cost.shape[:-1] + (num_experts + 1,), np.nan)
    ks = np.arange(w, num_experts - w + 1)
    if ks.size == 0:
        return out
    after = (csum[..., ks] - csum[..., ks - w]) / w  # ranks k-w+1 .. k
    before = (csum[..., ks + w] - csum[..., ks]) / w  # ranks k+1 .. k+w
    with np.errstate(divide="ignore", invalid="ignore"):
        j = np.where(
            before > 0, after / np.where(before > 0, before, 1.0), np.where(after > 0, np.inf, 1.0)
        )
    out[..., ks] = j
    return out


def detect_knee(
    curve: TierCurve,
    keep_range: tuple[int, int] | None = None,
    *,
    window: int | None = None,
    threshold: float = KNEE_THRESHOLD,
) -> dict:
    """The knee test (see the module docstring) on the layer-mean marginal cost.

    :param keep_range: inclusive ``(lo, hi)`` keep counts to search; default all
    :returns: ``{"knee": bool, "keep": k or None, "max_jump": J, "at_keep": k,
        "window": w, "threshold": t, "range": [lo, hi], "layers_with_knee": n, ...}``
    """
    num_experts = curve.num_experts
    w = window or knee_window(num_experts)
    lo, hi = keep_range or (1, num_experts)
    lo_s, hi_s = max(lo, w), min(hi, num_experts - w)
    mean_cost = curve.shares.mean(axis=0)
    jumps = _jumps(mean_cost, w)
    layer_jumps = _jumps(curve.shares, w)
    result = {
        "window": w,
        "threshold": threshold,
        "range": [int(lo), int(hi)],
        "searched": [int(lo_s), int(hi_s)] if lo_s <= hi_s else None,
    }
    if lo_s > hi_s:
        result.update(
            knee=False,
            keep=None,
            max_jump=None,
            at_keep=None,
            layers_with_knee=0,
            num_layers=len(curve.layers),
            note=f"range too narrow for the {w}-expert windows",
        )
        return result
    seg = jumps[lo_s : hi_s + 1]
    idx = int(np.nanargmax(np.where(np.isnan(seg), -np.inf, seg)))
    max_jump = float(seg[idx])
    at_keep = lo_s + idx
    layer_seg = layer_jumps[:, lo_s : hi_s + 1]
    layer_max = np.nanmax(np.where(np.isnan(layer_seg), -np.inf, layer_seg), axis=1)
    knee = bool(max_jump >= threshold)
    result.update(
        knee=knee,
        keep=at_keep if knee else None,
        max_jump=max_jump,
        at_keep=at_keep,
        layers_with_knee=int((layer_max >= threshold).sum()),
        num_layers=len(curve.layers),
    )
    return result


def _answer(curve: TierCurve, knee_range: dict, knee_all: dict, between: list[dict]) -> str:
    num_experts = curve.num_experts
    cost = curve.marginal_cost
    lo, hi = knee_range["range"]
    w = knee_range["window"]
    t = knee_range["threshold"]
    if knee_range["max_jump"] is None:
        head = f"Not tested: {knee_range.get('note')}."
    elif knee_range["knee"]:
        k = knee_range["keep"]
        head = (
            f"Yes: a knee at keep {k} ({100 * (1 - k / num_experts):.1f}% pruned). Pruning "
            f"the next {w} experts below it costs {knee_range['max_jump']:.2f}x as much per "
            f"expert as the {w} pruned just before (threshold {t:g}x). Cutting at or above "
            f"{k} is a point the measurements recommend."
        )
        if math.isinf(knee_range["max_jump"]):
            head += " (The experts pruned before it carry zero saliency: never routed or dead.)"
    else:
        steps = [b for b in between if b["from_keep"] <= hi and b["to_keep"] >= lo]
        if steps:
            rise = " -> ".join(f"{100 * b['cost_per_expert']:.3f}%" for b in steps)
            rise = f"{rise} of a layer's saliency per expert between consecutive tiers"
        else:
            rise = (
                f"from {100 * cost[hi]:.3f}% to {100 * cost[lo]:.3f}% of a layer's "
                "saliency per expert"
            )
        head = (
            f"No knee between keep {hi} and {lo}: the marginal cost per pruned expert rises "
            f"gradually, {rise} (uniform would be {100 / num_experts:.3f}%); the largest jump "
            f"between adjacent {w}-expert windows is {knee_range['max_jump']:.2f}x (at keep "
            f"{knee_range['at_keep']}), below the {t:g}x threshold. Any cut in this range is "
            "a hardware choice, not a point the measurements recommend."
        )
    if knee_all.get("max_jump") is not None and (lo, hi) != tuple(knee_all["range"]):
        if knee_all["knee"] and not (lo <= knee_all["keep"] <= hi):
            head += (
                f" Over the whole curve there is a knee at keep {knee_all['keep']} "
                f"(jump {knee_all['max_jump']:.2f}x)."
            )
        elif not knee_all["knee"]:
            head += f" None anywhere on the curve either (max jump {knee_all['max_jump']:.2f}x)."
    head += (
        f" {knee_range['layers_with_knee']} of {knee_range['num_layers']} layers pass the "
        "same test on their own curve."
    )
    return head


def tiers_report(
    scores: ExpertScores | dict[str, torch.Tensor],
    keeps: list[int] | None = None,
    *,
    sparsities: list[float] | None = None,
    saliency: str | None = None,
    n_group: int | None = None,
    window: int | None = None,
    threshold: float = KNEE_THRESHOLD,
) -> dict:
    """Everything ``reap tiers`` prints and writes, as a JSON-ready dict. (Long because it is
    one document: the tiers, the cost between them and the knee, all read off one mass curve.)

    :param scores: a scores file (its metadata gives groups) or a saliency dict
    :param keeps: keep counts of the tiers; ``sparsities`` are converted with the
        keep-count rule's step 1 (``E - int(E * s)``)
    """
    if isinstance(scores, ExpertScores):
        name = saliency or scores.default_saliency
        sal = scores.saliency(name)
        meta = scores.metadata
        n_group = n_group or group_limit(meta.get("n_group"), meta.get("topk_group"))
    else:
        name, sal = saliency or "saliency", scores
    curve = mass_curve(sal)
    num_experts = curve.num_experts
    tier_keeps = sorted(
        {int(k) for k in (keeps or [])}
        | {sparsity_to_keep(num_experts, s) for s in (sparsities or [])},
        reverse=True,
    )
    for k in tier_keeps:
        if not 0 < k <= num_experts:
            raise ScoresError(f"keep {k} is outside [1, {num_experts}]")
        if n_group and k % n_group:
            raise ScoresError(
                f"keep {k} is not a multiple of n_group={n_group} (group-limited routing "
                "needs an equal count per group)"
            )
    tiers = []
    for k in tier_keeps:
        per_layer = retained_mass_at(sal, k, n_group)
        tiers.append(
            {
                "keep": k,
                "pruned_fraction": 1 - k / num_experts,
                "retained_mass_mean": float(per_layer.mean()),
                "retained_mass_min": float(per_layer.min()),
                "retained_mass_max": float(per_layer.max()),
                "discarded_mass_mean": float(1 - per_layer.mean()),
                "min_layer": curve.layers[int(per_layer.argmin())],
            }
        )
    between = []
    bounds = [num_experts] + tier_keeps
    mass = curve.mass
    for hi, lo in zip(bounds, bounds[1:]):
        if hi == lo:
            continue
        lost = float(mass[hi] - mass[lo])
        between.append(
            {
                "from_keep": hi,
                "to_keep": lo,
                "mass_lost": lost,
                "cost_per_expert": lost / (hi - lo),
                "cost_per_expert_vs_uniform": lost / (hi - lo) * num_experts,
            }
        )
    rng = (min(tier_keeps), max(tier_keeps)) if len(tier_keeps) >= 2 else None
    knee_all = detect_knee(curve, None, window=window, threshold=threshold)
    knee_rng = detect_knee(curve, rng, window=window, threshold=threshold) if rng else knee_all
    cost = curve.marginal_cost
    return {
        "saliency": name,
        "num_experts": num_experts,
        "num_layers": len(curve.layers),
        "n_group": n_group,
        "tiers": tiers,
        "between_tiers": between,
        "knee": knee_rng,
        "knee_whole_curve": knee_all,
        "answer": _answer(curve, knee_rng, knee_all, between),
        "curve": {
            "keep": list(range(num_experts + 1)),
            "retained_mass": [float(x) for x in mass],
            "marginal_cost": [None] + [float(x) for x in cost[1:]],
        },
        "knee_definition": (
            f"J(k) = mean share of ranks k-w+1..k / mean share of ranks k+1..k+w, "
            f"w = max(2, ceil(E/64)) = {knee_rng['window']}; knee iff max J >= {threshold:g} "
            "over the keep range of the requested tiers"
        ),
    }
