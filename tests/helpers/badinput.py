"""Helpers of the hardening tests: corrupt a checkpoint or a scores file in a chosen
way, snapshot a directory tree, run the ``reap`` CLI in-process and assert that a user
error is reported cleanly (exit code, message, no traceback, nothing written)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

# ---------------------------------------------------------------------------
# snapshots


def snapshot(path: str | os.PathLike) -> dict[str, str]:
    """relative path -> sha256 (files), ``"<dir>"`` or ``"-> target"`` (symlinks), for
    everything under ``path`` (hidden entries included): "nothing written" means two
    snapshots are equal."""
    path = Path(path)
    out: dict[str, str] = {}
    if not path.exists():
        return out
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path).as_posix()
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_dir():
            out[rel] = "<dir>"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def copy_tree(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Copy a checkpoint (owner-writable, world-readable files) for a test to corrupt."""
    dst = Path(dst)
    shutil.copytree(src, dst)
    for p in [dst, *dst.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return dst


# ---------------------------------------------------------------------------
# corrupting safetensors files and checkpoints


def truncate(path: str | os.PathLike, nbytes: int) -> None:
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[:-nbytes])


def overwrite(path: str | os.PathLike, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def edit_header(path: str | os.PathLike, fn: Callable[[dict], None]) -> None:
    """Rewrite a safetensors header in place, keeping its length (padded with spaces)."""
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        fn(header)
        body = json.dumps(header, separators=(",", ":")).encode()
        if len(body) > n:
            raise ValueError("edited header is longer than the original")
        f.seek(8)
        f.write(body + b" " * (n - len(body)))


def edit_json(path: str | os.PathLike, fn: Callable[[dict], object]) -> None:
    data = json.loads(Path(path).read_text())
    fn(data)
    Path(path).write_text(json.dumps(data, indent=1))


def shard_of(ckpt: str | os.PathLike, name: str) -> str:
    return json.loads((Path(ckpt) / "model.safetensors.index.json").read_text())["weight_map"][name]


def replace_tensor(ckpt: str | os.PathLike, name: str, tensor: torch.Tensor) -> str:
    """Replace tensor ``name`` in its shard (index unchanged); returns the shard name."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shard = shard_of(ckpt, name)
    path = Path(ckpt) / shard
    with safe_open(str(path), framework="pt") as st:
        meta = st.metadata()
        tensors = {k: st.get_tensor(k) for k in st.keys()}
    tensors[name] = tensor
    save_file(tensors, str(path), metadata=meta)
    return shard


# ---------------------------------------------------------------------------
# scores files


def save_scores_variant(base, path: str | os.PathLike, mutate: Callable[[dict], None]) -> Path:
    """Save a copy of ``base`` (an ExpertScores) whose layer tensors ``mutate`` changed
    (``save`` does not validate, so NaN / negative values reach the file)."""
    from reap_modifier.scores import ExpertScores

    layers = {
        layer: {k: v.clone() for k, v in stats.items()} for layer, stats in base.layers.items()
    }
    mutate(layers)
    return ExpertScores(layers=layers, metadata=dict(base.metadata)).save(path)


def set_scores_metadata(path: str | os.PathLike, **changes) -> None:
    """Change keys of a scores file's raw ``reap_scores`` metadata (e.g. ``version=2``)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["reap_scores"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta.update(changes)
    save_file(tensors, str(path), metadata={"reap_scores": json.dumps(meta)})


# ---------------------------------------------------------------------------
# the CLI


def cli(*args):
    """``reap ARGS`` in-process (typer's runner); ``result.output`` has stdout + stderr."""
    from typer.testing import CliRunner

    from reap_modifier.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def assert_clean_error(result, code: int, needles: list[str]) -> None:
    """Exit ``code``, every needle in the output, and no traceback: the command ended
    through ``typer.Exit`` / a usage error, not an uncaught exception."""
    out = result.output
    assert result.exit_code == code, (
        f"exit {result.exit_code} != {code}:\n{out}\n{result.exception!r}"
    )
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"uncaught {type(result.exception).__name__}: {result.exception}\n{out}"
    )
    assert "Traceback" not in out, out
    for needle in needles:
        assert str(needle) in out, f"{needle!r} not in:\n{out}"


# ---------------------------------------------------------------------------
# permissions (root ignores mode bits: drop to an unprivileged user instead)

NOBODY = 65534


@contextlib.contextmanager
def world_scratch():
    """A scratch directory every user can traverse (pytest's tmp dirs are 0700)."""
    d = Path(tempfile.mkdtemp(prefix="reap-perm-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        for p in [d, *d.rglob("*")]:
            with contextlib.suppress(OSError):
                p.chmod(0o755 if p.is_dir() and not p.is_symlink() else 0o644)
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def unprivileged():
    """Run the body with mode bits enforced: as root, with effective uid/gid nobody
    (restored afterwards); as another user, nothing to do."""
    if os.geteuid() != 0:
        yield
        return
    os.setegid(NOBODY)
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def make_read_only(path: str | os.PathLike) -> None:
    """Remove every write bit under ``path`` (directories stay traversable)."""
    path = Path(path)
    for p in sorted([path, *path.rglob("*")], key=lambda q: -len(q.parts)):
        mode = p.stat().st_mode
        p.chmod(stat.S_IMODE(mode) & ~0o222 | (0o555 if p.is_dir() else 0o444))
