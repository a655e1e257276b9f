"""Streaming byte-range copy: an output shard written from runs of source bytes.

Kept tensors are never decoded: the writer copies only the kept byte ranges of the
source shard behind a new header, in the kernel (``os.copy_file_range``: no copy through
user space, extents shared where the filesystem can), while a helper thread checksums the
file as written, a window behind the copy, mapped read-only from the page cache. Where
the kernel cannot copy between the two files, the ranges go through one buffer
(``preadv`` / ``pwrite``). Memory: that buffer and one mapped window at most, whatever the
shard size.

The kernel copies page-cache pages at ``cp`` speed only where a byte lands at the same
offset modulo :data:`COPY_ALIGN` as in its source; :func:`copy_residue` says where the
output's data should start for that (the header is padded to it).
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from .errors import CheckpointError

__all__ = [
    "ByteMover",
    "CHUNK_BYTES",
    "COPY_ALIGN",
    "copy_range",
    "copy_residue",
    "default_output_checksum",
    "merge_ranges",
    "new_hasher",
    "TrailingChecksum",
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
    buffer: memoryview | Callable[[], memoryview] | None = None,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Copy bytes ``[begin, end)`` of ``fd_in`` to offset ``out_pos`` of ``fd_out``, in
    pieces of at most ``chunk`` bytes (``progress`` is called after each), the first one
    ending on a multiple of :data:`COPY_ALIGN` of the source: in the kernel where it can,
    else through ``buffer`` (or the buffer it returns, when it is a callable: asked for
    only then).

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
            if callable(buffer):
                buffer = buffer()
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

    The ranges are copied in the kernel (:func:`copy_range`) while the new file is
    checksummed as the page cache holds it, a window behind the copy
    (:class:`TrailingChecksum`). A buffer of :data:`CHUNK_BYTES` is allocated only where
    the kernel cannot copy. Memory: that buffer and one mapped window at most, whatever
    the shard size.
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
            trail = None
            try:
                _write_all(fd_out, memoryview(head))
                written = [len(head)]
                trail = TrailingChecksum(fd_out, self.kind)
                trail.advance(written[0])
                first = [after_first_chunk]

                def step(n: int) -> None:
                    written[0] += n
                    trail.advance(written[0])
                    if progress is not None:
                        progress(n)
                    if first[0] is not None:
                        hook, first[0] = first[0], None
                        hook()

                pos = len(head)
                for b, e in merge_ranges(segments):
                    try:
                        copy_range(
                            fd_in, fd_out, b, e, pos, buffer=self._fallback_buffer, progress=step
                        )
                    except CheckpointError as exc:
                        raise CheckpointError(f"{src}: {exc}") from None
                    pos += e - b
                digest, trail = trail.finish(pos), None
                return digest
            finally:
                try:
                    if trail is not None:
                        trail.cancel()
                finally:
                    os.close(fd_out)
        finally:
            os.close(fd_in)

    def _fallback_buffer(self) -> memoryview:
        if self._buffer is None or len(self._buffer) != CHUNK_BYTES:
            self._buffer = memoryview(bytearray(CHUNK_BYTES))
        return self._buffer


class TrailingChecksum:
    """The checksum ``kind`` of a file written front to back, computed on a helper thread
    that follows the writer: :meth:`advance` says how many leading bytes are written, the
    thread hashes each full window of :data:`CHUNK_BYTES` (rounded to the mapping
    granularity) as it completes, mapped read-only from the page cache (no copy to user
    space), and :meth:`finish` hashes the rest and returns the digest. The writer's thread
    does no hashing; the file is read once more, from the page cache, on another core."""

    def __init__(self, fd: int, kind: str):
        self._fd = fd
        self._hasher = new_hasher(kind)
        gran = mmap.ALLOCATIONGRANULARITY
        self._gran = gran
        self._window = max(gran, CHUNK_BYTES // gran * gran)
        self._cond = threading.Condition()
        self._written = self._done = 0
        self._closed = self._aborted = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="reap-output-checksum", daemon=True)
        self._thread.start()

    def advance(self, written: int) -> None:
        """The first ``written`` bytes of the file are written."""
        with self._cond:
            self._written = written
            if written - self._done >= self._window:
                self._cond.notify()

    def finish(self, size: int) -> str:
        """The file is complete at ``size`` bytes: its checksum (hex)."""
        with self._cond:
            self._written, self._closed = size, True
            self._cond.notify()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._hasher.hexdigest()

    def cancel(self) -> None:
        """Stop the thread (the write failed); returns once it has stopped."""
        with self._cond:
            self._aborted = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while True:
                        if self._aborted:
                            return
                        ready = self._written - self._done
                        if ready >= self._window or (self._closed and ready > 0):
                            break
                        if self._closed:
                            return
                        self._cond.wait()
                    begin = self._done
                    end = begin + min(ready, self._window)
                self._hash(begin, end)
                self._done = end
        except BaseException as exc:  # re-raised by finish()
            self._error = exc

    def _hash(self, begin: int, end: int) -> None:
        offset = begin - begin % self._gran
        with mmap.mmap(self._fd, end - offset, prot=mmap.PROT_READ, offset=offset) as mm:
            view = memoryview(mm)[begin - offset :]
            try:
                self._hasher.update(view)
            finally:
                view.release()
