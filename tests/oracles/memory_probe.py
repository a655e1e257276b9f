"""Measure which tensors are alive at once: a ``TorchDispatchMode`` that sees every
tensor any aten op allocates while it is active and follows its *storage* (weak
reference to the storage object, which PyTorch keeps alive exactly as long as any tensor,
parameter or view uses the memory) until the memory is freed.

``LiveTensors(match)`` tracks the tensors for which ``match(t)`` is true (e.g. bf16
2-D tensors of an expert weight's shape): ``peak_count`` / ``peak_bytes`` are the most
of them alive at the same time, ``created`` how many were made. Views are not counted
(they share their base's storage); a tensor re-wrapped as a Parameter stays counted.
Independent of the code under test: it counts
allocations, not what that code reports about itself.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensors(TorchDispatchMode):
    def __init__(self, match: Callable[[torch.Tensor], bool]):
        super().__init__()
        self.match = match
        self.live_count = 0
        self.live_bytes = 0
        self.peak_count = 0
        self.peak_bytes = 0
        self.created = 0
        self._seen: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live_count -= 1
        self.live_bytes -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t._is_view() or not self.match(t):
                continue
            storage = t.untyped_storage()
            if id(storage) in self._seen:
                continue
            nbytes = storage.nbytes()
            self._seen.add(id(storage))
            weakref.finalize(storage, self._freed, id(storage), nbytes)
            self.created += 1
            self.live_count += 1
            self.live_bytes += nbytes
            self.peak_count = max(self.peak_count, self.live_count)
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return out


def shaped_like(shapes: set[tuple[int, ...]], dtype: torch.dtype = torch.bfloat16):
    """A ``match`` for real (not meta) tensors of ``dtype`` with one of ``shapes``."""
    return lambda t: t.dtype == dtype and tuple(t.shape) in shapes and t.device.type != "meta"
