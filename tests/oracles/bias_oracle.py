"""A score-correction bias judged by brute force (test oracle).

Nothing here imports the product. The block's output for a given bias is computed in
float64 from the router weight and the experts' parameters (:mod:`oracles`: the
hand-written routing spec and expert math of each family), with the DeepSeek-V3
selection written out here vectorised over candidate biases: ``scores + bias`` choose
(grouped: the ``topk_group`` groups with the largest sum of their two best, then the
top-k inside them), the weights are the scores of the chosen experts, renormalised when
the router says so, times the routed scaling factor.

:func:`BiasOracle.single_moves` scans one coordinate of the bias at a time, exhaustively:
along coordinate ``e`` a token's selection changes only where ``v = scores_e + b_e``
passes the k-th best choice value ``c_j`` of the other experts it competes with, or,
grouped, where the score of ``e``'s group (``m1 + max(v, m2)``, ``m1 >= m2`` its two best
other members) passes the ``topk_group``-th best other group's. Between consecutive such
thresholds every routing is constant, so one value inside each interval (and one beyond
each end) reaches every routing that moving ``b_e`` alone can produce.
"""

from __future__ import annotations

import torch
from oracles import (
    _routing_spec,
    reference_block_output,
    reference_expert_input,
    reference_expert_output,
)

__all__ = ["BiasOracle"]


class BiasOracle:
    """The float64 block of ``family`` on inputs ``x`` ``[N, H]`` and targets ``y``: each
    kept expert's output precomputed, the block's output for any bias."""

    def __init__(self, family: str, block, x: torch.Tensor, y: torch.Tensor):
        self.family, self.block = family, block
        router = block.gate
        self.spec = _routing_spec(family, router)
        assert self.spec["kind"] == "biased", self.spec
        self.x, self.y = x.double(), y.double()
        logits = self.x @ router.weight.detach().double().T
        assert self.spec["activation"] == "sigmoid", self.spec["activation"]
        self.scores = torch.sigmoid(logits)  # [N, E]
        inner = reference_expert_input(family, block, x)
        E = self.scores.shape[1]
        self.expert_out = torch.stack(
            [reference_expert_output(family, block, e, inner) for e in range(E)]
        )  # [E, N, D]
        # the dense part (shared experts), which no bias moves: the whole block's float64
        # output (oracles.reference_block_output) less its routed part, on the cut's routing
        ids, w = self.select(router.e_score_correction_bias.detach().double()[None])
        self.shared = 0.0
        full = reference_block_output(family, block, x, routing=(ids[0], w[0]))
        self.shared = full - self.outputs(ids, w)[0]

    def select(self, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids [C, N, k], weights [C, N, k])`` for candidate biases ``[C, E]`` (or one
        per token, ``[C, N, E]``)."""
        spec, s = self.spec, self.scores
        bias = bias.double()
        c = s.unsqueeze(0) + (bias.unsqueeze(1) if bias.dim() == 2 else bias)  # [C, N, E]
        C, N, E = c.shape
        if spec["use_groups"] and spec["n_group"] > 1:
            G = spec["n_group"]
            group = c.view(C, N, G, E // G).topk(2, dim=-1).values.sum(-1)  # [C, N, G]
            chosen = group.topk(spec["topk_group"], dim=-1).indices
            allowed = torch.zeros(C, N, G, dtype=torch.bool).scatter_(-1, chosen, True)
            c = c.masked_fill(~allowed.repeat_interleave(E // G, dim=-1), float("-inf"))
        ids = c.topk(spec["top_k"], dim=-1).indices
        w = s.unsqueeze(0).expand(C, N, E).gather(-1, ids)
        if spec["norm"]:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return ids, w * spec["scale"]

    def outputs(self, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``[C, N, H]`` block outputs for routings ``ids``, ``w`` ``[C, N, k]``."""
        C, N, k = ids.shape
        tok = torch.arange(N).view(1, N, 1).expand(C, N, k)
        routed = (self.expert_out[ids, tok] * w.unsqueeze(-1)).sum(2)  # [C, N, D]
        block = self.block
        if getattr(block, "use_latent_moe", False):
            if getattr(block, "latent_moe_use_norm", False):
                norm = block.routed_expert_norm
                routed = routed * torch.rsqrt(
                    routed.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon
                )
                routed = routed * norm.weight.detach().double()
            routed = routed @ block.routed_expert_up_proj.weight.detach().double().T
        return routed + self.shared

    def losses(self, bias: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``[C]`` relative squared error ``sum ||out - y||^2 / sum ||y||^2`` on ``rows``
        (bool ``[N]``) for candidate biases ``[C, E]``."""
        return self.token_errors(bias)[:, rows].sum(-1) / self.y[rows].pow(2).sum()

    def token_errors(self, bias: torch.Tensor) -> torch.Tensor:
        """``[C, N]`` squared error of each token for biases ``[C, E]`` or ``[C, N, E]``."""
        ids, w = self.select(bias)
        return (self.outputs(ids, w) - self.y).pow(2).sum(-1)

    def _thresholds(self, bias: torch.Tensor, expert: int) -> torch.Tensor:
        """``[N, P]`` per token, the values of coordinate ``expert`` where its selection
        can change (a superset; see the module docstring)."""
        spec, s = self.spec, self.scores
        c = s + bias.double()
        N, E = c.shape
        k, own = spec["top_k"], s[:, expert]
        others = torch.ones(E, dtype=torch.bool)
        others[expert] = False
        if not (spec["use_groups"] and spec["n_group"] > 1):
            kth = c[:, others].topk(k, dim=-1).values[:, -1]
            return (kth - own)[:, None]
        G, size = spec["n_group"], E // spec["n_group"]
        g = expert // size
        group = c.view(N, G, size).topk(2, dim=-1).values.sum(-1)  # [N, G]
        group[:, g] = float("-inf")
        mates = others.view(G, size)[g]
        m1 = c.view(N, G, size)[:, g][:, mates].max(-1).values
        # the group must beat the topk_group-th best other group
        rival = group.topk(spec["topk_group"], dim=-1).values[:, -1]
        # with it allowed: the other topk_group - 1 best groups and its other members
        allowed = torch.zeros(N, G, dtype=torch.bool)
        if spec["topk_group"] > 1:
            allowed.scatter_(-1, group.topk(spec["topk_group"] - 1, dim=-1).indices, True)
        allowed[:, g] = True
        candidates = allowed.repeat_interleave(size, dim=-1) & others
        kth = c.masked_fill(~candidates, float("-inf")).topk(k, dim=-1).values[:, -1]
        return torch.stack([rival - m1 - own, kth - own], 1)

    def single_moves(self, bias: torch.Tensor, expert: int, rows: list[torch.Tensor]):
        """Every distinct routing reachable by moving coordinate ``expert`` of ``bias``
        alone: ``(values [V], [losses [V] for each of rows])``, the loss a relative squared
        error on those rows (bool ``[N]``). Each token's error is computed once per
        interval of its own thresholds and summed per value; a sample of the values is
        checked against the full routing."""
        b = bias.double()
        th = self._thresholds(b, expert).sort(-1).values  # [N, P]
        N, P = th.shape
        reps = torch.cat([th[:, :1] - 1.0, (th[:, 1:] + th[:, :-1]) / 2, th[:, -1:] + 1.0], 1)
        per_token = b.expand(P + 1, N, b.numel()).clone()
        per_token[:, :, expert] = reps.T
        err = self.token_errors(per_token)  # [P + 1, N]: each token's error per interval
        points = th.flatten().unique()
        values = torch.cat([points[:1] - 1.0, (points[1:] + points[:-1]) / 2, points[-1:] + 1.0])
        piece = (th.unsqueeze(0) < values.view(-1, 1, 1)).sum(-1)  # [V, N]
        tok = err.gather(0, piece)  # [V, N]
        sample = torch.linspace(0, values.numel() - 1, 9).long()
        moved = b.repeat(sample.numel(), 1)
        moved[:, expert] = values[sample]
        direct = self.token_errors(moved)
        assert torch.allclose(direct, tok[sample], rtol=1e-9, atol=1e-12), "missed a threshold"
        return values, [tok[:, r].sum(-1) / self.y[r].pow(2).sum() for r in rows]
