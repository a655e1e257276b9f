"""safetensors headers, read and written without loading any tensor.

A :class:`ShardHeader` lists every tensor of a file with its absolute byte range, so
tensors (or rows of them) can be copied as byte runs; the strict reader checks that
the ranges tile the data exactly (a truncated or padded file fails).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError

__all__ = ["ShardHeader", "TensorEntry", "encode_header", "read_safetensors_header"]

_ST_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a shard: absolute byte range ``[begin, end)`` in the file."""

    name: str
    shard: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    def index_ranges(self, index: Iterable[int], dim: int = 0) -> list[tuple[int, int]]:
        """Absolute byte ranges of the entries ``index`` along ``dim``, in storage order
        (merged when adjacent): the bytes of ``tensor.index_select(dim, index)``."""
        if len(self.shape) <= dim:
            raise CheckpointError(f"{self.name}: shape {list(self.shape)} has no dim {dim}")
        n = self.shape[dim]
        outer = 1
        for s in self.shape[:dim]:
            outer *= s
        if n == 0 or outer == 0 or self.nbytes % (n * outer):
            raise CheckpointError(
                f"{self.name}: {self.nbytes} bytes do not split into {outer} x {n} entries"
            )
        step = self.nbytes // (n * outer)  # bytes of one entry along dim
        index = list(index)
        out: list[tuple[int, int]] = []
        for o in range(outer):
            base = self.begin + o * n * step
            for r in index:
                b = base + r * step
                if out and out[-1][1] == b:
                    out[-1] = (out[-1][0], b + step)
                else:
                    out.append((b, b + step))
        return out


@dataclass
class ShardHeader:
    """Parsed header of one safetensors file."""

    path: Path
    header_len: int
    file_size: int
    metadata: dict | None
    entries: dict[str, TensorEntry]


def read_safetensors_header(
    path: str | os.PathLike, shard: str | None = None, *, strict: bool = True
) -> ShardHeader:
    """Parse a safetensors header; with ``strict`` check offsets cover the data exactly."""
    path = Path(path)
    shard = shard or path.name
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8 or n > 512 << 20:
            raise CheckpointError(f"{path}: header length {n} exceeds the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: corrupt safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    start = 8 + n
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        try:
            b, e = (int(x) for x in info["data_offsets"])
            entry = TensorEntry(
                name,
                shard,
                str(info["dtype"]),
                tuple(int(s) for s in info["shape"]),
                start + b,
                start + e,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: bad header entry for {name!r}: {exc}") from exc
        entries[name] = entry
    if strict:
        pos = start
        for entry in sorted(entries.values(), key=lambda t: (t.begin, t.end)):
            if entry.begin != pos or entry.end < entry.begin:
                raise CheckpointError(
                    f"{path}: tensor {entry.name!r} at bytes [{entry.begin}, {entry.end}) "
                    f"does not follow the previous tensor (expected start {pos})"
                )
            item = _ST_DTYPE_BYTES.get(entry.dtype)
            if item is not None:
                numel = 1
                for s in entry.shape:
                    numel *= s
                if numel * item != entry.nbytes:
                    raise CheckpointError(
                        f"{path}: tensor {entry.name!r} {entry.dtype}{list(entry.shape)} "
                        f"needs {numel * item} bytes, header says {entry.nbytes}"
                    )
            pos = entry.end
        if pos != size:
            raise CheckpointError(
                f"{path}: data ends at byte {pos} but the file has {size} bytes "
                "(truncated or trailing garbage)"
            )
    return ShardHeader(path, n, size, metadata, entries)


def encode_header(
    entries: list[tuple[str, str, list[int], int, int]],
    metadata: dict | None,
    *,
    align: tuple[int, int] | None = None,
) -> bytes:
    """safetensors header bytes (8-byte length + JSON padded with spaces to 8); with
    ``align = (residue, modulus)`` (multiples of 8) padded further so that the data starts
    at a file offset congruent to ``residue`` modulo ``modulus``."""
    header: dict = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, b, e in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [b, e]}
    body = json.dumps(header, separators=(",", ":")).encode("utf-8")
    body += b" " * (-len(body) % 8)
    if align is not None:
        residue, modulus = align
        if residue % 8 or modulus % 8:
            raise ValueError(f"alignment {align} is not in multiples of 8")
        body += b" " * ((residue - 8 - len(body)) % modulus)
    return struct.pack("<Q", len(body)) + body
