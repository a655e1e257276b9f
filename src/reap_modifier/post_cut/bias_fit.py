"""Score-correction bias fit after a cut: move the kept experts' ``e_score_correction_bias``
so that the pruned block reproduces the unpruned block's output.

In DeepSeek-V3, GLM-4.5 and Kimi K3 routers the bias only moves the top-k *selection*
(``scores + bias`` choose, the weights come from ``scores`` alone), so the router fit
(:mod:`reap_modifier.post_cut.router_fit`) gives it no gradient and leaves it as the cut left it.
This module fits it on the same data and the same loss, the layer-local relative squared
error of the block output against the unpruned block's (:func:`router_fit.relative_error`),
with the same held-out early stopping (every ``HOLDOUT_EVERY``-th token held out; the bias
with the lowest held-out loss is returned, the cut's bias when nothing lowers it).

Method: greedy coordinate search. For each expert in turn, a few candidate moves of its
bias are tried at once: up by the amounts that bring ``1/16, 1/4, 1`` of the mean expert
load of new tokens into its top-k (read from the tokens' margins to the top-k boundary),
and down by the amounts that send as many of its tokens to their next-best expert. A
candidate is evaluated exactly, but only on the tokens whose selection it changes: the
selection is recomputed from the cached router scores for every fitting token, and the
block's own forward runs on the changed tokens only, with the routed dispatch swapped for
one that reuses the cached per-(token, slot) expert outputs and computes the newly selected
ones (one new expert per changed token, all candidates of one expert in one call). The
best candidate is kept when it lowers the fitting loss, and the same expert is tried again
from there (``REPEATS`` times at most); the held-out loss is updated the same way after
every kept move. Without groups only the tokens whose boundary value a move crosses can
change, so candidates are routed and evaluated on those alone. Sweeps over all experts repeat until none moves or
``sweeps`` is reached. The selection rule (sigmoid / softmax scores, ``+ bias``, grouped
top-k by the sum of each group's two best, top-k, weights gathered from the scores,
renormalised, scaled) is checked against the router's own choice on every fitting token
before the search starts; the losses reported are computed with the block's own router
and forward.

Why coordinate search and not a straight-through estimator (measured on tiny models and
the bundled model, ``benchmarks/bias_fit_methods.py``): docs/router-calibration.md.

Cost (E experts kept, top-k, N tokens; one block evaluation = the block's forward on the
N tokens): a sweep tries ``2 * (1/16 + 1/4 + 1) * N k / E`` token changes per expert
candidate batch, about ``2.6 N k`` token rows through the block per sweep (more with the
repeats, fewer as experts stop moving); each row needs one new expert output (the other
``k - 1`` slots are reused) plus the block's dense part on that row (router, latent
projections, shared experts). At K3's widths (hidden 7168, latent 3584, expert width
2048, one shared expert) a row costs about 0.27 of a token's full block compute.
Measured at K3's routing shape (``benchmarks/bias_fit_cost.py``: 896 -> 448 experts,
top-16, N = 2048, widths reduced): 4 sweeps ran 123 N token rows through the block and
computed 7.7 N k new expert outputs, i.e. about 33 block evaluations of K3-width compute
per layer (the router fit: 100 Adam steps of one forward and backward each); held-out
error 0.868 -> 0.842 (random layer and inputs). Wall-clock on a shared CPU at the reduced
widths: 127 s, 370 forwards of that block (there the per-candidate Python and the
model's per-expert dispatch loop dominate, not the arithmetic).
Memory: the ``[N, E]`` scores, the ``[N, k, latent]`` per-slot outputs, and per candidate
batch ``[candidates, reachable tokens, E]``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..models import MoELayer
from .block_fit import (
    ExpertCache,
    FitLosses,
    check_rows,
    differentiable_dispatch,
    holdout_rows,
    relative_error,
    trainable,
)
from .dispatch import block_tensor, one_slot, routed_dispatch
from .errors import BiasFitError
from .router_fit import router_fit_problem
from .routing import BIAS_ATTR, read_rule, route_scores, router_scores

__all__ = [
    "BIAS_ATTR",
    "FIT_METHOD",
    "BiasFitError",
    "BiasFitResult",
    "bias_fit_problem",
    "fit_bias",
]

FIT_METHOD = "coordinate-search-layer-local"
#: candidate moves per expert, as fractions of the mean expert load (tokens brought in
#: by a move up, sent away by a move down)
LOAD_FRACTIONS = (1 / 16, 1 / 4, 1.0)
#: moves of one expert in a row (each from where the last one left it) before the next
REPEATS = 8


@dataclass
class BiasFitResult(FitLosses):
    """What one layer's bias fit did (losses are relative squared errors).

    ``block_rows`` counts the token rows run through the block (candidates and kept moves;
    the before/after evaluations excluded) and ``expert_rows`` the expert outputs newly
    computed for them; divide by ``N`` resp. ``N * top_k`` for block evaluations."""

    tokens: int
    sweeps: int
    candidates: int
    moves: int
    best_move: int
    block_rows: int
    expert_rows: int


def bias_fit_problem(layer: MoELayer) -> str | None:
    """Why the bias fit cannot express ``layer``'s router, or ``None`` when it can."""
    router = layer.router
    bias = getattr(router, BIAS_ATTR, None)
    if not isinstance(bias, torch.Tensor):
        if isinstance(getattr(layer.block, BIAS_ATTR, None), torch.Tensor):
            return f"{layer.name}: the score-correction bias sits on the block, not the router"
        return f"{layer.name}: router {type(router).__name__} has no `{BIAS_ATTR}`"
    problem = router_fit_problem(layer)
    if problem is not None:
        return problem
    if not bias.is_floating_point():
        return f"{layer.name}: `{BIAS_ATTR}` is {bias.dtype}; the fit needs a floating-point bias"
    if bias.shape != (router.weight.shape[0],):
        return (
            f"{layer.name}: `{BIAS_ATTR}` has shape {tuple(bias.shape)}, not one entry per "
            f"router row ({router.weight.shape[0]})"
        )
    if not hasattr(router, "top_k"):
        return f"{layer.name}: router {type(router).__name__} has no `top_k`"
    rule = read_rule(router)
    if rule.activation not in ("sigmoid", "softmax"):
        return f"{layer.name}: router activation {rule.activation!r} is not sigmoid or softmax"
    if router.weight.shape[0] % rule.n_group:
        return f"{layer.name}: {router.weight.shape[0]} experts do not split into {rule.n_group} groups"
    return None


@contextmanager
def _with_bias(layer: MoELayer, bias: torch.Tensor) -> Iterator[None]:
    """The block routes through a copy of its router holding ``bias`` (the router itself
    is never touched)."""
    with trainable(layer, {layer.router_attr: []}):
        proxy = layer.block._modules[layer.router_attr]
        store = proxy._parameters if BIAS_ATTR in proxy._parameters else proxy._buffers
        store[BIAS_ATTR] = bias
        yield


def _sorted(ids: torch.Tensor) -> torch.Tensor:
    return ids.sort(dim=-1)[0]


class _TokenSet:
    """The fast evaluator of one token set: its scores, current selection, per-(token,
    slot) expert outputs, block outputs and per-token squared errors."""

    def __init__(self, layer, rule, x, y, bias):
        self.layer, self.rule, self.x, self.y = layer, rule, x, y
        self.scores = router_scores(layer.router, x, rule)
        self.denominator = y.float().pow(2).sum().clamp_min(1e-30).item()
        self.one_slot = one_slot(layer)
        self.block_rows = 0
        self.expert_rows = 0
        ids, weights = route_scores(self.scores, bias, rule)
        seen = {}

        def record(h, r_ids, r_weights):
            seen["ids"], seen["weights"] = r_ids, r_weights
            return self._mix(h, torch.arange(x.shape[0]), ids, weights, None, None)

        # the router's own choice on these tokens, against the rule replicated here
        with torch.no_grad(), routed_dispatch(layer, record):
            out = block_tensor(layer.block(x.unsqueeze(0))).reshape(y.shape)
        r_ids, r_weights = seen["ids"], seen["weights"]
        order, r_order = ids.argsort(dim=-1), r_ids.argsort(dim=-1)
        if not torch.equal(ids.gather(-1, order), r_ids.gather(-1, r_order)) or not torch.allclose(
            weights.gather(-1, order), r_weights.float().gather(-1, r_order), rtol=1e-4, atol=1e-6
        ):
            raise BiasFitError(
                f"{layer.name}: the router's top-k choice differs from the DeepSeek-V3 rule "
                f"{rule}; the bias fit does not support this router"
            )
        self.ids, self.weights, self.slots = ids, weights, self._new_slots
        self.err = (out.float() - y.float()).pow(2).sum(dim=-1)
        self.block_rows = self.expert_rows = 0  # the search's own work from here on

    def loss(self) -> float:
        return self.err.sum().item() / self.denominator

    def _mix(self, h, tokens, ids, weights, cur_ids, cur_slots):
        """``sum_k w_k f_{ids_k}(h)`` per row; per-slot outputs reused from the current
        selection of the row's token where it holds the same expert."""
        R, k = ids.shape
        slots = None
        if cur_ids is not None:
            match = ids.unsqueeze(-1) == cur_ids[tokens].unsqueeze(-2)  # [R, k, k]
            found = match.any(dim=-1)
            where = match.float().argmax(dim=-1)
            slots = cur_slots[tokens.unsqueeze(-1), where]  # [R, k, h]
        else:
            found = torch.zeros(R, k, dtype=torch.bool, device=ids.device)
        missing = (~found).nonzero()
        if missing.shape[0]:
            ones = torch.ones(missing.shape[0], 1, dtype=torch.float32, device=h.device)
            new = self.one_slot(h[missing[:, 0]], ids[missing[:, 0], missing[:, 1], None], ones)
            if slots is None:
                slots = new.new_zeros(R, k, new.shape[-1])
            slots[missing[:, 0], missing[:, 1]] = new.to(slots.dtype)
            self.expert_rows += int(missing.shape[0])
        self._new_slots = slots
        return (slots.to(weights.dtype) * weights.unsqueeze(-1)).sum(dim=1).to(h.dtype)

    def try_biases(self, biases: torch.Tensor, rows: torch.Tensor | None = None):
        """Evaluate candidate biases ``[C, E]``: per candidate the change of the summed
        squared error and what a move to it would write (rows, ids, weights, slots, err).
        ``rows``: the only tokens whose selection the candidates can change (all if None)."""
        scores, current = (
            (self.scores, self.ids) if rows is None else (self.scores[rows], self.ids[rows])
        )
        ids, weights = route_scores(scores, biases, self.rule)  # [C, n, k]
        changed = (_sorted(ids) != _sorted(current).unsqueeze(0)).any(dim=-1)  # [C, n]
        cand, local = changed.nonzero(as_tuple=True)
        new_ids, new_weights = ids[cand, local], weights[cand, local]
        tokens = local if rows is None else rows[local]
        if tokens.numel() == 0:
            return [None] * biases.shape[0]
        out = self._block_rows(tokens, new_ids, new_weights)
        err = (out.float() - self.y[tokens].float()).pow(2).sum(dim=-1)
        delta = err.new_zeros(biases.shape[0]).index_add_(0, cand, err - self.err[tokens])
        slots = self._new_slots
        results = []
        for c in range(biases.shape[0]):
            rows = (cand == c).nonzero().flatten()
            if rows.numel() == 0:
                results.append(None)
                continue
            results.append(
                (
                    delta[c].item(),
                    tokens[rows],
                    new_ids[rows],
                    new_weights[rows],
                    slots[rows],
                    err[rows],
                )
            )
        return results

    def _block_rows(self, tokens, ids, weights):
        def dispatch(h, _ids, _weights):
            return self._mix(h, tokens, ids, weights, self.ids, self.slots)

        self.block_rows += int(tokens.numel())
        with torch.no_grad(), routed_dispatch(self.layer, dispatch):
            return block_tensor(self.layer.block(self.x[tokens].unsqueeze(0))).reshape(
                tokens.shape[0], -1
            )

    def commit(self, move) -> None:
        _, tokens, ids, weights, slots, err = move
        self.ids[tokens], self.weights[tokens] = ids, weights
        self.slots[tokens] = slots.to(self.slots.dtype)
        self.err[tokens] = err

    def move_to(self, bias: torch.Tensor, before: torch.Tensor, expert: int) -> None:
        """Follow a kept move of ``expert``'s bias from ``before`` (the held-out set)."""
        step = (bias[expert] - before[expert]).item()
        rows = _reachable(self, before, expert, min(step, 0.0), max(step, 0.0))
        move = self.try_biases(bias.unsqueeze(0), rows)[0]
        if move is not None:
            self.commit(move)


def _boundaries(state: _TokenSet, bias: torch.Tensor):
    """``scores + bias`` and, per token, the selection mask, the lowest selected and the
    highest unselected value."""
    choice = state.scores + bias
    selected = torch.zeros_like(choice, dtype=torch.bool).scatter_(-1, state.ids, True)
    inside = choice.masked_fill(~selected, float("inf")).min(dim=-1)[0]
    outside = choice.masked_fill(selected, float("-inf")).max(dim=-1)[0]
    return choice, selected, inside, outside


def _reachable(state, bias, expert, low, high, bounds=None) -> torch.Tensor | None:
    """The tokens whose selection can change when ``expert``'s bias moves by a step in
    ``[low, high]`` (``low <= 0 <= high``): without groups, an unselected expert enters
    only past the lowest selected value and a selected one leaves only below the highest
    unselected one; with groups (a group's score moves with its members) every token."""
    if state.rule.masks_groups:
        return None
    choice, selected, inside, outside = bounds or _boundaries(state, bias)
    mine, value = selected[:, expert], choice[:, expert]
    slack = 1e-6 * (1 + value.abs())
    near = (~mine & (value + high >= inside - slack)) | (mine & (value + low <= outside + slack))
    return near.nonzero().flatten()


def _candidates(state: _TokenSet, bias: torch.Tensor, expert: int, dtype):
    """Candidate biases ``[C, E]`` moving ``expert``'s entry (see the module docstring)
    and the tokens whose selection they can change (``None``: all)."""
    bounds = _boundaries(state, bias)
    choice, selected, inside, outside = bounds
    mine = selected[:, expert]
    load = state.x.shape[0] * state.rule.top_k / choice.shape[-1]
    counts = sorted({max(1, round(f * load)) for f in LOAD_FRACTIONS})
    steps = []
    for sign, margin in (
        (1.0, inside[~mine] - choice[~mine, expert]),
        (-1.0, choice[mine, expert] - outside[mine]),
    ):
        margin = margin[torch.isfinite(margin)].clamp_min(0).sort()[0]
        for c in sorted({min(c, margin.numel()) for c in counts} - {0}):
            hi = margin[c].item() if c < margin.numel() else margin[c - 1].item() * 1.01 + 1e-6
            steps.append(sign * (margin[c - 1].item() + hi) / 2)
    out = []
    for step in steps:
        b = bias.clone()
        b[expert] = (b[expert] + step).to(dtype).float()
        if b[expert] != bias[expert]:
            out.append(b)
    if not out:
        return bias.new_zeros(0, bias.shape[0]), None
    trial = torch.stack(out)
    moved = trial[:, expert] - bias[expert]
    low, high = min(moved.min().item(), 0.0), max(moved.max().item(), 0.0)
    return trial, _reachable(state, bias, expert, low, high, bounds)


def _real_loss(layer, bias, x, y) -> float:
    """The layer-local loss with the block's own router and forward holding ``bias``."""
    with torch.no_grad(), _with_bias(layer, bias), differentiable_dispatch(layer, ExpertCache()):
        return relative_error(block_tensor(layer.block(x.unsqueeze(0))).reshape(y.shape), y).item()


def fit_bias(
    layer: MoELayer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    sweeps: int = 4,
) -> tuple[torch.Tensor | None, BiasFitResult | None]:
    """Fit ``layer``'s (already pruned) score-correction bias to the unpruned block's outputs.

    :param inputs: ``[N, H]`` the layer's calibration inputs (no padding rows)
    :param targets: ``[N, H]`` the unpruned block's outputs on ``inputs``
    :param sweeps: passes over every expert (the search stops earlier when one moves none)
    :returns: the fitted bias in the router's dtype (the cut's bias when no move lowered
        the held-out loss) and the fit's record, or ``(None, None)`` when the router has
        no score-correction bias; the layer itself is left unchanged
    :raises BiasFitError: the router cannot be expressed, or the shapes disagree

    Example::

        bias, record = fit_bias(layer, X, Y)
        if bias is not None:
            layer.router.e_score_correction_bias.data.copy_(bias)

    (Over 80 lines: the sweep over experts, its held-out bookkeeping and the final check
    with the block's own forward read best as one piece.)
    """
    if not isinstance(getattr(layer.router, BIAS_ATTR, None), torch.Tensor):
        return None, None
    problem = bias_fit_problem(layer)
    if problem is not None:
        raise BiasFitError(problem)
    check_rows(layer.name, inputs, targets, 2, BiasFitError)
    cut = getattr(layer.router, BIAS_ATTR).detach()
    dtype = cut.dtype
    rule = read_rule(layer.router)
    held = holdout_rows(inputs.shape[0])
    x_fit, y_fit, x_held, y_held = inputs[~held], targets[~held], inputs[held], targets[held]

    bias = cut.float().clone()
    fit = _TokenSet(layer, rule, x_fit, y_fit, bias)
    hold = _TokenSet(layer, rule, x_held, y_held, bias)
    best, best_held, best_move = bias.clone(), hold.loss(), 0
    moves = candidates = done = 0
    for sweep in range(1, sweeps + 1):
        done, moved = sweep, 0
        for expert in range(bias.shape[0]):
            for _ in range(REPEATS):
                trial, rows = _candidates(fit, bias, expert, dtype)
                candidates += trial.shape[0]
                if trial.shape[0] == 0:
                    break
                tried = fit.try_biases(trial, rows)
                scored = [(r[0], c) for c, r in enumerate(tried) if r is not None]
                if not scored:
                    break
                gain, c = min(scored)
                if gain >= -1e-7 * fit.denominator:
                    break
                fit.commit(tried[c])
                before, bias = bias, trial[c].clone()
                hold.move_to(bias, before, expert)
                moves += 1
                moved += 1
                if hold.loss() < best_held:
                    best, best_held, best_move = bias.clone(), hold.loss(), moves
        if not moved:
            break

    fitted = best.to(dtype)
    # the reported losses: the block's own router and forward
    held_before = _real_loss(layer, cut, x_held, y_held)
    held_after = _real_loss(layer, fitted, x_held, y_held)
    if best_move == 0 or not held_after < held_before:
        fitted, held_after, best_move = cut.clone(), held_before, 0
    fit_before_real = _real_loss(layer, cut, x_fit, y_fit)
    fit_after = _real_loss(layer, fitted, x_fit, y_fit) if best_move else fit_before_real
    result = BiasFitResult(
        tokens=int(inputs.shape[0]),
        sweeps=done,
        candidates=candidates,
        moves=moves,
        best_move=best_move,
        block_rows=fit.block_rows + hold.block_rows,
        expert_rows=fit.expert_rows + hold.expert_rows,
        loss_before=fit_before_real,
        loss_after=fit_after,
        holdout_before=held_before,
        holdout_after=held_after,
        fitted=[f"{layer.router_attr}.{BIAS_ATTR}"] if best_move else [],
    )
    return fitted, result
