"""Small file helpers shared by every writer: atomic JSON and streaming sha256."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
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
    text = json.dumps(data, **({"indent": 1} | dump_kwargs))
    path.parent.mkdir(parents=True, exist_ok=True)
    # a temp name of its own: concurrent writers of one file (the sha256 cache) must
    # not write into each other's temp file; removed if anything fails
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    """The process umask, read without changing it (``os.umask`` sets it, which
    would race with other threads creating files); 0o022 where /proc cannot tell."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022
