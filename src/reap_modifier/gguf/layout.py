"""A GGUF model as it lies on disk: its parts (one file, or the ``-0000i-of-0000n`` files of
a split), each part's key/value fields as raw bytes, its tensors (name, dims, type, byte
range) and the MoE facts llama.cpp reads from the keys (expert count, top-k, groups,
next-token layers).

Only the headers are parsed (through the ``gguf`` package's reader, which maps the file
and reads no tensor data)."""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .errors import GGUFError

__all__ = [
    "GGUFLayout",
    "GGUFPart",
    "GGUFTensor",
    "RawField",
    "inspect_gguf",
    "read_part",
    "gguf_model_file",
    "is_gguf",
    "split_parts",
]

#: ``name-00001-of-00003.gguf``: one part of a split model (llama.cpp's ``gguf-split`` names)
SPLIT_RE = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
#: a tensor of one layer: ``blk.<L>.<rest>``
BLOCK_RE = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<rest>.+)$")
DEFAULT_ALIGNMENT = 32
#: array keys whose values are read (the provenance keys); others (vocabularies) stay raw
_READ_ARRAYS = ("reap.",)


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a GGUF model (the prune and verify commands dispatch on it): a
    ``.gguf`` file, or a directory holding the parts of a split model."""
    return gguf_model_file(path) is not None


def gguf_model_file(path: str | os.PathLike) -> Path | None:
    """The file to open for the GGUF model at ``path``: the ``.gguf`` file itself, or the
    first part of the split model a directory holds (and no ``config.json``); else ``None``."""
    path = Path(path)
    if path.suffix.lower() == ".gguf" and not path.is_dir():
        return path
    if path.is_dir() and not (path / "config.json").exists():
        firsts = sorted(p for p in path.glob("*-00001-of-*.gguf") if SPLIT_RE.match(p.name))
        if len(firsts) == 1:
            return firsts[0]
    return None


@dataclass(frozen=True)
class RawField:
    """One key/value field: its key, its value type(s) and its bytes as stored (key
    included), so an unchanged field is copied byte for byte."""

    key: str
    types: tuple[int, ...]
    raw: bytes
    value: object = None


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``dims`` in GGUF order (``ne``: the first is the innermost, the last the
    outermost), its ggml type, and its data as ``[offset, offset + nbytes)`` of its file."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int

    @property
    def elements(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n


@dataclass
class GGUFPart:
    """One file of the model."""

    path: Path
    version: int
    alignment: int
    fields: list[RawField]
    tensors: list[GGUFTensor]

    def field(self, key: str) -> RawField | None:
        return next((f for f in self.fields if f.key == key), None)


@dataclass
class GGUFLayout:
    """The whole model: its parts in order and the MoE facts of its keys."""

    path: Path
    parts: list[GGUFPart]
    arch: str
    values: dict[str, object] = field(default_factory=dict)

    @property
    def split(self) -> bool:
        return len(self.parts) > 1 or SPLIT_RE.match(self.path.name) is not None

    def key(self, name: str) -> str:
        """``{arch}.{name}``: the architecture's key."""
        return f"{self.arch}.{name}"

    def get(self, name: str, default=None):
        """The value of ``{arch}.{name}``."""
        return self.values.get(self.key(name), default)

    @property
    def tensors(self) -> dict[str, tuple[GGUFPart, GGUFTensor]]:
        return {t.name: (p, t) for p in self.parts for t in p.tensors}

    @property
    def num_experts(self) -> int | None:
        n = self.get("expert_count")
        return int(n) if n is not None else None

    @property
    def top_k(self) -> int | None:
        n = self.get("expert_used_count")
        return int(n) if n is not None else None

    @property
    def groups(self) -> tuple[int | None, int | None]:
        """(``expert_group_count``, ``expert_group_used_count``), ``None`` where absent."""
        g, u = self.get("expert_group_count"), self.get("expert_group_used_count")
        return (int(g) if g is not None else None, int(u) if u is not None else None)

    @property
    def nextn_layers(self) -> list[int]:
        """The next-token-prediction (MTP) layers: the last ``nextn_predict_layers`` blocks."""
        n = int(self.get("nextn_predict_layers", 0) or 0)
        blocks = int(self.get("block_count", 0) or 0)
        return list(range(blocks - n, blocks)) if n else []

    def layer_tensors(self) -> dict[int, list[str]]:
        """Layer number -> names of its ``blk.<L>.*`` tensors, in file order."""
        out: dict[int, list[str]] = {}
        for p in self.parts:
            for t in p.tensors:
                m = BLOCK_RE.match(t.name)
                if m:
                    out.setdefault(int(m["layer"]), []).append(t.name)
        return out


def split_parts(path: Path) -> list[Path]:
    """The files of the model ``path`` names: itself, or every part of its split (``path``
    must be the first); refuses a split with a part missing."""
    m = SPLIT_RE.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    if int(m["no"]) != 1:
        first = path.with_name(f"{m['stem']}-00001-of-{m['count']}.gguf")
        raise GGUFError(
            f"{path} is part {int(m['no'])} of a split model; give its first part {first}"
        )
    parts = [
        path.with_name(f"{m['stem']}-{i:05d}-of-{m['count']}.gguf") for i in range(1, count + 1)
    ]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise GGUFError(f"split model {path}: part(s) {missing} are missing next to it")
    return parts


def read_part(path: Path) -> GGUFPart:
    """One GGUF file's fields and tensors (headers only).

    :raises GGUFError: not a GGUF file this reader understands
    """
    import gguf
    import numpy as np

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFError(f"{path} is not a GGUF file (no GGUF magic at its start)")
    try:
        reader = gguf.GGUFReader(path, "r")
    except (ValueError, KeyError, IndexError) as exc:
        raise GGUFError(f"{path} is not a GGUF file llama.cpp can read ({exc})") from exc
    if reader.byte_order == "S":
        raise GGUFError(f"{path} is a big-endian GGUF; convert it to little-endian first")
    data = reader.data
    kvs = [f for f in reader.fields.values() if not f.name.startswith("GGUF.")]
    ends = [f.offset for f in kvs[1:]]
    first_info = reader.tensors[0].field.offset if reader.tensors else None
    ends.append(first_info if first_info is not None else _fields_end(kvs[-1]) if kvs else 0)
    fields = []
    for f, end in zip(kvs, ends):
        single = len(f.types) == 1 and f.types[0] != gguf.GGUFValueType.ARRAY
        fields.append(
            RawField(
                key=f.name,
                types=tuple(int(t) for t in f.types),
                raw=bytes(data[f.offset : end]),
                value=f.contents() if single or f.name.startswith(_READ_ARRAYS) else None,
            )
        )
    tensors = [
        GGUFTensor(
            name=t.name,
            dims=tuple(int(d) for d in t.shape),
            ggml_type=int(t.tensor_type),
            offset=int(t.data_offset),
            nbytes=int(t.n_bytes),
        )
        for t in reader.tensors
    ]
    version = int(np.asarray(reader.fields["GGUF.version"].parts[-1])[0])
    return GGUFPart(
        path=path, version=version, alignment=reader.alignment, fields=fields, tensors=tensors
    )


def _fields_end(f) -> int:
    return f.offset + sum(int(p.nbytes) for p in f.parts)


def inspect_gguf(path: str | os.PathLike) -> GGUFLayout:
    """The layout of the GGUF model at ``path`` (a file, or the first part of a split).

    :raises GGUFError: not a readable GGUF, a split part missing, no architecture key
    """
    path = gguf_model_file(path) or Path(path)
    if not path.is_file():
        raise GGUFError(f"{path} does not exist or is not a file; give the .gguf file")
    parts = [read_part(p) for p in split_parts(path)]
    first = parts[0]
    values = {f.key: f.value for f in first.fields if f.value is not None}
    arch = values.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"{path} has no general.architecture key; it is not a llama.cpp model file")
    names = [t.name for p in parts for t in p.tensors]
    dup = sorted(n for n, c in Counter(names).items() if c > 1)
    if dup:
        raise GGUFError(f"{path}: tensor(s) {dup[:4]} appear more than once across its parts")
    return GGUFLayout(path=path, parts=parts, arch=arch, values=values)
