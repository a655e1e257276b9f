"""The byte-range copy's placement and its trailing checksum, against independent oracles:
a brute-force search over every residue, Python slicing of the source bytes, ``hashlib`` /
``xxhash`` over the written file, and the offsets in the headers ``reap prune`` writes."""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
import threading

import pytest
import xxhash
from mxfp4_fixtures import write_synthetic_mxfp4

import reap_modifier.checkpoint.byte_copy as bc
from reap_modifier.checkpoint import rewrite_checkpoint
from reap_modifier.checkpoint.safetensors_header import encode_header
from reap_modifier.scores.plan import PruningPlan

A = bc.COPY_ALIGN


def _aligned_bytes(segments, data_start: int) -> int:
    """Bytes of ``segments``, copied back to back from ``data_start``, whose output offset
    equals their source offset modulo COPY_ALIGN (segment by segment, by definition)."""
    pos, total = data_start, 0
    for b, e in segments:
        if (pos - b) % A == 0:
            total += e - b
        pos += e - b
    return total


@pytest.mark.parametrize("seed", range(6))
def test_copy_residue_is_the_best_start(seed):
    """No 8-aligned data start keeps more bytes at their source offset modulo COPY_ALIGN
    than the residue chosen (brute force over every start); the smallest such start wins
    a tie."""
    rng = random.Random(seed)
    pos, segments = rng.randrange(0, 3 * A, 8), []
    for _ in range(rng.randint(1, 12)):
        size = rng.choice([8, 100, A // 2, A, 3 * A + 8 * rng.randrange(100)])
        segments.append((pos, pos + size))
        pos += size + rng.choice([0, 8 * rng.randrange(1, 5000), A])
    got = bc.copy_residue(segments)
    scores = {r: _aligned_bytes(segments, r) for r in range(0, A, 8)}
    best = max(scores.values())
    assert got % 8 == 0 and 0 <= got < A
    assert scores[got] == best and got == min(r for r, v in scores.items() if v == best)


def test_copy_residue_empty():
    assert bc.copy_residue([]) is None


@pytest.mark.parametrize("residue", [0, 8, 4096, A - 8])
def test_encode_header_align(residue):
    """The padded header is the same JSON, 8-aligned, and puts the data start on the residue."""
    entries = [("a", "U8", [3, 5], 0, 15), ("b.weight", "BF16", [4], 15, 23)]
    plain = encode_header(entries, {"format": "pt"})
    padded = encode_header(entries, {"format": "pt"}, align=(residue, A))
    (n,) = struct.unpack("<Q", padded[:8])
    assert n == len(padded) - 8 and n % 8 == 0
    assert (8 + n) % A == residue and len(padded) - len(plain) < A
    assert json.loads(padded[8:]) == json.loads(plain[8:])
    with pytest.raises(ValueError):
        encode_header(entries, None, align=(4, A))


def test_copy_range_first_piece_ends_on_copy_align(tmp_path, monkeypatch):
    """Every piece after the first starts on a multiple of COPY_ALIGN of the source, none
    is longer than the chunk, and the bytes are the source's (Python slicing)."""
    data = os.urandom(5 * A + 1234)
    (tmp_path / "src").write_bytes(data)
    pieces = []
    real = os.copy_file_range

    def spy(fd_in, fd_out, count, offset_src=None, offset_dst=None):
        pieces.append((offset_src, count))
        return real(fd_in, fd_out, count, offset_src, offset_dst)

    monkeypatch.setattr(bc.os, "copy_file_range", spy)
    begin, end, out_pos = 777, 5 * A + 1000, 3
    with open(tmp_path / "src", "rb") as fi, open(tmp_path / "dst", "wb+") as fo:
        bc.copy_range(fi.fileno(), fo.fileno(), begin, end, out_pos, chunk=2 * A)
    assert pieces[0] == (begin, A - begin)
    assert all(b % A == 0 and n <= 2 * A for b, n in pieces[1:])
    assert sum(n for _, n in pieces) == end - begin
    assert (tmp_path / "dst").read_bytes() == b"\0" * out_pos + data[begin:end]


@pytest.mark.parametrize("kind", ["xxh3_128", "sha256"])
def test_trailing_checksum_equals_hash_of_file(tmp_path, monkeypatch, kind):
    """Written in uneven steps across many windows, the digest is the file's."""
    monkeypatch.setattr(bc, "CHUNK_BYTES", 4096)
    rng = random.Random(1)
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        trail = bc.TrailingChecksum(fd, kind)
        size = 0
        while size < 300_000:
            block = os.urandom(rng.choice([1, 17, 4096, 10_000, 65_537]))
            os.write(fd, block)
            size += len(block)
            trail.advance(size)
        digest = trail.finish(size)
    finally:
        os.close(fd)
    oracle = hashlib.sha256() if kind == "sha256" else xxhash.xxh3_128()
    oracle.update(path.read_bytes())
    assert digest == oracle.hexdigest()


def test_trailing_checksum_cancel_and_error(tmp_path):
    """cancel() stops the thread; a failure on the thread is raised by finish()."""
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    fd = os.open(path, os.O_RDWR)
    try:
        before = threading.active_count()
        trail = bc.TrailingChecksum(fd, "xxh3_128")
        trail.advance(5)
        trail.cancel()
        assert threading.active_count() == before
        trail = bc.TrailingChecksum(fd, "xxh3_128")
        with pytest.raises(ValueError):  # mapping past the end of the file
            trail.finish(10 << 20)
    finally:
        os.close(fd)


def test_prune_keeps_most_bytes_at_their_source_offset(tmp_path):
    """In every shard ``reap prune`` writes, the kept bytes whose offset equals their
    source offset modulo COPY_ALIGN outnumber those of any other residue (read tensor by
    tensor from the written and the source headers; output expert ``j`` is kept id
    ``KEEP[j]``)."""
    import re

    from reap_modifier.checkpoint.safetensors_header import read_safetensors_header

    keep = [0, 2, 3, 7, 8, 9, 13, 14]
    info = write_synthetic_mxfp4(
        tmp_path / "src", num_layers=3, num_experts=16, hidden=256, inter=128, shard_bytes=1 << 20
    )
    plan = PruningPlan(kept={b: keep for b in info["blocks"]}, num_experts=16)
    dst = rewrite_checkpoint(tmp_path / "src", plan, tmp_path / "out", progress=False)
    source = {}
    for p in (tmp_path / "src").glob("*.safetensors"):
        source.update(read_safetensors_header(p).entries)
    expert = re.compile(r"^(.*\.experts\.)(\d+)(\..*)$")
    checked = 0
    for p in sorted(dst.glob("*.safetensors")):
        by_residue: dict[int, int] = {}
        for name, e in read_safetensors_header(p).entries.items():
            m = expert.match(name)
            src = source.get(f"{m[1]}{keep[int(m[2])]}{m[3]}" if m else name)
            if src is not None and src.nbytes == e.nbytes:
                r = (src.begin - e.begin) % A
                by_residue[r] = by_residue.get(r, 0) + e.nbytes
        assert by_residue.get(0, 0) == max(by_residue.values()), (p.name, by_residue)
        checked += len(by_residue) > 1  # the gaps of dropped experts moved some bytes
    assert checked
