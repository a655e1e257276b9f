"""Data-parallel calibration over ``torch.distributed`` (llm-compressor's DDP engine).

Every rank observes its shard of the calibration set. Before any decision the raw
float64 sums and counts of *all* statistics are all-reduced over a gloo (CPU) group
(sums add, ``max_norm`` takes the max, token counts add), so every rank holds the
global statistics; rank 0 cuts the plan and broadcasts the kept ids, and every rank
applies the same in-memory surgery.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from compressed_tensors.distributed import (
    get_source_rank,
    is_distributed,
    is_source_process,
)

from .accumulator import LayerAccumulator

__all__ = [
    "CPU_GROUP_TIMEOUT",
    "broadcast_kept",
    "gather_counts",
    "is_distributed",
    "is_source_process",
    "make_cpu_group",
    "reduce_accumulators",
    "world_size",
]


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


#: how long a rank of the CPU group waits in a collective: long enough for any stage that
#: makes ranks wait (the post-cut step's per-layer fits at K3 scale take hours, the ranks
#: sharing them); the stages that can wait long log it first. gloo's default is 30 min.
CPU_GROUP_TIMEOUT = timedelta(days=2)


def make_cpu_group():
    """A gloo group for CPU float64 collectives (``None`` when not distributed), its
    timeout :data:`CPU_GROUP_TIMEOUT`.

    Collective: every rank must call it, in the same order (``on_initialize``).
    """
    return dist.new_group(backend="gloo", timeout=CPU_GROUP_TIMEOUT) if is_distributed() else None


def reduce_accumulators(accumulators: dict[str, LayerAccumulator], group) -> None:
    """All-reduce every layer's statistics in place (sorted layer order on all ranks).

    A rank that saw no tokens for a layer (or an expert) contributes zeros; ``max_norm``
    starts at 0 and norms are >= 0, so MAX is exact.
    """
    if not is_distributed():
        return
    for name in sorted(accumulators):
        acc = accumulators[name]
        acc._ensure(torch.device("cpu"))
        for stat, tensor in acc.stats.items():
            cpu = tensor.to("cpu", torch.float64).contiguous()
            op = dist.ReduceOp.MAX if stat == "max_norm" else dist.ReduceOp.SUM
            dist.all_reduce(cpu, op=op, group=group)
            acc.stats[stat] = cpu
        acc.device = torch.device("cpu")
        counts = torch.tensor([acc.tokens, acc.positions, acc.samples], dtype=torch.int64)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        acc.tokens, acc.positions, acc.samples = (int(c) for c in counts.tolist())


def gather_counts(local: dict[str, int], group) -> list[dict[str, int]]:
    """Every rank's ``local`` counts (same keys on every rank), in rank order."""
    keys = sorted(local)
    if not is_distributed():
        return [{"rank": 0, **local}]
    mine = torch.tensor([int(local[k]) for k in keys], dtype=torch.int64)
    table = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(table, mine, group=group)
    return [{"rank": r, **dict(zip(keys, t.tolist()))} for r, t in enumerate(table)]


def broadcast_kept(
    kept: dict[str, list[int]] | None, layer_names: list[str], keep: int, group
) -> dict[str, list[int]]:
    """Rank 0's kept ids, on every rank (layer order = ``sorted(layer_names)``)."""
    if not is_distributed():
        assert kept is not None
        return kept
    names = sorted(layer_names)
    if is_source_process():
        table = torch.tensor([kept[n] for n in names], dtype=torch.int64)
    else:
        table = torch.empty((len(names), keep), dtype=torch.int64)
    dist.broadcast(table, src=get_source_rank(), group=group)
    return {n: table[i].tolist() for i, n in enumerate(names)}
