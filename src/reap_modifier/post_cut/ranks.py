"""The post-cut step under data parallel: every rank's captured rows gathered in the order
one process records them, the first rank's results shared, and the fitted tensors written
on the other ranks.

The first rank fits alone while the others wait: llm-compressor's data-parallel offload
keeps one copy of the weights shared by the ranks, so concurrent fits would mix their
writes. ``group=None`` (one process) makes every function a no-op or the identity."""

from __future__ import annotations

import torch

from ..models import MoEArchitecture

__all__ = ["barrier", "gathered", "hold_shared_tensors", "rank", "share"]


def rank(group) -> int:
    """This process's rank in ``group`` (0 alone)."""
    if group is None:
        return 0
    import torch.distributed as dist

    return dist.get_rank(group)


def gathered(items: list, group) -> list:
    """Every rank's ``items``, concatenated in rank order (``items`` alone without a group)."""
    if group is None:
        return list(items)
    import torch.distributed as dist

    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, list(items), group=group)
    return [item for part in parts for item in part]


def share(obj, group):
    """``obj`` of the first rank, on every rank (``obj`` itself in one process)."""
    if group is None:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def barrier(group) -> None:
    if group is not None:
        import torch.distributed as dist

        dist.barrier(group=group)


def hold_shared_tensors(arch: MoEArchitecture, tensors: dict[str, dict[str, torch.Tensor]]) -> None:
    """Another rank: write the first rank's fitted ``tensors`` (by layer, then
    ``"path.name"``) where this rank's copy differs (nothing when the ranks share the
    weights)."""
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
