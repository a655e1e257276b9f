"""The output directory: refused when it would touch the source or existing data,
claimed by one run at a time, and filled atomically (built in a temp directory beside
it, then swapped into place).

Every run into DST holds an exclusive ``flock`` on ``.{DST}.reap-lock`` (next to DST)
from before its first write until after the rename; the kernel drops the lock when the
process dies, even by SIGKILL, so a lock file left behind is never "held".  Work
directories are ``.{DST}.reap-tmp-XXXXXXXX`` (the output being built) and, where no
atomic exchange exists, ``.{DST}.reap-old-XXXXXXXX`` (the previous DST during the
swap).  Whoever holds the claim knows every such directory is a leftover of a run that
died: it removes tmp ones and puts an orphaned previous DST back.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from pathlib import Path

from loguru import logger

from ..pause_points import pause_point
from .errors import DestinationError

__all__ = ["DestinationClaim", "check_destination", "swap_into_place", "work_dir_kind", "work_path"]


#: ``.{DST}.reap-tmp-XXXXXXXX`` / ``.{DST}.reap-old-XXXXXXXX``
_WORK_NAME_RE = re.compile(r"^\.(?P<dst>.+)\.reap-(?P<kind>tmp|old)-[0-9a-f]{8}$")


def _is_within(child: Path, parent: Path) -> bool:
    try:
        child.relative_to(parent)
        return True
    except ValueError:
        return False


def check_destination(
    src: str | os.PathLike, dst: str | os.PathLike, *, force: bool = False
) -> Path:
    """Refuse a destination that would overwrite or modify the source, or existing data.

    ``dst == src``, ``dst`` inside ``src`` and ``src`` inside ``dst`` are refused
    always; an existing non-empty ``dst`` (or a file) unless ``force``; a parent
    directory that does not exist or that this process cannot write in (the output is
    built next to ``dst`` and renamed).  Returns the absolute destination path.
    """
    src_r = Path(src).resolve()
    dst_abs = Path(os.path.abspath(dst))
    dst_r = dst_abs.resolve()
    if dst_r == src_r:
        raise DestinationError(
            f"output {dst} is the source checkpoint; refusing to overwrite it (even with --force)"
        )
    if _is_within(dst_r, src_r):
        raise DestinationError(
            f"output {dst} is inside the source checkpoint {src}; the source is never modified"
        )
    if _is_within(src_r, dst_r):
        raise DestinationError(
            f"the source {src} is inside the output {dst}; refusing (it would be replaced)"
        )
    if _WORK_NAME_RE.match(dst_abs.name):
        raise DestinationError(
            f"output {dst} has the name of a reap prune temporary directory; choose another name"
        )
    if dst_abs.exists() or dst_abs.is_symlink():
        empty_dir = dst_abs.is_dir() and not dst_abs.is_symlink() and not any(dst_abs.iterdir())
        if not empty_dir and not force:
            kind = "a non-empty directory" if dst_abs.is_dir() else "a file"
            raise DestinationError(
                f"output {dst} exists and is {kind}; pass --force (force=True) to replace it"
            )
    parent = dst_abs.parent
    if not parent.is_dir():
        raise DestinationError(f"the parent directory of {dst} does not exist")
    kwargs = {"effective_ids": True} if os.access in os.supports_effective_ids else {}
    if not os.access(parent, os.W_OK | os.X_OK, **kwargs):
        raise DestinationError(
            f"{parent} is not writable: the output is written to a temporary directory there "
            "and renamed to its name; choose an --out in a folder you can write"
        )
    return dst_abs


def work_dir_kind(path: str | os.PathLike) -> str | None:
    """``"tmp"`` / ``"old"`` when ``path`` is named like a work directory of ``reap prune``."""
    m = _WORK_NAME_RE.match(Path(os.path.abspath(path)).name)
    return m["kind"] if m else None


def work_path(dst: Path, kind: str) -> Path:
    return dst.with_name(f".{dst.name}.reap-{kind}-{uuid.uuid4().hex[:8]}")


def _leftovers(dst: Path) -> list[Path]:
    out = []
    for p in dst.parent.iterdir():
        m = _WORK_NAME_RE.match(p.name)
        if m and m["dst"] == dst.name:
            out.append(p)
    return sorted(out)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


class DestinationClaim:
    """Exclusive claim on an output path (see the module docstring); a context manager.

    ``acquire`` raises :class:`DestinationError` when another live run holds the
    claim (naming its pid) or when the parent directory cannot be written.
    """

    def __init__(self, dst: Path):
        self.dst = dst
        self.lock_path = dst.with_name(f".{dst.name}.reap-lock")
        self._fd: int | None = None
        #: False on a filesystem without locks: leftovers are then only named, not removed
        self.locked = False

    def acquire(self) -> DestinationClaim:
        import fcntl
        import socket
        import time

        while True:
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise DestinationError(
                    f"cannot create {self.lock_path.name} in {self.dst.parent} ({exc.strerror}); "
                    "choose an --out in a folder you can write"
                ) from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "unknown pid"
                finally:
                    os.close(fd)
                raise DestinationError(
                    f"another reap prune ({holder}) is writing {self.dst} right now; wait for it "
                    f"to finish or stop it, then rerun (lock: {self.lock_path})"
                ) from None
            except OSError as exc:  # a filesystem without locks (ENOLCK, EOPNOTSUPP)
                logger.warning(
                    f"REAP: cannot lock {self.lock_path} ({exc.strerror}); nothing stops another "
                    f"run writing {self.dst} at the same time"
                )
                self._fd = fd
                return self
            try:
                same = os.stat(self.lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the previous holder removed the file meanwhile: lock the new one
                os.close(fd)
                continue
            info = f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
            os.ftruncate(fd, 0)
            os.pwrite(fd, (info + "\n").encode(), 0)
            self._fd = fd
            self.locked = True
            return self

    def clean_leftovers(self) -> None:
        """Remove work directories of runs that died (only ever called with the claim held)."""
        if not self.locked:  # they may belong to a live run
            for p in _leftovers(self.dst):
                logger.warning(
                    f"REAP: {p} may be left by an interrupted reap prune into {self.dst}; "
                    "remove it by hand once no run writes there"
                )
            return
        for p in _leftovers(self.dst):
            if work_dir_kind(p) == "old" and not (self.dst.exists() or self.dst.is_symlink()):
                logger.warning(
                    f"REAP: {p} is {self.dst} as it was before an interrupted swap; putting it back"
                )
                os.rename(p, self.dst)
                continue
            logger.warning(f"REAP: removing {p}, left by an interrupted reap prune into {self.dst}")
            _remove(p)

    def release(self) -> None:
        if self._fd is None:
            return
        if self.locked:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.lock_path)  # while still holding it (see acquire's inode check)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> DestinationClaim:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _rename_exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two paths (Linux ``renameat2(RENAME_EXCHANGE)``); ``False``
    where the system or the filesystem cannot."""
    import ctypes
    import errno
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def swap_into_place(tmp: Path, dst: Path) -> None:
    """Rename the finished ``tmp`` to ``dst``.  A previous ``dst`` (``--force``) is
    exchanged atomically with ``tmp`` where possible, so at every instant ``dst`` is
    either the previous output or the new one; then the previous one is removed."""
    if dst.exists() or dst.is_symlink():
        empty_dir = dst.is_dir() and not dst.is_symlink() and not any(dst.iterdir())
        if not empty_dir:
            if _rename_exchange(tmp, dst):
                pause_point("swapped")
                _remove_previous(tmp, dst)  # tmp now holds the previous output
                return
            old = work_path(dst, "old")
            os.rename(dst, old)
            try:
                os.rename(tmp, dst)
            except BaseException:
                os.rename(old, dst)
                raise
            _remove_previous(old, dst)
            return
    os.rename(tmp, dst)  # replaces an empty directory


def _remove_previous(path: Path, dst: Path) -> None:
    """Delete the replaced output; the new one is in place, so nothing here may fail
    the run (what is left is a work directory the next run into ``dst`` removes)."""
    try:
        _remove(path)
    except BaseException as exc:  # noqa: BLE001 - including Ctrl-C: dst is complete
        logger.warning(
            f"REAP: {dst} is complete; could not remove the previous output at {path} ({exc!r})"
        )
