"""sha256 of byte ranges of a file, and a checksum of the whole file, in one sequential
pass; the progress bar of ``reap verify``'s passes over the shards."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from .byte_copy import new_hasher
from .errors import CheckpointError

__all__ = ["hash_ranges", "progress_bar"]

_CHUNK = 16 << 20


def hash_ranges(
    path: Path,
    size: int,
    requests: dict[str, list[tuple[int, int]]],
    *,
    whole: str | None,
    progress: Callable[[int], None] | None = None,
) -> tuple[str | None, dict[str, str]]:
    """Checksum ``whole`` (``sha256`` / ``xxh3_128``) of the whole file, and sha256 of
    each request's byte ranges, in one sequential pass (only the requested ranges are
    read when ``whole`` is None)."""
    hashers = {k: hashlib.sha256() for k in requests}
    segs = sorted((b, e, k) for k, ranges in requests.items() for b, e in ranges if e > b)
    file_h = new_hasher(whole) if whole else None
    if whole:
        windows: Iterable[tuple[int, int]] = [(0, size)]
    else:
        merged: list[tuple[int, int]] = []
        for b, e, _ in segs:
            if merged and merged[-1][1] == b:
                merged[-1] = (merged[-1][0], e)
            else:
                merged.append((b, e))
        windows = merged
    buf = memoryview(bytearray(_CHUNK))
    i = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        for w_begin, w_end in windows:
            pos = w_begin
            while pos < w_end:
                want = min(_CHUNK, w_end - pos)
                n = os.preadv(fd, [buf[:want]], pos)
                if n <= 0:
                    raise CheckpointError(f"{path}: unexpected end of file at byte {pos}")
                chunk = buf[:n]
                end = pos + n
                if file_h is not None:
                    file_h.update(chunk)
                while i < len(segs) and segs[i][0] < end:
                    b, e, k = segs[i]
                    lo, hi = max(b, pos), min(e, end)
                    if lo < hi:
                        hashers[k].update(chunk[lo - pos : hi - pos])
                    if e <= end:
                        i += 1
                    else:
                        break
                if progress is not None:
                    progress(n)
                pos = end
    finally:
        os.close(fd)
    return (file_h.hexdigest() if file_h else None, {k: h.hexdigest() for k, h in hashers.items()})


def progress_bar(progress: bool, total: int, desc: str):
    """A byte-counting tqdm bar when ``progress``, else ``None``."""
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(
        total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, dynamic_ncols=True
    )
