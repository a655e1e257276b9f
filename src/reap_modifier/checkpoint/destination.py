"""The output directory: refused when it would touch the source or existing data, and
filled atomically (built in a temp directory beside it, renamed into place)."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from .errors import DestinationError

__all__ = ["check_destination", "swap_into_place"]

def _is_within(child: Path, parent: Path) -> bool:
    try:
        child.relative_to(parent)
        return True
    except ValueError:
        return False


def check_destination(src: str | os.PathLike, dst: str | os.PathLike, *, force: bool = False) -> Path:
    """Refuse a destination that would overwrite or modify the source, or existing data.

    ``dst == src``, ``dst`` inside ``src`` and ``src`` inside ``dst`` are refused
    always; an existing non-empty ``dst`` (or a file) unless ``force``.
    Returns the absolute destination path.
    """
    src_r = Path(src).resolve()
    dst_abs = Path(os.path.abspath(dst))
    dst_r = dst_abs.resolve()
    if dst_r == src_r:
        raise DestinationError(f"output {dst} is the source checkpoint; refusing to overwrite it (even with --force)")
    if _is_within(dst_r, src_r):
        raise DestinationError(f"output {dst} is inside the source checkpoint {src}; the source is never modified")
    if _is_within(src_r, dst_r):
        raise DestinationError(f"the source {src} is inside the output {dst}; refusing (it would be replaced)")
    if dst_abs.exists() or dst_abs.is_symlink():
        if dst_abs.is_dir() and not dst_abs.is_symlink() and not any(dst_abs.iterdir()):
            return dst_abs
        if not force:
            kind = "a non-empty directory" if dst_abs.is_dir() else "a file"
            raise DestinationError(f"output {dst} exists and is {kind}; pass --force (force=True) to replace it")
    if not dst_abs.parent.is_dir():
        raise DestinationError(f"the parent directory of {dst} does not exist")
    return dst_abs


def swap_into_place(tmp: Path, dst: Path) -> None:
    old = None
    if dst.exists() or dst.is_symlink():
        if dst.is_dir() and not dst.is_symlink():
            if any(dst.iterdir()):
                old = dst.with_name(f".{dst.name}.reap-old-{uuid.uuid4().hex[:8]}")
                os.rename(dst, old)
            else:
                dst.rmdir()
        else:
            old = dst.with_name(f".{dst.name}.reap-old-{uuid.uuid4().hex[:8]}")
            os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except BaseException:
        if old is not None:
            os.rename(old, dst)
        raise
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
