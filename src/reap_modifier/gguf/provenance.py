"""What a pruned GGUF says about itself: the keys that change (the expert count, the size
label llama.cpp's converter derives from the tensors), and the provenance keys
(``reap.*``: the source's expert count and each layer's kept ids) that ``reap verify``
reads back."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "KEPT_PREFIX",
    "PROVENANCE_PREFIX",
    "SOURCE_COUNT",
    "kept_from_values",
    "provenance_fields",
    "size_label",
]

PROVENANCE_PREFIX = "reap."
SOURCE_COUNT = "reap.source_expert_count"
#: ``reap.kept_experts.<L>``: the source ids layer ``L`` keeps (position = new id)
KEPT_PREFIX = "reap.kept_experts."
METHOD = "reap.method"
_UINT32, _STRING = 4, 8


def provenance_fields(
    num_experts: int, block_kept: dict[int, list[int]], method: str
) -> list[tuple[str, object, int]]:
    """The provenance keys as ``(key, value, gguf value type)``."""
    out: list[tuple[str, object, int]] = [
        (METHOD, method, _STRING),
        (SOURCE_COUNT, num_experts, _UINT32),
    ]
    out += [(f"{KEPT_PREFIX}{L}", list(ids), _UINT32) for L, ids in sorted(block_kept.items())]
    return out


def kept_from_values(values: dict) -> tuple[int | None, dict[int, list[int]]]:
    """(source expert count, kept ids per layer) from a part's field values."""
    count = values.get(SOURCE_COUNT)
    kept = {
        int(k[len(KEPT_PREFIX) :]): [int(i) for i in v]
        for k, v in values.items()
        if k.startswith(KEPT_PREFIX)
    }
    return (int(count) if count is not None else None), dict(sorted(kept.items()))


def size_label(tensors: Iterable[tuple[str, tuple[int, ...]]]) -> str | None:
    """``general.size_label`` as llama.cpp's converter derives it from the tensors
    (``gguf.utility.size_label`` over ``GGUFWriter.get_total_parameter_count``'s counts;
    shapes there are in torch order, the reverse of GGUF ``dims``); ``None`` without
    parameters."""
    from gguf.utility import size_label as label

    total = shared = expert_params = expert_sum = n_expert_tensors = 0
    for name, dims in tensors:
        shape = tuple(reversed(dims))
        size = 1
        for d in shape:
            size *= d
        if "_exps." in name and len(shape) >= 3:
            count = shape[-2 if ".bias" in name else -3]
            expert_params += size // count
            expert_sum += count
            n_expert_tensors += 1
        else:
            shared += size
        total += size
    if total <= 0:
        return None
    count = expert_sum // n_expert_tensors if n_expert_tensors else 0
    return label(total, shared, expert_params, count)
