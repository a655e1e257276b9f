"""Synthetic scores for the scores/tiers/compare/CLI tests (no model, known answers).

``accumulate`` mimics the observer: for routed slots (token, expert) with gate weight
``g`` and output norm ``n`` it adds ``count``, ``sum_weight``, ``sum_norm``,
``sum_reap``, ``max_norm`` and ``count@source``. Values are dyadic rationals
(multiples of 1/16, small), so float64 sums are exact in any order and
``merge(en, zh) == joint(en + zh)`` can be checked with ``torch.equal``.
"""

from __future__ import annotations

import torch

from reap_modifier.scores import STAT_NAMES, ExpertScores

LAYERS = ["model.layers.1.mlp", "model.layers.2.mlp", "model.layers.3.mlp"]
META = {"model_class": "SynthMoeForCausalLM", "top_k": 2, "n_group": None, "topk_group": None}


def routing(num_tokens: int, num_experts: int, top_k: int, seed: int, prefer=None, bias=None):
    """Random top-k ids ``[N, k]`` (optionally biased toward ``prefer`` experts, or by a
    per-expert ``bias`` added to uniform logits), dyadic gate weights and norms."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.rand(num_tokens, num_experts, generator=g)
    if prefer is not None:
        logits[:, prefer] += 0.6
    if bias is not None:
        logits += torch.as_tensor(bias, dtype=logits.dtype)
    ids = logits.topk(top_k, dim=1).indices
    weights = torch.randint(1, 16, (num_tokens, top_k), generator=g).double() / 16
    norms = torch.randint(1, 64, (num_tokens, top_k), generator=g).double() / 16
    return ids, weights, norms


def accumulate(
    scores: ExpertScores | None,
    batches: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]],
    layers=LAYERS,
    num_experts: int = 8,
    metadata: dict | None = None,
) -> ExpertScores:
    """Add ``(source, ids, weights, norms)`` batches to every layer (same routing per
    layer, shifted by the layer index so layers differ)."""
    if scores is None:
        scores = ExpertScores.empty(
            layers, num_experts, {**META, **(metadata or {}), "num_moe_layers": len(layers)}
        )
        scores.metadata["tokens"] = {}
    for source, ids, weights, norms in batches:
        for li, (_layer, st) in enumerate(scores.layers.items()):
            flat = ((ids + li) % num_experts).reshape(-1)
            g, n = weights.reshape(-1), norms.reshape(-1)
            st["count"].index_add_(0, flat, torch.ones_like(g))
            st["sum_weight"].index_add_(0, flat, g)
            st["sum_norm"].index_add_(0, flat, n)
            st["sum_reap"].index_add_(0, flat, g * n)
            st["max_norm"].scatter_reduce_(0, flat, n, reduce="amax", include_self=True)
            key = f"count@{source}"
            st.setdefault(key, torch.zeros(num_experts, dtype=torch.float64))
            st[key].index_add_(0, flat, torch.ones_like(g))
        tokens = scores.metadata["tokens"]
        tokens[source] = tokens.get(source, 0) + int(ids.shape[0])
    return scores


def from_saliency(
    saliency: dict[str, list[float]],
    *,
    counts: dict[str, dict[str, list[float]]] | None = None,
    tokens: dict[str, int] | None = None,
    metadata: dict | None = None,
) -> ExpertScores:
    """Scores whose ``reap`` saliency is exactly ``saliency`` (count 1 -> mean = sum)
    unless ``counts`` (source -> layer -> per-expert counts) are given, in which case
    ``sum_reap = saliency * count`` keeps ``reap == saliency`` where count > 0."""
    layers = {}
    for layer, values in saliency.items():
        v = torch.tensor(values, dtype=torch.float64)
        st = {s: torch.zeros_like(v) for s in STAT_NAMES}
        if counts:
            total = torch.zeros_like(v)
            for src, per_layer in counts.items():
                c = torch.tensor(per_layer[layer], dtype=torch.float64)
                st[f"count@{src}"] = c
                total += c
        else:
            total = torch.ones_like(v)
        st["count"] = total
        st["sum_reap"] = v * total
        st["sum_weight"] = total * 0.5
        st["sum_norm"] = total * 2.0
        st["max_norm"] = torch.where(total > 0, torch.full_like(v, 3.0), torch.zeros_like(v))
        layers[layer] = st
    num_experts = len(next(iter(saliency.values())))
    meta = {
        **META,
        "num_experts": num_experts,
        "num_moe_layers": len(layers),
        "tokens": tokens or {"default": 1},
    }
    meta.update(metadata or {})
    return ExpertScores(layers=layers, metadata=meta).validate()


def big_scores(num_layers: int = 92, num_experts: int = 896, seed: int = 0) -> ExpertScores:
    """A K3-sized calibration file (92 x 896) with realistic-looking statistics."""
    g = torch.Generator().manual_seed(seed)
    names = [f"language_model.model.layers.{i + 1}.block_sparse_moe" for i in range(num_layers)]
    s = ExpertScores.empty(
        names,
        num_experts,
        {
            "model_class": "KimiK3ForConditionalGeneration",
            "top_k": 16,
            "n_group": 1,
            "topk_group": 1,
            "num_moe_layers": num_layers,
            "tokens": {"en": 1_420_000, "zh": 500_000},
        },
    )
    for st in s.layers.values():
        en = torch.poisson(torch.full((num_experts,), 25_000.0), generator=g)
        zh = torch.poisson(
            torch.full((num_experts,), 9_000.0) * torch.rand(num_experts, generator=g) * 2,
            generator=g,
        )
        count = (en + zh).double()
        st["count"] = count
        st["count@en"] = en.double()
        st["count@zh"] = zh.double()
        st["sum_weight"] = count * 0.1
        st["sum_norm"] = count * (1 + torch.rand(num_experts, generator=g, dtype=torch.float64))
        lognormal = torch.exp(0.8 * torch.randn(num_experts, generator=g, dtype=torch.float64))
        st["sum_reap"] = st["sum_norm"] * 0.1 * lognormal
        st["max_norm"] = torch.full((num_experts,), 5.0, dtype=torch.float64)
    return s.validate()
