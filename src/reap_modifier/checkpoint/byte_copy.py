"""Streaming byte-range copy: an output shard written from runs of source bytes.

Kept tensors are never decoded: the writer copies only the kept byte ranges of the
source shard behind a new header, in the kernel (``os.copy_file_range``: no copy through
user space, extents shared where the filesystem can), then checksums the file as written,
mapped read-only from the page cache one window at a time. Where the kernel cannot copy between the two files,
the ranges go through one buffer (``preadv`` / ``pwrite``). Memory: that buffer at most,
whatever the shard size.

The kernel copies page-cache pages at ``cp`` speed only where a byte lands at the same
offset modulo :data:`COPY_ALIGN` as in its source; :func:`copy_residue` says where the
output's data should start for that (the header is padded to it).
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from .errors import CheckpointError

__all__ = [
    "ByteMover",
    "CHUNK_BYTES",
    "COPY_ALIGN",
    "checksum_fd",
    "copy_range",
    "copy_residue",
    "default_output_checksum",
    "merge_ranges",
    "new_hasher",
]

#: streaming I/O: bytes per kernel copy (a progress step) and of the fallback buffer
#: (``REAP_CHUNK_MB`` may be fractional: the interruption tests use ~10 KiB chunks)
CHUNK_BYTES = max(4096, int(float(os.environ.get("REAP_CHUNK_MB", "16")) * (1 << 20)))


#: the kernel's copy (``copy_file_range`` -> splice) moves 16 pages at a time; between
#: page-cached files on ext4 (Linux 6.18) it costs ~1.6x the CPU per byte unless each step
#: starts on a multiple of this in both files: the output keeps the source's offsets
#: modulo it (:func:`copy_residue`) and :func:`copy_range` cuts its first piece at a
#: multiple of it (``benchmarks/bench_prune_throughput.py --alignment``)
COPY_ALIGN = 16 * mmap.PAGESIZE


def copy_residue(segments: list[tuple[int, int]]) -> int | None:
    """Where (modulo :data:`COPY_ALIGN`) output data made of ``segments`` copied back to
    back should start so that the most bytes keep their source offset modulo
    :data:`COPY_ALIGN`; a multiple of 8 (rounded down), ``None`` without bytes."""
    weight: Counter[int] = Counter()
    rel = 0
    for b, e in segments:
        weight[(b - rel) % COPY_ALIGN] += e - b
        rel += e - b
    if not weight:
        return None
    best = max(weight, key=lambda r: (weight[r], -r))
    return best - best % 8


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
    pieces of at most ``chunk`` bytes (``progress`` is called after each), the first one
    ending on a multiple of :data:`COPY_ALIGN` of the source: in the kernel where it can,
    else through ``buffer``.

    :raises CheckpointError: the source ends before ``end``
    """
    chunk = chunk or CHUNK_BYTES
    kernel = True
    while begin < end:
        want = min(chunk, end - begin)
        misfit = begin % COPY_ALIGN
        if misfit and want > COPY_ALIGN - misfit:
            want = COPY_ALIGN - misfit
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

    The ranges are copied in the kernel (:func:`copy_range`); the new file is then
    checksummed as the page cache holds it (:func:`checksum_fd`: mapped read-only, one
    window at a time, no copy to user space). A
    buffer of :data:`CHUNK_BYTES` is allocated only where the kernel cannot copy.
    Memory: that buffer at most, whatever the shard size.
    """

    def __init__(self, kind: str = "sha256"):
        self.kind = kind
        self._buffer: memoryview | None = None

    def close(self) -> None:
        self._buffer = None

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
                        copy_range(
                            fd_in, fd_out, b, e, pos, buffer=self._fallback_buffer, progress=step
                        )
                    except CheckpointError as exc:
                        raise CheckpointError(f"{src}: {exc}") from None
                    pos += e - b
                return checksum_fd(fd_out, pos, self.kind)
            finally:
                os.close(fd_out)
        finally:
            os.close(fd_in)

    @property
    def _fallback_buffer(self) -> memoryview:
        if self._buffer is None or len(self._buffer) != CHUNK_BYTES:
            self._buffer = memoryview(bytearray(CHUNK_BYTES))
        return self._buffer


def checksum_fd(fd: int, size: int, kind: str) -> str:
    """The checksum ``kind`` of the first ``size`` bytes of the open file ``fd``, read
    from the page cache through read-only mappings of :data:`CHUNK_BYTES` (rounded to the
    mapping granularity), one at a time: no copy to user space, and the process's resident
    memory grows by one window at most."""
    h = new_hasher(kind)
    gran = mmap.ALLOCATIONGRANULARITY
    window = max(gran, CHUNK_BYTES // gran * gran)
    for offset in range(0, size, window):
        with mmap.mmap(fd, min(window, size - offset), prot=mmap.PROT_READ, offset=offset) as mm:
            view = memoryview(mm)
            try:
                h.update(view)
            finally:
                view.release()
    return h.hexdigest()
