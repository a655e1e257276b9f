"""Streaming byte-range copy: an output shard written from runs of source bytes.

Kept tensors are never decoded: the writer copies only the kept byte ranges of the
source shard behind a new header, in the kernel (``os.copy_file_range``: no copy through
user space, extents shared where the filesystem can), then checksums the file as written,
read back from the page cache through a small ring of buffers on a helper thread. Where
the kernel cannot copy between the two files, the ranges go through the ring
(``preadv`` / ``pwrite``). Memory: the ring, whatever the shard size.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .errors import CheckpointError

__all__ = [
    "ByteMover",
    "CHUNK_BYTES",
    "copy_range",
    "default_output_checksum",
    "merge_ranges",
    "new_hasher",
]

#: streaming I/O: chunk size and number of ring buffers (memory = CHUNK * BUFFERS)
#: (``REAP_CHUNK_MB`` may be fractional: the interruption tests use ~10 KiB chunks)
CHUNK_BYTES = max(4096, int(float(os.environ.get("REAP_CHUNK_MB", "16")) * (1 << 20)))
RING_BUFFERS = 3


def merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for b, e in ranges:
        if b == e:
            continue
        if out and out[-1][1] == b:
            out[-1] = (out[-1][0], e)
        else:
            if out and b < out[-1][1]:
                raise CheckpointError("internal error: overlapping or unordered byte ranges")
            out.append((b, e))
    return out


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        n = os.write(fd, view)
        view = view[n:]


def default_output_checksum() -> str:
    """``xxh3_128`` when the ``xxhash`` package (a dependency of ``datasets``) is
    importable, else ``sha256``.  Output shards only: sha256 runs at ~1.2-1.5 GiB/s
    per core, slower than copying from the page cache; xxh3 at ~25 GiB/s."""
    try:
        import xxhash  # noqa: F401
    except ImportError:  # pragma: no cover - datasets brings it
        return "sha256"
    return "xxh3_128"


def new_hasher(kind: str):
    """A hashlib-like object for ``kind`` (``sha256`` or ``xxh3_128``)."""
    if kind == "sha256":
        return hashlib.sha256()
    if kind == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    raise CheckpointError(f"unknown checksum {kind!r}; use sha256 or xxh3_128")


#: errors of ``copy_file_range`` that mean "not between these files": copy through a buffer
_NO_KERNEL_COPY = (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM)


def copy_range(
    fd_in: int,
    fd_out: int,
    begin: int,
    end: int,
    out_pos: int,
    *,
    chunk: int | None = None,
    buffer: memoryview | None = None,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Copy bytes ``[begin, end)`` of ``fd_in`` to offset ``out_pos`` of ``fd_out``, in
    pieces of at most ``chunk`` bytes (``progress`` is called after each): in the kernel
    where it can, else through ``buffer``.

    :raises CheckpointError: the source ends before ``end``
    """
    chunk = chunk or CHUNK_BYTES
    kernel = True
    while begin < end:
        want = min(chunk, end - begin)
        n = 0
        if kernel:
            try:
                n = os.copy_file_range(fd_in, fd_out, want, begin, out_pos)
            except OSError as exc:
                if exc.errno not in _NO_KERNEL_COPY:
                    raise
                kernel = False
        if not kernel:
            buf = buffer if buffer is not None else memoryview(bytearray(min(chunk, end - begin)))
            n = os.preadv(fd_in, [buf[: min(want, len(buf))]], begin)
            done = 0
            while done < n:
                done += os.pwrite(fd_out, buf[done:n], out_pos + done)
        if n <= 0:
            raise CheckpointError(f"unexpected end of the source at byte {begin}")
        if progress is not None:
            progress(n)
        begin += n
        out_pos += n


class ByteMover:
    """Copies byte ranges of a source file into a new file and checksums what it wrote.

    The ranges are copied in the kernel (:func:`copy_range`); the new file is then read back
    (from the page cache) through a ring of :data:`RING_BUFFERS` buffers of
    :data:`CHUNK_BYTES` allocated once per rewrite, and checksummed on a helper thread
    (hashlib / xxhash release the GIL) while the next piece is read. Memory: the ring,
    whatever the shard size.
    """

    def __init__(self, kind: str = "sha256"):
        self.kind = kind
        self.ring = [memoryview(bytearray(CHUNK_BYTES)) for _ in range(RING_BUFFERS)]
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="reap-out-hash")

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def copy(
        self,
        src: Path,
        dst: Path,
        head: bytes,
        segments: list[tuple[int, int]],
        *,
        progress: Callable[[int], None] | None = None,
        after_first_chunk: Callable[[], None] | None = None,
    ) -> str:
        """Write ``head`` then source byte ``segments`` (ascending) to ``dst``; return
        the checksum (:attr:`kind`) of ``dst``."""
        fd_in = os.open(src, os.O_RDONLY)
        try:
            fd_out = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _write_all(fd_out, memoryview(head))
                pos = len(head)
                first = [after_first_chunk]

                def step(n: int) -> None:
                    if progress is not None:
                        progress(n)
                    if first[0] is not None:
                        hook, first[0] = first[0], None
                        hook()

                for b, e in merge_ranges(segments):
                    try:
                        copy_range(fd_in, fd_out, b, e, pos, buffer=self.ring[0], progress=step)
                    except CheckpointError as exc:
                        raise CheckpointError(f"{src}: {exc}") from None
                    pos += e - b
                return self._checksum(fd_out, pos)
            finally:
                os.close(fd_out)
        finally:
            os.close(fd_in)

    def _checksum(self, fd: int, size: int) -> str:
        """The checksum of the first ``size`` bytes of ``fd``: each ring buffer read while
        the previous one is hashed."""
        h = new_hasher(self.kind)
        pending: list[Future | None] = [None] * RING_BUFFERS
        slot, pos = 0, 0
        try:
            while pos < size:
                if pending[slot] is not None:
                    pending[slot].result()
                    pending[slot] = None
                buf = self.ring[slot]
                n = os.preadv(fd, [buf[: min(CHUNK_BYTES, size - pos)]], pos)
                if n <= 0:
                    raise CheckpointError(f"internal error: the written shard ends at byte {pos}")
                pending[slot] = self.pool.submit(h.update, buf[:n])
                pos += n
                slot = (slot + 1) % RING_BUFFERS
        finally:
            for f in pending:  # never leave a buffer in use
                if f is not None:
                    f.result()
        return h.hexdigest()
