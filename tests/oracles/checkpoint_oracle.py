"""What a saved checkpoint holds, against the in-memory model and the source (test oracle).

Nothing here imports the product: tensors are read with ``safetensors`` and compared with
``torch.equal``. A pruned checkpoint written from memory must hold exactly the in-memory
model's tensors (packed experts included), whatever list of changed tensors the writer
kept; the tensors that differ from the source are found by comparing bytes, each
per-expert tensor against the source's rows of the kept experts.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

__all__ = ["differs_from_source", "read_tensors", "saved_equals_memory"]

#: a routed expert tensor's name: its MoE block, expert index and the rest
_EXPERT = re.compile(r"^(?P<block>.+)\.experts\.(?P<idx>\d+)\.(?P<rest>.+)$")


def read_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``path``, by name."""
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                out[k] = st.get_tensor(k)
    return out


def saved_equals_memory(model: torch.nn.Module, path: str | os.PathLike) -> int:
    """Assert that the checkpoint at ``path`` holds the tensors of ``model``'s state dict,
    each equal to the in-memory one in the saved dtype; returns how many were compared.
    Only routed experts may be held in another form (decompressed in memory, ``weight``,
    and saved packed, ``weight_packed`` / ``weight_scale``): such an expert module's
    tensors are left to a check against the source bytes."""
    saved, memory = read_tensors(path), model.state_dict()
    unmatched = set(saved) ^ set(memory)
    assert all(_EXPERT.match(n) for n in unmatched), [n for n in unmatched if not _EXPERT.match(n)]
    # an expert module held in another form in memory: none of its tensors compare
    other_form = {n.rpartition(".")[0] for n in unmatched}
    both = sorted(n for n in set(saved) & set(memory) if n.rpartition(".")[0] not in other_form)
    for name in both:
        tensor, now = saved[name], memory[name].detach().to("cpu")
        assert tensor.shape == now.shape and torch.equal(tensor, now.to(tensor.dtype)), name
    return len(both)


def differs_from_source(
    src: str | os.PathLike, dst: str | os.PathLike, kept: dict[str, list[int]]
) -> list[str]:
    """The tensors of ``dst`` (a pruned copy of ``src`` keeping ``kept[block]`` experts of
    each block, in that order) whose bytes differ from the source's: a routed expert's
    tensor against the expert it was cut from, a tensor of a pruned block with one row
    per source expert (router rows, biases) against the kept rows, any other against the
    source tensor of the same name."""
    source, saved = read_tensors(src), read_tensors(dst)
    differ = []
    for name, tensor in sorted(saved.items()):
        m = _EXPERT.match(name)
        if m and m["block"] in kept:
            was = source[f"{m['block']}.experts.{kept[m['block']][int(m['idx'])]}.{m['rest']}"]
        else:
            was = source[name]
            block = next((b for b in kept if name.startswith(f"{b}.")), None)
            if block is not None and was.shape != tensor.shape:
                assert was.shape[0] > tensor.shape[0] == len(kept[block]), name
                was = was[kept[block]]
        if was.shape != tensor.shape or not torch.equal(was, tensor):
            differ.append(name)
    return differ
