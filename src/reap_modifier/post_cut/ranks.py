"""The post-cut step under data parallel: the ranks share the work, layer by layer.

Each MoE layer's selection and fits depend only on that layer's captured rows and its own
tensors, so layer ``i`` is owned by rank ``i mod W`` (:func:`owner`): only that rank
receives the layer's rows (every rank's, in one process's order, :func:`gathered_to`),
fits it, and hands its result to the others (:func:`exchange`), which write it where
their copy differs (:func:`hold_tensors`; nothing when the ranks share one copy of the
weights, as llm-compressor's data-parallel offload does: each layer's tensors are written
by its owner alone). The held-out samples are shared the same way (sample ``j`` of one
process's order by rank ``j mod W``), and the per-sample KLs are joined
(:func:`joined_kl`), so every rank takes every decision on the same numbers: the result
equals one process's, bit for bit. ``group=None`` (one process) makes every function the
identity.
"""

from __future__ import annotations

import torch
from loguru import logger

from ..models import MoEArchitecture
from .validation import HeldOutKL

__all__ = [
    "barrier",
    "exchange",
    "gathered",
    "gathered_to",
    "hold_tensors",
    "joined_kl",
    "owner",
    "rank",
    "world",
]


def rank(group) -> int:
    """This process's rank in ``group`` (0 alone)."""
    if group is None:
        return 0
    import torch.distributed as dist

    return dist.get_rank(group)


def world(group) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group)


def owner(index: int, group) -> int:
    """The rank that owns item ``index`` (a layer, a held-out sample)."""
    return index % world(group)


def gathered(items: list, group) -> list:
    """Every rank's ``items``, concatenated in rank order (``items`` alone without a group)."""
    if group is None:
        return list(items)
    import torch.distributed as dist

    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, list(items), group=group)
    return [item for part in parts for item in part]


def gathered_to(items: list, dst: int, group) -> list | None:
    """Every rank's ``items``, concatenated in rank order, on rank ``dst`` only (``None``
    on the others)."""
    if group is None:
        return list(items)
    import torch.distributed as dist

    me = dist.get_rank(group)
    parts: list | None = [None] * dist.get_world_size(group) if me == dst else None
    dist.gather_object(list(items), parts, dst=dist.get_global_rank(group, dst), group=group)
    return None if parts is None else [item for part in parts for item in part]


def exchange(mine: dict, group, what: str = "") -> dict:
    """Every rank's ``mine`` (a dict keyed by layer), merged (``mine`` alone without a
    group). Logs first, since a rank may wait here for the others' longer work."""
    if group is None:
        return dict(mine)
    if what:
        logger.info(f"REAP post-cut step: rank {rank(group)} waits for the other ranks' {what}")
    merged: dict = {}
    for part in gathered([mine], group):
        merged.update(part)
    return merged


def barrier(group) -> None:
    if group is not None:
        import torch.distributed as dist

        dist.barrier(group=group)


def joined_kl(local: HeldOutKL, indices: list[int], total: int, groups, group) -> HeldOutKL:
    """The held-out KL of every sample, from each rank's ``local`` one over the samples
    ``indices`` it owns (of ``total``, in one process's order), identical on every rank."""
    if group is None:
        return local
    rows = gathered(
        [(i, s, t) for i, s, t in zip(indices, local.sums.tolist(), local.tokens.tolist())],
        group,
    )
    sums = torch.zeros(total, dtype=torch.float64)
    tokens = torch.zeros(total, dtype=torch.long)
    for i, s, t in rows:
        sums[i], tokens[i] = s, t
    return HeldOutKL(sums, tokens, groups)


def hold_tensors(arch: MoEArchitecture, tensors: dict[str, dict[str, torch.Tensor]]) -> None:
    """Write the fitted ``tensors`` (by layer, then ``"path.name"``) where this rank's copy
    differs (nothing when the ranks share the weights, or it fitted them itself)."""
    from compressed_tensors import align_module_device
    from compressed_tensors.offload import update_offload_parameter

    for layer in arch.layers:
        for name, tensor in tensors.get(layer.name, {}).items():
            path, _, attr = name.rpartition(".")
            module = layer.block.get_submodule(path)
            with align_module_device(module):
                same = torch.equal(getattr(module, attr).detach().to("cpu"), tensor)
            if not same:
                update_offload_parameter(module, attr, tensor)
