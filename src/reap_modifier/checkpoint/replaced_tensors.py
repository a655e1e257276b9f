"""Tensors of a rewritten checkpoint written from memory instead of the source bytes.

The rewriter copies every output tensor from the source. Router calibration changes a
few small tensors (a fitted router's kept rows); :func:`bind_replacements` names them
in the checkpoint and checks them before any byte is written (each must be an output
of the rewrite with the same shape, never an expert tensor), and
:func:`write_replacements` overwrites their bytes in the finished output shards in
place (same dtype and shape, so the same byte range) and returns the new shard
checksums. The manifest records each replaced tensor's sha256, its source tensor and
why it differs, which is what ``reap verify --source`` accepts instead of the source
bytes.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .binding import RewriteSpec
from .byte_copy import new_hasher
from .errors import CheckpointError
from .safetensors_header import read_safetensors_header

__all__ = [
    "TORCH_DTYPES",
    "Replacement",
    "bind_replacements",
    "replacement_record",
    "write_replacements",
]

#: safetensors dtype name -> torch dtype of the tensors written from memory
TORCH_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
}


@dataclass
class Replacement:
    """One output tensor written from memory."""

    out_name: str
    source_name: str
    data: bytes
    reason: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


def bind_replacements(
    spec: RewriteSpec, tensors: Mapping[str, Mapping[str, torch.Tensor]], reason: str
) -> dict[str, Replacement]:
    """Checkpoint names and bytes of ``tensors`` (``{plan layer: {name relative to the
    layer: tensor}}``, e.g. ``{"model.layers.1.mlp": {"gate.weight": w}}``).

    :raises CheckpointError: a layer the plan does not bind, a name that is no output
        of the rewrite, an expert tensor, a shape that differs, a non-float dtype
    """
    if not tensors:
        return {}
    produced: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    for name in spec.layout.weight_map:
        act = spec.action(name)
        if act is None:
            continue
        out_name, rows = act
        entry = spec.layout.entry(name)
        shape = spec.remap.out_shape(name, entry.shape, rows)
        produced[out_name] = (name, entry.dtype, shape)
    out: dict[str, Replacement] = {}
    for layer, named in tensors.items():
        prefix = spec.layer_map.get(layer)
        if prefix is None:
            raise CheckpointError(
                f"replaced tensors name layer {layer!r}, which the plan does not bind"
            )
        for rel, tensor in named.items():
            out_name = f"{prefix}.{rel}"
            if ".experts." in f".{rel}." or out_name not in produced:
                raise CheckpointError(
                    f"{out_name}: not a non-expert output tensor of the rewrite; only router "
                    "tensors may be written from memory"
                )
            source_name, dtype, shape = produced[out_name]
            if tuple(tensor.shape) != shape or dtype not in TORCH_DTYPES:
                raise CheckpointError(
                    f"{out_name}: replacement {tuple(tensor.shape)} cannot stand for "
                    f"{dtype}{list(shape)} from {source_name}"
                )
            data = tensor.detach().to("cpu", TORCH_DTYPES[dtype]).contiguous()
            raw = data.reshape(-1).view(torch.uint8).numpy().tobytes()
            out[out_name] = Replacement(out_name, source_name, raw, reason)
    return out


def write_replacements(
    directory: str | os.PathLike, replacements: Mapping[str, Replacement], checksum: str
) -> dict[str, str]:
    """Overwrite the replaced tensors' bytes in the output shards of ``directory``.

    :param checksum: the manifest's per-shard checksum kind
    :returns: ``{shard: new checksum}`` for every shard changed
    """
    directory = Path(directory)
    headers = {
        p.relative_to(directory).as_posix(): read_safetensors_header(p)
        for p in sorted(directory.rglob("*.safetensors"))
    }
    by_shard: dict[str, list[Replacement]] = {}
    for rep in replacements.values():
        shard = next((s for s, h in headers.items() if rep.out_name in h.entries), None)
        if shard is None:
            raise CheckpointError(f"internal error: {rep.out_name} is in no output shard")
        by_shard.setdefault(shard, []).append(rep)
    checksums = {}
    for shard, reps in by_shard.items():
        path = directory / shard
        header = headers[shard]
        with open(path, "r+b") as f:
            for rep in reps:
                entry = header.entries[rep.out_name]
                if entry.end - entry.begin != len(rep.data):
                    raise CheckpointError(f"internal error: {rep.out_name} size changed")
                f.seek(entry.begin)
                f.write(rep.data)
            f.flush()
            os.fsync(f.fileno())
        hasher = new_hasher(checksum)
        with open(path, "rb") as f:
            while chunk := f.read(16 << 20):
                hasher.update(chunk)
        checksums[shard] = hasher.hexdigest()
    return checksums


def replacement_record(replacements: Mapping[str, Replacement]) -> dict[str, dict]:
    """The manifest's ``checkpoint.replaced_tensors``."""
    return {
        name: {"sha256": rep.sha256, "source": rep.source_name, "reason": rep.reason}
        for name, rep in sorted(replacements.items())
    }
