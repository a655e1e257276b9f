"""A GGUF part written streaming: its header (the key/value fields, unchanged ones as their
source bytes, then the tensor infos with offsets laid out as llama.cpp's writer lays them),
then each tensor's data as byte ranges of the source file, copied by the kernel
(:func:`reap_modifier.checkpoint.byte_copy.copy_range`) where it can, with the same zero
padding to the alignment.

Memory stays at one I/O buffer whatever the tensor sizes; nothing is dequantized."""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.byte_copy import copy_range

__all__ = ["OutTensor", "encode_field", "header_bytes", "write_part"]

GGUF_MAGIC = b"GGUF"
#: gguf value types (gguf.GGUFValueType)
_UINT32, _INT32, _STRING, _ARRAY, _UINT64 = 4, 5, 8, 9, 10
_SCALAR = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
#: bytes per kernel copy (a progress step)
_CHUNK = 64 << 20


@dataclass(frozen=True)
class OutTensor:
    """One output tensor: name, dims (GGUF order), ggml type, and the source byte ranges
    that make its data."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    ranges: list[tuple[int, int]]

    @property
    def nbytes(self) -> int:
        return sum(e - b for b, e in self.ranges)


def _pad(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def encode_field(key: str, value, vtype: int) -> bytes:
    """One key/value field as stored: a scalar or string of value type ``vtype``, or a list
    (an array of ``vtype`` items)."""
    head = _string(key)
    if isinstance(value, list | tuple):
        items = b"".join(_encode_value(v, vtype) for v in value)
        return head + struct.pack("<IIQ", _ARRAY, vtype, len(value)) + items
    return head + struct.pack("<I", vtype) + _encode_value(value, vtype)


def _encode_value(value, vtype: int) -> bytes:
    if vtype == _STRING:
        return _string(str(value))
    return struct.pack(_SCALAR[vtype], value)


def header_bytes(version: int, fields: list[bytes], tensors: list[OutTensor], align: int) -> bytes:
    """The header up to the data section (padded to ``align``), tensor offsets laid out in
    order, each tensor's data padded to ``align``."""
    out = [GGUF_MAGIC, struct.pack("<IQQ", version, len(tensors), len(fields)), *fields]
    offset = 0
    for t in tensors:
        out.append(_string(t.name))
        out.append(struct.pack("<I", len(t.dims)) + struct.pack(f"<{len(t.dims)}Q", *t.dims))
        out.append(struct.pack("<IQ", t.ggml_type, offset))
        offset += _pad(t.nbytes, align)
    head = b"".join(out)
    return head + b"\0" * (_pad(len(head), align) - len(head))


def write_part(
    dst: Path,
    src: Path,
    version: int,
    fields: list[bytes],
    tensors: list[OutTensor],
    align: int,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Write one GGUF file ``dst`` from ``src``'s byte ranges; returns the bytes written."""
    head = header_bytes(version, fields, tensors, align)
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        fout.write(head)
        fout.flush()
        pos = len(head)
        for t in tensors:
            for b, e in t.ranges:
                copy_range(fin.fileno(), fout.fileno(), b, e, pos, chunk=_CHUNK, progress=progress)
                pos += e - b
            pad = _pad(t.nbytes, align) - t.nbytes
            if pad:
                os.pwrite(fout.fileno(), b"\0" * pad, pos)
                pos += pad
        os.ftruncate(fout.fileno(), pos)
    return pos
