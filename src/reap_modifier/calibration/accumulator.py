"""float64 running sums of the per-expert statistics of one MoE layer.

Sums and counts, not means, so accumulators from different batches, ranks or runs
add up exactly (up to float64 rounding) and the scores file can be merged and re-cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..scores import STAT_NAMES

__all__ = ["LayerAccumulator", "norms64"]


def norms64(x: torch.Tensor) -> torch.Tensor:
    """L2 norm over the last dimension, accumulated in float64."""
    return torch.linalg.vector_norm(x, dim=-1, dtype=torch.float64)


@dataclass
class LayerAccumulator:
    """float64 running sums for one layer; slot ``E`` absorbs out-of-range ids (>= E).

    ``tokens`` counts the positions that entered the sums, ``positions`` every
    position the layer routed (``positions - tokens`` were padding), ``samples`` the
    sequences.
    """

    num_experts: int
    device: torch.device | None = None
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    tokens: int = 0
    positions: int = 0
    samples: int = 0

    def _ensure(self, device: torch.device) -> None:
        if not self.stats:
            self.device = device
            size = self.num_experts + 1
            self.stats = {
                s: torch.zeros(size, dtype=torch.float64, device=device) for s in STAT_NAMES
            }

    @torch.no_grad()
    def add(
        self,
        ids: torch.Tensor,
        weights: torch.Tensor,
        norms: torch.Tensor,
        valid: torch.Tensor | None = None,
        samples: int = 0,
    ) -> None:
        """Accumulate one batch: ``ids``, ``weights``, ``norms`` are ``[N, k]``;
        rows where the bool ``[N]`` ``valid`` is false (padding) are left out."""
        self._ensure(norms.device)
        self.positions += ids.shape[0]
        self.samples += samples
        if valid is not None:
            ids = ids[valid.to(ids.device)]
            weights = weights[valid.to(weights.device)]
            norms = norms[valid.to(norms.device)]
        flat = ids.reshape(-1).to(device=self.device, dtype=torch.long)
        flat = flat.clamp(max=self.num_experts)  # out-of-range ids -> padding slot
        g = weights.reshape(-1).to(device=self.device, dtype=torch.float64)
        n = norms.reshape(-1).to(device=self.device, dtype=torch.float64)
        st = self.stats
        st["count"].index_add_(0, flat, torch.ones_like(g))
        st["sum_weight"].index_add_(0, flat, g)
        st["sum_norm"].index_add_(0, flat, n)
        st["sum_reap"].index_add_(0, flat, g * n)
        st["max_norm"].scatter_reduce_(0, flat, n, reduce="amax", include_self=True)
        self.tokens += ids.shape[0]

    def export(self) -> dict[str, torch.Tensor]:
        if not self.stats:
            return {s: torch.zeros(self.num_experts, dtype=torch.float64) for s in STAT_NAMES}
        return {s: t[: self.num_experts].to("cpu") for s, t in self.stats.items()}
