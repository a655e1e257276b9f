"""Small file helpers shared by every writer: atomic writes, a writable-directory check and
streaming sha256.

Every file reap writes goes through :func:`atomic_path` (directly, or through
:func:`write_atomic` / :func:`write_json_atomic`): a temporary file beside the target, renamed
over it when complete, with the mode a plain ``open()`` would have given it under the process
umask (``tempfile.mkstemp`` creates 0600 files).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "atomic_path",
    "output_dir_problem",
    "sha256_file",
    "write_atomic",
    "write_json_atomic",
]


def sha256_file(path: str | os.PathLike, chunk: int = 16 << 20) -> str:
    """Streaming sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` (parent folders created) for the caller to write;
    when the block ends it gets the mode ``0o666 & ~umask`` and is renamed to ``path``; if
    the block raises, it is removed and ``path`` is untouched.

    Example::

        with atomic_path("out/eval.png") as tmp:
            fig.savefig(tmp, format="png")
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a temp name of its own: concurrent writers of one file (the sha256 cache) must
    # not write into each other's temp file
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write ``data`` (``str`` as UTF-8) to ``path`` through :func:`atomic_path`."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    return Path(path)


def write_json_atomic(path: str | os.PathLike, data: dict, **dump_kwargs) -> Path:
    """Write JSON through :func:`atomic_path` (``dump_kwargs`` go to ``json.dumps``;
    default ``indent=1``)."""
    return write_atomic(path, json.dumps(data, **({"indent": 1} | dump_kwargs)))


def output_dir_problem(path: str | os.PathLike) -> str | None:
    """Why a directory could not be created or written at ``path`` (``None`` when it can):
    it is a file, a file stands where one of its parents should be, or the nearest existing
    parent is not writable. Checks only; creates nothing."""
    path = Path(os.path.abspath(path))
    if path.exists() and not path.is_dir():
        return f"{path} is a file, not a directory"
    probe = path
    while not probe.exists():
        if probe.is_symlink():
            return f"{probe} is a broken symbolic link"
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, so {path} cannot be a directory under it"
    kwargs = {"effective_ids": True} if os.access in os.supports_effective_ids else {}
    if not os.access(probe, os.W_OK | os.X_OK, **kwargs):
        return f"{probe} is not writable"
    return None


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
