"""sha256 of the source shards: a thread pool beside the writer, with a cache."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from loguru import logger

from ..fileio import write_json_atomic
from . import byte_copy
from .errors import CheckpointError

__all__ = ["SourceHasher", "default_hash_cache"]


def default_hash_cache() -> Path | None:
    """``$REAP_SHA256_CACHE`` (``0`` / ``off`` disables), else
    ``$XDG_CACHE_HOME/reap-modifier/sha256.json`` (``~/.cache/...``)."""
    env = os.environ.get("REAP_SHA256_CACHE")
    if env is not None:
        return None if env.strip().lower() in ("", "0", "off", "false", "no") else Path(env)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "reap-modifier" / "sha256.json"


def _file_identity(path: Path) -> dict:
    st = path.stat()
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "ino": st.st_ino,
        "dev": st.st_dev,
    }


class SourceHasher:
    """sha256 of every source shard, computed by a small thread pool while the writer
    runs (each worker streams one whole shard with its own buffer).

    A hash is reused from the cache file when the shard's identity (real path, size,
    mtime, ctime, inode, device) is unchanged, so cutting several tiers from one
    source reads and hashes it once; ``reap verify --source`` always rehashes.
    """

    def __init__(
        self,
        files: Mapping[str, Path],
        *,
        workers: int | None = None,
        cache: Path | None = None,
        progress: Callable[[int], None] | None = None,
    ):
        self.files = dict(files)
        self.workers = workers or max(1, min(8, (os.cpu_count() or 2) - 1))
        self.cache_path = cache
        self.progress = progress
        self.cached: list[str] = []
        self._futures: dict[str, Future] = {}
        self._stop = threading.Event()
        self._pool: ThreadPoolExecutor | None = None
        self._cache: dict = {}
        self._ids: dict[str, dict] = {}
        self._results: dict[str, str] = {}

    def _load_cache(self) -> None:
        if self.cache_path is None or not self.cache_path.is_file():
            return
        try:
            data = json.loads(self.cache_path.read_text())
            self._cache = data.get("files", {}) if data.get("format") == "reap-sha256-cache" else {}
        except (OSError, json.JSONDecodeError):
            self._cache = {}

    @property
    def bytes_to_hash(self) -> int:
        return sum(self._ids[s]["size"] for s in self.files if s not in self._results)

    def prepare(self) -> SourceHasher:
        """Look every shard up in the cache (cheap); :attr:`bytes_to_hash` is then known."""
        if self._ids:
            return self
        self._load_cache()
        for shard, path in self.files.items():
            ident = _file_identity(path)
            self._ids[shard] = ident
            hit = self._cache.get(str(path.resolve()))
            if hit and all(hit.get(k) == v for k, v in ident.items()):
                self._results[shard] = hit["sha256"]
                self.cached.append(shard)
        return self

    def start(self) -> SourceHasher:
        """Start hashing the shards the cache did not answer for."""
        self.prepare()
        todo = [s for s in self.files if s not in self._results]
        if todo:
            self._pool = ThreadPoolExecutor(
                min(self.workers, len(todo)), thread_name_prefix="reap-src-sha256"
            )
            for shard in todo:
                self._futures[shard] = self._pool.submit(self._hash, shard)
        return self

    def _hash(self, shard: str) -> str:
        h = hashlib.sha256()
        buf = memoryview(bytearray(byte_copy.CHUNK_BYTES))
        with open(self.files[shard], "rb", buffering=0) as f:
            while n := f.readinto(buf):
                if self._stop.is_set():
                    raise CheckpointError("source hashing cancelled")
                h.update(buf[:n])
                if self.progress is not None:
                    self.progress(n)
        return h.hexdigest()

    def result(self) -> dict[str, str]:
        """Wait for every hash; check no shard changed meanwhile; update the cache."""
        try:
            for shard, fut in self._futures.items():
                self._results[shard] = fut.result()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
        for shard, path in self.files.items():
            if _file_identity(path) != self._ids[shard]:
                raise CheckpointError(f"source shard {shard} changed while it was being pruned")
        self._save_cache()
        return dict(sorted(self._results.items()))

    def cancel(self) -> None:
        self._stop.set()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _save_cache(self) -> None:
        if self.cache_path is None or not self._futures:
            return
        try:
            self._load_cache()  # merge with what others wrote meanwhile
            for shard in self._futures:
                path = str(self.files[shard].resolve())
                self._cache[path] = {**self._ids[shard], "sha256": self._results[shard]}
            write_json_atomic(
                self.cache_path, {"format": "reap-sha256-cache", "files": self._cache}
            )
        except OSError as exc:  # a cache is an optimisation, never a failure
            logger.warning(f"could not write the sha256 cache {self.cache_path}: {exc}")
