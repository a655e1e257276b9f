"""Compare expert rankings: keep/drop flips, retained mass, promoted experts.

Given rankings ``A, B, C, ...`` (scores files, usually calibrated on growing or
different corpora) and a keep count ``N``, for every pair ``(X, Y)`` with ``X``
listed before ``Y``:

- **flips**: kept slots whose expert changes, ``|kept_Y \\ kept_X|`` per layer
  (= ``|kept_X \\ kept_Y|``, both keep ``N``); as a percentage of the kept slots
  (``layers x N``, the seed's denominator). ``changed_status = 2 x flips`` counts
  the (layer, expert) slots whose keep/drop status differs, as a percentage of all
  ``layers x E`` slots (the two percentages coincide at 50%).
- **retained mass**: the layer-mean fraction of a saliency kept by a plan; for each
  pair both rankings' own mass and each saliency under the other ranking's plan.
- **promoted experts** (kept by ``Y``, dropped by ``X``) and **demoted** ones
  (kept by ``X``, dropped by ``Y``). With per-token routing rates for two or more
  calibration sources (``rate_s = count@s / tokens[s]``, from per-source files or
  from the per-source counts a merged file carries), for each source pair
  ``(a, b)``: the fraction of promoted experts routed at least ``1.5x`` more often
  per token by ``b`` than by ``a`` (and by ``a`` than ``b``), against the same
  fraction over all experts. Their **support** (routed tokens) relative to the
  median of their layer: in ``X``'s own counts and per source.

The pair ``A -> B`` (more of the same corpus) is the noise floor; ``B -> C`` (a
new corpus) measured against it is the corpus effect (the seed's table).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

import numpy as np
import torch

from ..models.config_keys import group_limit
from ..scores import KIND_CALIBRATION, SOURCE_PREFIX, ExpertScores, ScoresError
from ..scores.keep_count import KeepCount, keep_count_for_scores

__all__ = [
    "RATIO_THRESHOLD",
    "Ranking",
    "compare_rankings",
    "kept_mask",
    "rate_ratio",
    "routing_rates",
]

#: "routed at least 1.5x more often per token"
RATIO_THRESHOLD = 1.5


@dataclass
class Ranking:
    """One ranking to compare.

    :param label: short name used in tables (``A``, ``B``, ...)
    :param scores: its scores file
    :param corpus: corpus label (``en``, ``en+zh``); default: the sources in the
        file's token counts joined by ``+``
    :param saliency: criterion; default the file's own (``reap`` / baseline method)
    """

    label: str
    scores: ExpertScores
    path: str | None = None
    corpus: str | None = None
    saliency: str | None = None

    def corpus_label(self) -> str:
        if self.corpus:
            return self.corpus
        if self.scores.kind != KIND_CALIBRATION:
            return "none (weights)"
        sources = list(self.scores.source_tokens())
        return "+".join(sources) if sources else "?"

    def corpus_parts(self) -> set[str]:
        if self.scores.kind != KIND_CALIBRATION and not self.corpus:
            return set()
        return {p for p in self.corpus_label().split("+") if p}


def kept_mask(saliency: np.ndarray, keep: int, n_group: int | None = None) -> np.ndarray:
    """``[L, E]`` bool: the ``keep`` highest per layer (per group when grouped), ties to
    the lower index — the same selection as :func:`reap_modifier.scores.plan.select_experts`."""
    num_layers, num_experts = saliency.shape
    groups = n_group if n_group and n_group > 1 else 1
    size, per = num_experts // groups, keep // groups
    grouped = saliency.reshape(num_layers, groups, size)
    order = np.argsort(-grouped, axis=2, kind="stable")[:, :, :per]
    mask = np.zeros((num_layers, groups, size), dtype=bool)
    np.put_along_axis(mask, order, True, axis=2)
    return mask.reshape(num_layers, num_experts)


def _stack(sal: dict[str, torch.Tensor], layers: list[str]) -> np.ndarray:
    return np.stack([sal[name].detach().to("cpu", torch.float64).numpy() for name in layers])


def _mass(sal: np.ndarray, mask: np.ndarray) -> np.ndarray | None:
    """Per-layer retained fraction (None when the saliency has negative values)."""
    if (sal < 0).any():
        return None
    total = sal.sum(axis=1)
    kept = np.where(mask, sal, 0.0).sum(axis=1)
    return np.where(total > 0, kept / np.where(total > 0, total, 1.0), 1.0)


def _mean(x: np.ndarray | None) -> float | None:
    return None if x is None else float(x.mean())


def _check_compatible(items: list[tuple[str, ExpertScores]]) -> list[str]:
    """Same expert count, top-k, model and layer set; return the common layer order."""
    label0, first = items[0]
    layers = first.layer_names
    for label, s in items[1:]:
        if s.num_experts != first.num_experts:
            raise ScoresError(
                f"cannot compare {label0} and {label}: different expert counts "
                f"({first.num_experts} != {s.num_experts}); rankings must come from the same model"
            )
        for key in ("top_k", "model_class", "model_fingerprint"):
            a, b = first.metadata.get(key), s.metadata.get(key)
            if a is not None and b is not None and a != b:
                what = (
                    "router weight fingerprints differ"
                    if key == "model_fingerprint"
                    else f"{key} {a!r} != {b!r}"
                )
                raise ScoresError(
                    f"cannot compare {label0} and {label}: {what}; rankings must come from "
                    "the same model"
                )
        if set(s.layers) != set(layers):
            only_a = sorted(set(layers) - set(s.layers))[:4]
            only_b = sorted(set(s.layers) - set(layers))[:4]
            raise ScoresError(
                f"cannot compare {label0} and {label}: different MoE layers (missing from "
                f"{label}: {only_a}; missing from {label0}: {only_b})"
            )
    return layers


def routing_rates(
    rankings: list[Ranking], per_source: dict[str, ExpertScores] | None, layers: list[str]
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Per-source per-token routing rates ``[L, E]`` and where each came from."""
    rates: dict[str, np.ndarray] = {}
    origin: dict[str, str] = {}
    if per_source:
        for src, s in per_source.items():
            if s.kind != KIND_CALIBRATION:
                raise ScoresError(f"per-source file for {src!r} is not a calibration file")
            rates[src] = _stack(s.routing_rate(None), layers)
            origin[src] = f"per-source file ({s.total_tokens()} tokens)"
        return rates, origin
    best: dict[str, tuple[int, Ranking]] = {}
    for r in rankings:
        if r.scores.kind != KIND_CALIBRATION:
            continue
        for src, n in r.scores.source_tokens().items():
            has = all(SOURCE_PREFIX + src in st for st in r.scores.layers.values())
            if has and n > 0 and n > best.get(src, (0, None))[0]:
                best[src] = (n, r)
    for src, (n, r) in best.items():
        rates[src] = _stack(r.scores.routing_rate(src), layers)
        origin[src] = f"count@{src} of ranking {r.label} ({n} tokens)"
    return rates, origin


def rate_ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """``num / den`` with x/0 = inf (x > 0) and 0/0 = NaN."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(
            den > 0, num / np.where(den > 0, den, 1.0), np.where(num > 0, np.inf, np.nan)
        )


def _frac(mask: np.ndarray, sel: np.ndarray) -> float | None:
    n = int(sel.sum())
    return None if n == 0 else float((mask & sel).sum() / n)


def _support_summary(values: np.ndarray, sel: np.ndarray) -> dict:
    """Support of selected experts relative to the median of their layer."""
    med = np.median(values, axis=1, keepdims=True)
    rel = rate_ratio(values, np.broadcast_to(med, values.shape))
    rel_sel = rel[sel]
    finite = rel_sel[np.isfinite(rel_sel)]
    n = int(sel.sum())
    return {
        "n": n,
        "median_ratio_to_layer_median": float(np.median(finite)) if finite.size else None,
        "mean_ratio_to_layer_median": float(finite.mean()) if finite.size else None,
        "frac_below_layer_median": (
            float((values[sel] < np.broadcast_to(med, values.shape)[sel]).mean()) if n else None
        ),
        "frac_below_half_layer_median": (
            float((values[sel] < 0.5 * np.broadcast_to(med, values.shape)[sel]).mean())
            if n
            else None
        ),
        "frac_never_routed": float((values[sel] == 0).mean()) if n else None,
    }


def _tokens_added(x: Ranking, y: Ranking) -> dict[str, int]:
    tx, ty = x.scores.source_tokens(), y.scores.source_tokens()
    return {
        s: ty.get(s, 0) - tx.get(s, 0)
        for s in sorted(set(tx) | set(ty))
        if ty.get(s, 0) != tx.get(s, 0)
    }


def _rank(rankings: list[Ranking], layers, saliency, k: int, n_group):
    """Per ranking label: its saliency ``[L, E]``, kept mask at ``k`` and criterion name
    (``saliency`` for calibration files, a baseline file's own method)."""
    sal: dict[str, np.ndarray] = {}
    masks: dict[str, np.ndarray] = {}
    crit: dict[str, str] = {}
    for r in rankings:
        name = (
            r.saliency
            or (r.scores.method if r.scores.kind != KIND_CALIBRATION else None)
            or saliency
            or r.scores.default_saliency
        )
        crit[r.label] = name
        sal[r.label] = _stack(r.scores.saliency(name), layers)
        masks[r.label] = kept_mask(sal[r.label], k, n_group)
    return sal, masks, crit


def _all_pairs(rankings, sal, masks, crit, rates, layers, k, num_experts, threshold) -> list[dict]:
    """Every pair of rankings (earlier, later) compared, with its flips relative to the
    first consecutive pair's (``x_first_pair``)."""
    pairs = []
    for i, j in combinations(range(len(rankings)), 2):
        x, y = rankings[i], rankings[j]
        pair = _compare_pair(x, y, sal, masks, crit, layers, k, num_experts)
        pair["consecutive"] = j == i + 1
        promoted = masks[y.label] & ~masks[x.label]
        demoted = masks[x.label] & ~masks[y.label]
        pair["support"] = _pair_support(x, promoted, demoted, rates, layers)
        pair["routing"] = _pair_routing(rates, promoted, demoted, threshold)
        pairs.append(pair)
    consecutive = [p for p in pairs if p["consecutive"]]
    floor = consecutive[0]["flips"] if consecutive else None
    for p in pairs:
        p["x_first_pair"] = (p["flips"] / floor) if floor else None
    return pairs


def compare_rankings(
    rankings: list[Ranking],
    keep: int | None = None,
    *,
    sparsity: float | None = None,
    divisible_by: int | None = None,
    saliency: str | None = None,
    per_source: dict[str, ExpertScores] | None = None,
    threshold: float = RATIO_THRESHOLD,
) -> dict:
    """Compare every pair of rankings at one keep count; return a JSON-ready dict.

    ``saliency`` applies to calibration files (default ``reap``); baseline files
    always rank by their own method. ``per_source`` maps a source name to a scores
    file calibrated on that source alone (routing rates for the promoted-expert
    analysis); without it, per-source counts in the rankings' files are used.
    """
    if len(rankings) < 2:
        raise ScoresError("compare needs at least two rankings")
    labels = [r.label for r in rankings]
    if len(set(labels)) != len(labels):
        raise ScoresError(f"ranking labels must be unique: {labels}")
    items = [(r.label, r.scores) for r in rankings]
    items += [(f"per-source {k}", v) for k, v in (per_source or {}).items()]
    layers = _check_compatible(items)
    first = rankings[0].scores
    keep_count: KeepCount = keep_count_for_scores(
        first, sparsity=sparsity, num_experts_to_keep=keep, divisible_by=divisible_by
    )
    k = keep_count.keep
    n_group = group_limit(first.metadata.get("n_group"), first.metadata.get("topk_group"))
    num_layers, num_experts = len(layers), first.num_experts

    sal, masks, crit = _rank(rankings, layers, saliency, k, n_group)
    rates, rate_origin = routing_rates(rankings, per_source, layers)
    sources = list(rates)
    ranking_info = [_ranking_info(r, sal[r.label], masks[r.label], crit[r.label]) for r in rankings]
    pairs = _all_pairs(rankings, sal, masks, crit, rates, layers, k, num_experts, threshold)
    return {
        "keep": k,
        "keep_rule": {
            "requested": keep_count.requested,
            "adjustments": list(keep_count.adjustments),
            "sparsity": sparsity,
            "divisible_by": divisible_by,
            "n_group": n_group,
        },
        "num_experts": num_experts,
        "num_layers": num_layers,
        "layers": layers,
        "threshold": threshold,
        "rankings": ranking_info,
        "routing_sources": {s: rate_origin[s] for s in sources},
        "pairs": pairs,
    }


def _ranking_info(r: Ranking, sal: np.ndarray, mask: np.ndarray, criterion: str) -> dict:
    """One ranking's row: its corpus, tokens and the saliency mass its own plan keeps."""
    own = _mass(sal, mask)
    return {
        "label": r.label,
        "path": r.path,
        "corpus": r.corpus_label(),
        "kind": r.scores.kind,
        "saliency": criterion,
        "tokens": r.scores.source_tokens(),
        "total_tokens": r.scores.total_tokens(),
        "retained_mass": _mean(own),
        "retained_mass_per_layer": own,
    }


def _pair_change(x: Ranking, y: Ranking, crit: dict[str, str]) -> tuple[str, list[str]]:
    """What differs from ``x`` to ``y`` (criterion, corpora added), in words; and the corpora added."""
    added = sorted(y.corpus_parts() - x.corpus_parts())
    if crit[x.label] != crit[y.label] or KIND_CALIBRATION not in (x.scores.kind, y.scores.kind):
        change = f"{crit[x.label]} ({x.corpus_label()}) vs {crit[y.label]} ({y.corpus_label()})"
    elif added:
        change = f"+{'+'.join(added)}"
    elif x.corpus_parts() == y.corpus_parts():
        change = "more of the same corpus"
    else:
        change = f"{x.corpus_label()} -> {y.corpus_label()}"
    return change, added


def _compare_pair(x, y, sal, masks, crit, layers, k: int, num_experts: int) -> dict:
    """Flips and saliency mass between two rankings' plans; the promoted / demoted experts."""
    num_layers = len(layers)
    mx, my = masks[x.label], masks[y.label]
    promoted = my & ~mx
    demoted = mx & ~my
    flips_layer = promoted.sum(axis=1)
    flips = int(flips_layer.sum())
    mass = {
        "own_earlier": _mean(_mass(sal[x.label], mx)),
        "own_later": _mean(_mass(sal[y.label], my)),
        "earlier_saliency_under_later_plan": _mean(_mass(sal[x.label], my)),
        "later_saliency_under_earlier_plan": _mean(_mass(sal[y.label], mx)),
        "per_layer_own_earlier": _mass(sal[x.label], mx),
        "per_layer_own_later": _mass(sal[y.label], my),
    }
    change, added = _pair_change(x, y, crit)
    return {
        "earlier": x.label,
        "later": y.label,
        "consecutive": False,
        "change": change,
        "added_corpora": added,
        "tokens_added": _tokens_added(x, y),
        "flips": flips,
        "kept_slots": num_layers * k,
        "pct_of_kept_slots": 100.0 * flips / (num_layers * k),
        "changed_status": 2 * flips,
        "all_slots": num_layers * num_experts,
        "pct_of_all_slots": 100.0 * 2 * flips / (num_layers * num_experts),
        "flips_per_layer": flips_layer,
        "pct_per_layer": 100.0 * flips_layer / k,
        "mass": mass,
        "promoted": {name: np.nonzero(promoted[li])[0] for li, name in enumerate(layers)},
        "demoted": {name: np.nonzero(demoted[li])[0] for li, name in enumerate(layers)},
    }


def _pair_support(x: Ranking, promoted, demoted, rates: dict, layers: list[str]) -> dict:
    """Support of the promoted / demoted / all experts: in the earlier ranking's own counts
    (calibration files) and in each source's routing rate."""
    support = {}
    if x.scores.kind == KIND_CALIBRATION:
        cx = _stack({n: st["count"] for n, st in x.scores.layers.items()}, layers)
        support["earlier_count"] = {
            "promoted": _support_summary(cx, promoted),
            "demoted": _support_summary(cx, demoted),
            "all": _support_summary(cx, np.ones_like(promoted)),
        }
    for src in rates:
        support[f"rate@{src}"] = {
            "promoted": _support_summary(rates[src], promoted),
            "demoted": _support_summary(rates[src], demoted),
            "all": _support_summary(rates[src], np.ones_like(promoted)),
        }
    return support


def _pair_routing(rates: dict, promoted, demoted, threshold: float) -> list[dict]:
    """Per pair of sources (a, b): the share of promoted / demoted / all experts that b routes
    ``threshold`` x more often per token than a (and the reverse)."""
    routing = []
    for a, b in combinations(list(rates), 2):
        ratio = rate_ratio(rates[b], rates[a])  # rate_b / rate_a
        more_b = ratio >= threshold
        with np.errstate(divide="ignore"):
            more_a = ratio <= 1.0 / threshold
        allsel = np.ones_like(promoted)
        routing.append(
            {
                "a": a,
                "b": b,
                "threshold": threshold,
                "promoted_frac_more_by_b": _frac(more_b, promoted),
                "promoted_frac_more_by_a": _frac(more_a, promoted),
                "demoted_frac_more_by_b": _frac(more_b, demoted),
                "demoted_frac_more_by_a": _frac(more_a, demoted),
                "all_frac_more_by_b": _frac(more_b, allsel),
                "all_frac_more_by_a": _frac(more_a, allsel),
                "promoted_median_log2_ratio": (
                    float(np.median(np.log2(ratio[promoted & (ratio > 0) & np.isfinite(ratio)])))
                    if (promoted & (ratio > 0) & np.isfinite(ratio)).any()
                    else None
                ),
                "all_median_log2_ratio": (
                    float(np.median(np.log2(ratio[(ratio > 0) & np.isfinite(ratio)])))
                    if ((ratio > 0) & np.isfinite(ratio)).any()
                    else None
                ),
                "unrouted_by_both": int(np.isnan(ratio).sum()),
            }
        )
    return routing
