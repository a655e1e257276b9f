"""A checkpoint directory's layout: config, weight map, shard headers and MoE blocks.

:func:`inspect_checkpoint` reads them strictly (headers only) into a
:class:`CheckpointLayout`; the MoE blocks are found and classified by
:mod:`.moe_blocks`, the quantization config's sections read by :mod:`.quantization`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..models.moe_fields import NESTED_CONFIGS, config_value, moe_fields
from .errors import CheckpointError
from .moe_blocks import MoEBlock, scan_moe_blocks
from .quantization import quant_configs
from .safetensors_header import ShardHeader, TensorEntry, read_safetensors_header

__all__ = [
    "COUNT_KEY_CONTAINERS",
    "CheckpointLayout",
    "config_count",
    "find_count_keys",
    "inspect_checkpoint",
    "preview",
    "read_weight_map",
    "set_dotted",
]

#: nested configs searched for count / top-k / group keys (besides the top level)
COUNT_KEY_CONTAINERS = NESTED_CONFIGS
#: the one safetensors file of an unindexed checkpoint
SINGLE_FILE_NAME = "model.safetensors"


@dataclass
class CheckpointLayout:
    """Everything about a checkpoint directory that the rewriter needs (headers only)."""

    path: Path
    config: dict
    index_file: str | None
    weight_map: dict[str, str]
    shards: dict[str, ShardHeader]
    blocks: dict[str, MoEBlock]
    #: safetensors files in the directory that the weight map does not reference
    unindexed_files: list[str] = field(default_factory=list)

    def entry(self, name: str) -> TensorEntry:
        return self.shards[self.weight_map[name]].entries[name]

    @property
    def num_experts(self) -> int:
        counts = {b.num_experts for b in self.blocks.values()}
        if len(counts) != 1:
            raise CheckpointError(f"MoE blocks hold different expert counts: {sorted(counts)}")
        return counts.pop()

    @property
    def model_class(self) -> str | None:
        arch = self.config.get("architectures") or []
        return arch[0] if arch else self.config.get("model_type")

    def config_value(self, keys: Iterable[str]):
        return config_value(self.config, keys)

    @property
    def top_k(self) -> int | None:
        return moe_fields(self.config).top_k

    @property
    def groups(self) -> tuple[int | None, int | None]:
        fields = moe_fields(self.config)
        return fields.n_group, fields.topk_group

    @property
    def quantization_formats(self) -> list[str]:
        out = []
        for qc in quant_configs(self.config):
            fmt = qc.get("format")
            if fmt:
                out.append(fmt)
            for group in (qc.get("config_groups") or {}).values():
                if isinstance(group, dict) and group.get("format") and group["format"] not in out:
                    out.append(group["format"])
        return out


def find_count_keys(config: dict, value: int | None = None) -> dict[str, int]:
    """Dotted paths of expert-count keys in a config dict -> their values."""
    found = moe_fields(config).count_keys
    return {k: v for k, v in found.items() if value is None or v == value}


def config_count(config: dict) -> int | None:
    """The config's expert count when its count keys agree, else ``None``."""
    return moe_fields(config).agreed_count


def set_dotted(config: dict, dotted: str, value) -> None:
    *parents, key = dotted.split(".")
    node = config
    for p in parents:
        node = node[p]
    node[key] = value


def read_weight_map(path: Path) -> tuple[str | None, dict[str, str]]:
    index_files = sorted(
        p.name for p in path.iterdir() if p.name.endswith(".safetensors.index.json")
    )
    if len(index_files) > 1:
        raise CheckpointError(f"{path}: several safetensors index files {index_files}")
    if index_files:
        try:
            data = json.loads((path / index_files[0]).read_text())
            return index_files[0], dict(data["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{path / index_files[0]}: unreadable index: {exc}") from exc
    shards = sorted(p.name for p in path.iterdir() if p.name.endswith(".safetensors"))
    if len(shards) != 1:
        raise CheckpointError(
            f"{path}: no model.safetensors.index.json and {len(shards)} safetensors files; "
            "not a safetensors checkpoint directory"
        )
    if shards[0] != SINGLE_FILE_NAME:
        # transformers and compressed-tensors' convert_checkpoint only read a single
        # unindexed file under this name
        raise CheckpointError(
            f"{path}: the only safetensors file is {shards[0]!r} and there is no "
            f"model.safetensors.index.json; rename it to {SINGLE_FILE_NAME} (the name "
            "transformers loads) or add an index"
        )
    header = read_safetensors_header(path / shards[0], shards[0], strict=False)
    return None, {name: shards[0] for name in header.entries}


def inspect_checkpoint(path: str | os.PathLike) -> CheckpointLayout:
    """Read config, weight map and every shard header; find the MoE blocks.

    Cheap (headers only) and strict: raises :class:`CheckpointError` naming the
    problem (missing shard, index entry absent from its shard, no MoE block, ...).
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no config.json")
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{cfg_file}: not valid JSON: {exc}") from exc
    index_file, weight_map = read_weight_map(path)
    shards: dict[str, ShardHeader] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = path / shard
        if not shard_path.is_file():
            raise CheckpointError(f"{path}: index names shard {shard!r}, which does not exist")
        shards[shard] = read_safetensors_header(shard_path, shard)
    for name, shard in weight_map.items():
        if name not in shards[shard].entries:
            raise CheckpointError(f"{path}: index puts {name!r} in {shard}, which lacks it")
    entries = {name: shards[shard].entries[name] for name, shard in weight_map.items()}
    blocks = scan_moe_blocks(entries, config_count(config))
    unindexed = sorted(
        p.relative_to(path).as_posix()
        for p in path.rglob("*.safetensors")
        if p.is_file() and p.relative_to(path).as_posix() not in shards
    )
    return CheckpointLayout(path, config, index_file, weight_map, shards, blocks, unindexed)


def preview(items: list[str], n: int = 4) -> str:
    items = list(items)
    s = ", ".join(items[:n])
    return s + (f", ... ({len(items)} in all)" if len(items) > n else "") if items else "(none)"
