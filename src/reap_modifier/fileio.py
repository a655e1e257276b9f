"""Small file helpers shared by every writer: atomic JSON and streaming sha256."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

__all__ = ["sha256_file", "write_json_atomic"]


def sha256_file(path: str | os.PathLike, chunk: int = 16 << 20) -> str:
    """Streaming sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_json_atomic(path: str | os.PathLike, data: dict, **dump_kwargs) -> Path:
    """Write JSON through a temp file in the same directory, then rename
    (``dump_kwargs`` go to ``json.dumps``; default ``indent=1``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, **({"indent": 1} | dump_kwargs)))
    os.replace(tmp, path)
    return path
