"""A checkpoint's files read for ``reap verify``: config, weight map and shard headers,
every problem recorded in the report instead of raised, so that one run lists them all."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import CheckpointError
from .layout import read_weight_map
from .safetensors_header import ShardHeader, read_safetensors_header
from .verify_report import VerifyReport

__all__ = ["load_structure"]


def load_structure(path: Path, report: VerifyReport, label: str):
    """Config, weight map, headers; failures go to ``report``. Returns None if unusable."""
    if not path.is_dir():
        report.fail(f"{label} {path} is not a directory")
        return None
    cfg_file = path / "config.json"
    try:
        config = json.loads(cfg_file.read_text())
    except FileNotFoundError:
        report.fail(f"{label}: no config.json in {path}")
        return None
    except json.JSONDecodeError as exc:
        report.fail(f"{label}: config.json is not valid JSON: {exc}")
        return None
    try:
        index_file, weight_map = read_weight_map(path)
    except CheckpointError as exc:
        report.fail(f"{label}: {exc}")
        return None
    shards: dict[str, ShardHeader] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = path / shard
        if not shard_path.is_file():
            report.fail(f"{label}: shard {shard} (named by the index) does not exist")
            continue
        try:
            shards[shard] = read_safetensors_header(shard_path, shard)
        except CheckpointError as exc:
            report.fail(f"{label}: {exc}")
    entries = {}
    for name, shard in weight_map.items():
        if shard not in shards:
            continue
        if name not in shards[shard].entries:
            report.fail(f"{label}: index puts {name} in {shard}, which lacks it")
            continue
        entries[name] = shards[shard].entries[name]
    for shard, header in shards.items():
        orphans = sorted(set(header.entries) - {n for n, s in weight_map.items() if s == shard})
        for name in orphans:
            report.fail(f"{label}: tensor {name} is in {shard} but not in the index")
    indexed = set(weight_map.values())
    for p in sorted(path.rglob("*.safetensors")):
        rel = p.relative_to(path).as_posix()
        if p.is_file() and rel not in indexed:
            report.fail(f"{label}: safetensors file {rel} is not referenced by the index")
    return config, index_file, weight_map, shards, entries
