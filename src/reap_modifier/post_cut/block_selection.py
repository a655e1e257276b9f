"""Expert selection by the block's own output error: which experts to keep so that the
pruned MoE block, re-routed as the model routes it, best reproduces the unpruned block.

REAP ranks experts one at a time by a saliency (mean gate x output norm). This module
instead judges whole kept sets ``S`` by what the cut does to the block. For one MoE
layer, its calibration inputs ``X`` and the unpruned block's outputs ``Y`` on them:

    err(S) = sum_t ||B_S(x_t) - y_t||^2 / sum_t ||y_t||^2

where ``B_S`` is the block with the experts outside ``S`` removed and the router
re-routing among ``S`` exactly as the pruned model will: choice scores (sigmoid or
softmax over the kept experts, plus ``e_score_correction_bias``), group-limited top-k,
the top-k among the kept, weights recomputed from the scores (renormalised over the
selected, times the routed scaling factor); shared experts and latent projections as
they are. With per-token ``groups`` (e.g. a language label) the objective is the worst
group's error, ``max_g err_g(S)``, so no language is sacrificed for the pooled mean.

Search: greedy backward elimination. From all ``E`` experts, each step tries dropping
each of ``C`` candidates (the ``C`` lowest in ``ranking`` among the still-kept; all of
them without a ranking) and drops the ``d`` whose removal raises the objective least,
until ``keep`` remain; a group-limited router keeps ``keep / n_group`` in every group.

Evaluation without expert forwards: the block output is linear in the routed experts'
contributions, ``B_S(x) = base(x) + sum_k w_k g_{e_k}(x)`` (``g_e``: expert ``e``'s
output with weight 1, after the latent up-projection), so with ``r = y - base(x)``

    ||B_S(x) - y||^2 = w^T G w - 2 w^T b + ||r||^2,   G_ij = <g_i, g_j>,  b_i = <g_i, r>

Each token's expert contributions are cached once, with their Gram matrix ``G`` and
``b``: at first the experts of the token's unpruned top-k plus the next ``extra_slots``
by choice score; an expert a kept set routes a token to that is not cached yet is
computed when first needed (``record.expert_calls`` counts (token, expert) forwards).
One evaluation of a kept set is then the routing on the cached router logits,
``O(N E)``, and a ``k x k`` quadratic form per token, ``O(N k^2)``: no expert forward
and nothing of size ``hidden``. Evaluations are batched (``batch`` kept sets at once).

Single drops are cheaper still where a drop is local (sigmoid routers; softmax routers
that renormalise without a bias): dropping ``e`` re-routes only the tokens routed to
``e`` (group-limited: also those holding ``e`` among a group's top 2), the others keep
their error.

Cost (``N`` tokens, ``k`` top-k, ``S`` cached slots per token, ``H`` hidden):
``steps = ceil((E - keep) / d)``; evaluations (kept sets judged)
``= sum_s min(C, eligible_s) + [d > 1] * steps + 1``, about ``C (E - keep) / d`` when ``C``
is below the kept count (without ``C``: ``sum_s (E - s d)``, about
``(E^2 - keep^2) / (2 d)``). A step costs ``O(N k E)`` routing for local routers (about
``N k`` re-routed tokens when every kept expert is tried, fewer with ``C``) plus
``O(N k^3)`` quadratic forms, else ``O(C N (E + k^2))``. Set-up: ``N S`` expert forwards
(plus misses, ``record.expert_calls``) and ``O(N S^2 H)`` for the Gram matrices; memory
``N S H`` float32. Kimi K3 (E 896 -> keep 448, k 16, C 64, d 8): 56 steps, 3,641
evaluations; measured in ``benchmarks/selection_cost.py``, see ``docs/selection.md``.

Routers it knows (others are refused, say so, and keep REAP's selection): llm-compressor's
``KimiMoEGate`` (sigmoid or softmax, bias, groups, renormalise, scaling; latent MoE without
``latent_moe_use_norm``), transformers' ``DeepseekV3TopkRouter`` and
``Qwen3MoeTopKRouter``. Before searching, the evaluator checks that its routing
reproduces ``targets`` for the full set (relative error below ``1e-4``), so a router this
module models wrongly, or targets that are not this block's outputs, fail loudly.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from ..models import MoELayer
from .block_fit import check_rows
from .dispatch import block_tensor, contributions, dispatch_input, routed_off
from .errors import BlockSelectionError
from .routing import RoutingRule, route, selection_rule

__all__ = ["BlockErrorEvaluator", "BlockSelectionRecord", "select_by_block_error"]

#: largest relative error of the full set tolerated by the evaluator's self-check
SELF_CHECK_TOLERANCE = 1e-4


def _drop_is_local(rule: RoutingRule) -> bool:
    """Whether dropping expert ``e`` changes the routing only of the tokens that route to
    ``e`` (or, group-limited, have ``e`` among a group's top 2): true unless the scores
    are a softmax over the kept experts whose denominator reaches every token (no
    renormalisation, or a bias added to the softmax for the choice)."""
    return rule.activation == "sigmoid" or (rule.bias is None and rule.renormalize)


def _block_base(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), routed_off(layer):
        return block_tensor(layer.block(x.unsqueeze(0))).reshape(x.shape[0], -1)


class BlockErrorEvaluator:
    """Relative output error of ``layer`` under many kept sets, from cached contributions.

    :param inputs: ``[N, H]`` block inputs (tokens, no padding)
    :param targets: ``[N, H]`` the unpruned block's outputs on ``inputs``
    :param groups: ``[N]`` integer label per token (``None``: one group)
    :param extra_slots: experts cached per token beyond its unpruned top-k
    """

    def __init__(
        self,
        layer: MoELayer,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        groups: torch.Tensor | None = None,
        *,
        extra_slots: int = 8,
        batch: int | None = None,
    ) -> None:
        self.layer, self.rule = layer, selection_rule(layer)
        weight = layer.router_weight().detach()
        E = int(weight.shape[0])
        _check_inputs(layer, inputs, targets, groups)
        self.E, self.N = E, int(inputs.shape[0])
        self.x = inputs.detach()
        self.h = dispatch_input(layer, self.x)
        self.logits = self.x.float() @ weight.float().t()
        labels = groups if groups is not None else torch.zeros(self.N, dtype=torch.long)
        self.group_ids, self.group_of = torch.unique(labels.long(), return_inverse=True)
        y = targets.detach().double()
        r = y - _block_base(layer, self.x).double()
        self.rr = r.pow(2).sum(-1)
        self.r = r.float()
        self.yy_group = torch.zeros(len(self.group_ids), dtype=torch.float64).index_add_(
            0, self.group_of, y.pow(2).sum(-1)
        )
        k = self.rule.top_k
        self.batch = batch or max(1, (1 << 24) // max(1, self.N * E))
        slots = k + extra_slots
        self.g = torch.zeros(self.N, slots, self.r.shape[1])
        self.G = torch.zeros(self.N, slots, slots, dtype=torch.float64)
        self.b = torch.zeros(self.N, slots, dtype=torch.float64)
        self.slot_of = torch.full((self.N, E), -1, dtype=torch.long)
        self.used = torch.zeros(self.N, dtype=torch.long)
        self.evaluations = 0
        self.expert_calls = 0
        full = torch.ones(1, E, dtype=torch.bool)
        ids, _ = route(self.rule, self.logits[None], full[:, None, :])
        nearest = self._choice().topk(min(E, slots), dim=-1).indices
        cand = torch.cat([ids[0], nearest], dim=1)
        tok = torch.arange(self.N)[:, None].expand_as(cand)
        self._ensure(tok.reshape(-1), cand.reshape(-1))
        self.full_error = float(self.errors(full).max())
        if self.full_error > SELF_CHECK_TOLERANCE:
            raise BlockSelectionError(
                f"{layer.name}: with every expert kept the evaluator's error is "
                f"{self.full_error:.3g}, not ~0: targets are not this block's outputs on "
                "inputs, or its router does not route as the rule for "
                f"{type(layer.router).__name__} says"
            )
        self.evaluations = 0

    def _grow(self, slots: int) -> None:
        old = self.g.shape[1]
        pad = slots - old
        self.g = torch.cat([self.g, self.g.new_zeros(self.N, pad, self.g.shape[2])], dim=1)
        G = self.G.new_zeros(self.N, slots, slots)
        G[:, :old, :old] = self.G
        self.G = G
        self.b = torch.cat([self.b, self.b.new_zeros(self.N, pad)], dim=1)

    def _ensure(self, tok: torch.Tensor, exp: torch.Tensor) -> None:
        """Cache the contributions of the (token, expert) pairs not cached yet."""
        key = torch.unique(tok * self.E + exp)
        tok, exp = key // self.E, key % self.E
        new = self.slot_of[tok, exp] < 0
        tok, exp = tok[new], exp[new]
        if tok.numel() == 0:
            return
        counts = torch.bincount(tok, minlength=self.N)
        start = torch.cumsum(counts, 0) - counts
        slot = self.used[tok] + torch.arange(tok.numel()) - start[tok]  # tok is sorted
        if int(slot.max()) >= self.g.shape[1]:
            self._grow(int(slot.max()) + 1 + self.rule.top_k)
        out = contributions(self.layer, self.h[tok], exp).float()
        self.expert_calls += int(tok.numel())
        self.g[tok, slot] = out
        self.slot_of[tok, exp] = slot
        self.used += counts
        chunk = max(1, (1 << 25) // (self.g.shape[1] * self.g.shape[2]))
        for i in range(0, tok.numel(), chunk):
            t, s, o = tok[i : i + chunk], slot[i : i + chunk], out[i : i + chunk]
            dots = torch.einsum("psh,ph->ps", self.g[t], o).double()
            self.G[t, s, :] = dots
            self.G[t, :, s] = dots
            self.b[t, s] = (o * self.r[t]).sum(-1).double()

    def _quadratic(self, tok: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``||sum_k w_k g_{ids_k} - r||^2`` of tokens ``tok`` routed to ``ids`` with ``w``
        (all ``[..., N or P, k]``), caching the contributions it does not hold yet."""
        pos = self.slot_of[tok, ids]
        if (pos < 0).any():
            miss = pos < 0
            self._ensure(tok[miss], ids[miss])
            pos = self.slot_of[tok, ids]
        # the error is w^T G[pos, pos] w - 2 w^T b[pos] + ||r||^2 on the token's slots
        rows, S = tok[..., 0], self.G.shape[1]
        at = rows[..., None] * S + pos  # [..., k] into b, and rows of G
        Gs = self.G.view(-1).take(at[..., :, None] * S + pos[..., None, :])  # [..., k, k]
        w = w.double()
        quad = (torch.matmul(Gs, w.unsqueeze(-1)).squeeze(-1) * w).sum(-1)
        lin = (w * self.b.view(-1).take(at)).sum(-1)
        return (quad - 2 * lin + self.rr[rows]).clamp_min(0.0)

    def drop_errors(self, kept: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """``[C, G]`` errors of ``kept`` (``[E]`` bool) with each of ``candidates`` dropped.

        For routers whose drop is local (:func:`_drop_is_local`) only the tokens whose
        routing the drop can change are re-routed: those routed to the candidate, or,
        group-limited, holding it among a group's top 2; the others keep their error."""
        if not _drop_is_local(self.rule):
            trial = kept[None].repeat(candidates.numel(), 1)
            trial[torch.arange(candidates.numel()), candidates] = False
            return self.errors(trial)
        ids, w = route(self.rule, self.logits, kept)
        tok = torch.arange(self.N)[:, None].expand_as(ids)
        current = self._quadratic(tok, ids, w)  # [N]
        touched = ids
        if self.rule.n_group > 1:
            choice = self._choice().masked_fill(~kept, float("-inf"))
            size = self.E // self.rule.n_group
            top2 = choice.view(self.N, self.rule.n_group, size).topk(2, dim=-1).indices
            top2 = top2 + torch.arange(self.rule.n_group)[None, :, None] * size
            touched = torch.cat([ids, top2.reshape(self.N, -1)], dim=1)
        hit = (touched[:, :, None] == candidates[None, None, :]).any(dim=1)  # [N, C]
        t_idx, c_idx = hit.nonzero(as_tuple=True)
        G = len(self.group_ids)
        delta = torch.zeros(candidates.numel() * G, dtype=torch.float64)
        if self.rule.n_group == 1:
            # a flat router sends a token that loses an expert to its next kept one: the
            # top-(k + 1) among the kept, less the dropped expert
            k = self.rule.top_k
            following = self._choice().masked_fill(~kept, float("-inf")).topk(k + 1).indices
        chunk = max(1, (1 << 22) // self.E)
        for i in range(0, t_idx.numel(), chunk):
            t, c = t_idx[i : i + chunk], c_idx[i : i + chunk]
            if self.rule.n_group == 1:
                row = following[t]
                p_ids = row[row != candidates[c][:, None]].view(-1, k)
                p_w = self._weights(t, p_ids)
            else:
                trial = kept[None].repeat(t.numel(), 1)
                trial[torch.arange(t.numel()), candidates[c]] = False
                p_ids, p_w = route(self.rule, self.logits[t], trial)
            err = self._quadratic(t[:, None].expand_as(p_ids), p_ids, p_w)
            delta.index_add_(0, c * G + self.group_of[t], err - current[t])
        base = current.new_zeros(G).index_add_(0, self.group_of, current)
        self.evaluations += int(candidates.numel())
        return (base[None] + delta.view(-1, G)) / self.yy_group.clamp_min(1e-30)

    def _weights(self, tok: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Routing weights of tokens ``tok`` sent to ``ids`` ``[P, k]`` by a router whose drop
        is local (sigmoid; or softmax renormalised over the selected, so the kept set's
        denominator cancels)."""
        logits = self.logits[tok].gather(-1, ids)
        if self.rule.activation == "softmax":
            return torch.softmax(logits, dim=-1) * self.rule.scaling
        w = logits.sigmoid()
        if self.rule.renormalize:
            w = w / (w.sum(dim=-1, keepdim=True) + self.rule.renorm_eps)
        return w * self.rule.scaling

    def _choice(self) -> torch.Tensor:
        """``[N, E]`` choice scores of the unpruned router (sigmoid scores + bias)."""
        scores = self.logits.sigmoid() if self.rule.activation == "sigmoid" else self.logits
        return scores + (self.rule.bias if self.rule.bias is not None else 0.0)

    def token_errors(self, kept: torch.Tensor) -> torch.Tensor:
        """``[B, N]`` squared output error per token for kept sets ``kept`` ``[B, E]``."""
        out = []
        for i in range(0, kept.shape[0], self.batch):
            ids, w = route(self.rule, self.logits[None], kept[i : i + self.batch, None, :])
            tok = torch.arange(self.N)[None, :, None].expand_as(ids)
            out.append(self._quadratic(tok, ids, w))
            self.evaluations += int(ids.shape[0])
        return torch.cat(out)

    def errors(self, kept: torch.Tensor) -> torch.Tensor:
        """``[B, G]`` relative squared error of each group (columns: ``group_ids``)."""
        tok = self.token_errors(kept)
        per = tok.new_zeros(tok.shape[0], len(self.group_ids)).index_add_(1, self.group_of, tok)
        return per / self.yy_group.clamp_min(1e-30)


@dataclass
class BlockSelectionRecord:
    """What one layer's selection did (errors: relative squared errors on its tokens)."""

    kept: list[int]
    steps: list[dict] = field(default_factory=list)  # {"dropped": [...], "objective": x}
    objective: float = 0.0  # worst group's error of the kept set
    group_errors: dict[int, float] = field(default_factory=dict)
    evaluations: int = 0
    expert_calls: int = 0
    seconds: float = 0.0
    setup_seconds: float = 0.0  # of ``seconds``: the cache and its Gram matrices
    #: the objective of ``baseline`` (``None``: none given)
    baseline_objective: float | None = None
    #: the search's own set's objective (``objective`` is the baseline's when it was kept)
    search_objective: float = 0.0
    #: ``baseline`` was kept: the search found no lower objective
    kept_baseline: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def _check_inputs(layer, inputs, targets, groups) -> None:
    check_rows(layer.name, inputs, targets, 1, BlockSelectionError)
    if groups is not None and tuple(groups.shape) != (inputs.shape[0],):
        raise BlockSelectionError(
            f"{layer.name}: groups {tuple(groups.shape)} must hold one label per token "
            f"([{inputs.shape[0]}])"
        )


def _check_keep(layer, rule: RoutingRule, keep: int, num_experts: int) -> None:
    if not rule.top_k <= keep <= num_experts:
        raise BlockSelectionError(
            f"{layer.name}: keep={keep} must be in [top_k={rule.top_k}, {num_experts}]"
        )
    groups = rule.limited_groups
    if groups and keep % groups:
        raise BlockSelectionError(
            f"{layer.name}: keep={keep} is not a multiple of n_group={groups}; the group-limited "
            "router needs an equal count per group (take keep from the keep-count rule)"
        )
    if rule.n_group > 1:
        per = keep // rule.n_group
        if per < 2 or per * rule.topk_group < rule.top_k:
            raise BlockSelectionError(
                f"{layer.name}: keep={keep} leaves {per} experts in each of {rule.n_group} "
                f"groups; the router scores groups by their top 2 and picks "
                f"topk_group={rule.topk_group}, so fewer than top_k={rule.top_k} would be "
                "reachable; keep more experts"
            )


def select_by_block_error(
    layer: MoELayer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    keep: int,
    *,
    ranking: torch.Tensor | None = None,
    groups: torch.Tensor | None = None,
    candidates: int | None = None,
    drops_per_step: int = 1,
    extra_slots: int = 8,
    batch: int | None = None,
    baseline: list[int] | None = None,
) -> tuple[list[int], BlockSelectionRecord]:
    """Keep the ``keep`` experts of ``layer`` chosen by greedy backward elimination on the
    block's re-routed output error (worst group's with ``groups``).

    :param inputs: ``[N, H]`` the layer's calibration inputs (no padding rows)
    :param targets: ``[N, H]`` the unpruned block's outputs on ``inputs``
    :param keep: experts to keep (from the keep-count rule; a multiple of ``n_group`` for
        group-limited routers)
    :param ranking: ``[E]`` a saliency (e.g. REAP's); with ``candidates`` only the
        ``candidates`` lowest-ranked kept experts are tried per step
    :param groups: ``[N]`` integer label per token; the objective is the worst group's error
    :param candidates: experts tried per step (``None``: every eligible kept expert)
    :param drops_per_step: experts dropped per step (the best ``d`` of one step's trials)
    :param baseline: ``keep`` expert ids (e.g. the ranking's own cut) kept instead of the
        search's set when the search's objective is not lower (greedy elimination is no
        optimum: the search is never worse than the cut it improves on)
    :returns: ascending kept ids and the record
    :raises BlockSelectionError: unsupported router, bad shapes or ``keep``
    """
    t0 = time.perf_counter()
    rule = selection_rule(layer)
    E = int(layer.router_weight().shape[0])
    _check_inputs(layer, inputs, targets, groups)
    _check_keep(layer, rule, keep, E)
    if ranking is not None and tuple(ranking.shape) != (E,):
        raise BlockSelectionError(f"{layer.name}: ranking {tuple(ranking.shape)} must be [{E}]")
    if candidates is not None and candidates < 1 or drops_per_step < 1:
        raise BlockSelectionError("candidates and drops_per_step must be >= 1")
    ev = BlockErrorEvaluator(layer, inputs, targets, groups, extra_slots=extra_slots, batch=batch)
    n_group = rule.limited_groups or 1
    group_of_expert = torch.arange(E) // (E // n_group)
    per_group = keep // n_group
    kept = torch.ones(E, dtype=torch.bool)
    order_key = ranking.double() if ranking is not None else torch.zeros(E, dtype=torch.float64)
    record = BlockSelectionRecord(kept=[], setup_seconds=time.perf_counter() - t0)
    while int(kept.sum()) > keep:
        counts = torch.bincount(group_of_expert[kept], minlength=n_group)
        eligible = kept & (counts[group_of_expert] > per_group)
        ids = eligible.nonzero().flatten()
        ids = ids[torch.sort(order_key[ids], stable=True).indices]
        if candidates is not None:
            ids = ids[:candidates]
        objective = ev.drop_errors(kept, ids).max(dim=1).values
        d = min(drops_per_step, int(kept.sum()) - keep)
        dropped: list[int] = []
        for j in torch.sort(objective, stable=True).indices.tolist():
            e = int(ids[j])
            if counts[group_of_expert[e]] > per_group:
                dropped.append(e)
                counts[group_of_expert[e]] -= 1
                if len(dropped) == d:
                    break
        kept[dropped] = False
        if len(dropped) == 1:
            value = float(objective[torch.sort(objective, stable=True).indices[0]])
        else:
            value = float(ev.errors(kept[None]).max())
        record.steps.append({"dropped": sorted(dropped), "objective": value})
    final = ev.errors(kept[None])[0]
    record.search_objective = float(final.max())
    if baseline is not None:
        base = torch.zeros(E, dtype=torch.bool)
        base[list(baseline)] = True
        if int(base.sum()) != keep:
            raise BlockSelectionError(f"{layer.name}: baseline must hold {keep} distinct experts")
        base_errors = ev.errors(base[None])[0]
        record.baseline_objective = float(base_errors.max())
        if record.baseline_objective <= record.search_objective:
            kept, final, record.kept_baseline = base, base_errors, True
    record.kept = kept.nonzero().flatten().tolist()
    record.objective = float(final.max())
    record.group_errors = {int(g): float(v) for g, v in zip(ev.group_ids, final)}
    record.evaluations, record.expert_calls = ev.evaluations, ev.expert_calls
    record.seconds = time.perf_counter() - t0
    return record.kept, record
