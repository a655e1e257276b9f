"""A checkpoint directory's layout: config, weight map, shard headers and MoE blocks.

Tensor-name conventions the rewriter and ``reap verify`` share live here: per-expert
tensors ``{block}.experts.{e}.{rest}``, fused expert tensors ``{block}.experts.{param}``
(first dim = experts) and router tensors ``{block}.gate.*`` / ``{block}.router.*``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..models.config_keys import COUNT_KEYS, N_GROUP_KEYS, TOP_K_KEYS, TOPK_GROUP_KEYS
from .errors import CheckpointError
from .safetensors_header import _ST_DTYPE_BYTES, ShardHeader, TensorEntry, read_safetensors_header

__all__ = [
    "COUNT_KEY_CONTAINERS",
    "CheckpointLayout",
    "MoEBlock",
    "check_block",
    "check_packed_scales",
    "find_count_keys",
    "format_ids",
    "inspect_checkpoint",
    "preview",
    "quant_configs",
    "read_weight_map",
    "scan_moe_blocks",
    "set_dotted",
]

#: nested configs searched for count / top-k / group keys (besides the top level)
COUNT_KEY_CONTAINERS = ("text_config", "language_config", "llm_config")
QUANT_CONFIG_KEYS = ("quantization_config", "compression_config")
#: module names (directly under a MoE block) whose tensors are router rows
ROUTER_MODULES = ("gate", "router")
#: the one safetensors file of an unindexed checkpoint
SINGLE_FILE_NAME = "model.safetensors"

PER_EXPERT_RE = re.compile(r"^(?P<block>.+)\.experts\.(?P<idx>\d+)\.(?P<rest>.+)$")
FUSED_RE = re.compile(r"^(?P<block>.+)\.experts\.(?P<rest>[^.\d][^.]*(?:\..+)?)$")
MODULE_EXPERT_RE = re.compile(r"^(?P<block>.+)\.experts\.(?P<idx>\d+)(?P<rest>(?:\..+)?)$")
ROUTER_SEGMENT_RE = re.compile(r"\.(?:{})\.".format("|".join(ROUTER_MODULES)))
LAYER_RE = re.compile(r"(?:^|\.)layers\.(?P<idx>\d+)\.(?P<container>.+)$")


@dataclass
class MoEBlock:
    """A module prefix that owns routed experts, as found in the checkpoint."""

    prefix: str
    num_experts: int
    #: expert index -> {rest-of-name: tensor name}
    per_expert: dict[int, dict[str, str]] = field(default_factory=dict)
    #: fused tensors (first dim = experts)
    fused: list[str] = field(default_factory=list)
    #: router tensors (first dim = experts)
    router: list[str] = field(default_factory=list)

    @property
    def layer_index(self) -> int | None:
        m = re.search(r"(?:^|\.)layers\.(\d+)(?:\.|$)", self.prefix)
        return int(m.group(1)) if m else None


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
        for container in (self.config, *(self.config.get(c) for c in COUNT_KEY_CONTAINERS)):
            if isinstance(container, dict):
                for key in keys:
                    if container.get(key) is not None:
                        return container[key]
        return None

    @property
    def top_k(self) -> int | None:
        v = self.config_value(TOP_K_KEYS)
        return int(v) if v is not None else None

    @property
    def groups(self) -> tuple[int | None, int | None]:
        n = self.config_value(N_GROUP_KEYS)
        t = self.config_value(TOPK_GROUP_KEYS)
        return (int(n) if n is not None else None, int(t) if t is not None else None)

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


def quant_configs(config: dict) -> list[dict]:
    out = []
    for container in (config, *(config.get(c) for c in COUNT_KEY_CONTAINERS)):
        if isinstance(container, dict):
            for key in QUANT_CONFIG_KEYS:
                if isinstance(container.get(key), dict):
                    out.append(container[key])
    return out


def find_count_keys(config: dict, value: int | None = None) -> dict[str, int]:
    """Dotted paths of expert-count keys in a config dict -> their values."""
    found = {}
    for cname in ("", *COUNT_KEY_CONTAINERS):
        container = config if not cname else config.get(cname)
        if not isinstance(container, dict):
            continue
        for key in COUNT_KEYS:
            v = container.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and (value is None or v == value):
                found[f"{cname}.{key}" if cname else key] = v
    return found


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


def scan_moe_blocks(entries: Mapping[str, TensorEntry]) -> dict[str, MoEBlock]:
    """Find MoE blocks (prefixes owning ``.experts.``) and classify their tensors."""
    per_expert: dict[str, dict[int, dict[str, str]]] = {}
    fused: dict[str, list[str]] = {}
    for name in entries:
        m = PER_EXPERT_RE.match(name)
        if m:
            per_expert.setdefault(m["block"], {}).setdefault(int(m["idx"]), {})[m["rest"]] = name
            continue
        m = FUSED_RE.match(name)
        if m and not PER_EXPERT_RE.match(name):
            fused.setdefault(m["block"], []).append(name)
    prefixes = set(per_expert) | set(fused)
    # an "experts" segment nested inside another block's expert is not a block
    prefixes = {
        p for p in prefixes if not any(p.startswith(q + ".experts.") for q in prefixes if q != p)
    }
    routers: dict[str, list[str]] = {p: [] for p in prefixes}
    for name in entries:
        for m in ROUTER_SEGMENT_RE.finditer(name):
            if name[: m.start()] in routers:
                routers[name[: m.start()]].append(name)
    blocks = {}
    for p in sorted(prefixes):
        counts = set()
        for name in routers[p]:
            shape = entries[name].shape
            if shape:
                counts.add(shape[0])
        if per_expert.get(p):
            counts.add(max(per_expert[p]) + 1)
        for name in fused.get(p, []):
            if entries[name].shape:
                counts.add(entries[name].shape[0])
        if not counts:
            raise CheckpointError(f"MoE block {p}: cannot tell its expert count")
        blocks[p] = MoEBlock(
            prefix=p,
            num_experts=max(counts),
            per_expert=per_expert.get(p, {}),
            fused=sorted(fused.get(p, [])),
            router=sorted(routers[p]),
        )
    return blocks


def check_block(
    block: MoEBlock, entries: Mapping[str, TensorEntry], expected: int | None = None
) -> list[str]:
    """Structural problems of one MoE block (empty list when consistent)."""
    problems = []
    E = expected if expected is not None else block.num_experts
    p = block.prefix
    if not block.router:
        problems.append(f"{p}: no router tensor ({' / '.join(ROUTER_MODULES)}) found")
    for name in block.router + block.fused:
        shape = entries[name].shape
        if not shape or shape[0] != E:
            problems.append(f"{name}: shape {list(shape)}, expected first dim {E} (experts)")
    if block.per_expert:
        present = set(block.per_expert)
        missing = sorted(set(range(E)) - present)
        orphan = sorted(i for i in present if i >= E)
        if missing:
            problems.append(f"{p}: expert(s) {format_ids(missing)} missing (expected 0..{E - 1})")
        if orphan:
            problems.append(f"{p}: orphan expert index(es) {format_ids(orphan)} (count is {E})")
        # every expert has the same projections (modules); their parameters may differ
        # (an expert left unquantized through quantization_config.ignore has ``weight``
        # where the others have ``weight_packed`` / ``weight_scale``)
        modules = {i: {r.rsplit(".", 1)[0] for r in v} for i, v in block.per_expert.items()}
        union = set().union(*modules.values())
        for idx in sorted(modules):
            lacking = union - modules[idx]
            if lacking:
                problems.append(f"{p}.experts.{idx}: lacks {sorted(lacking)}")
    return problems


def _weight_quant_specs(config: dict) -> set[tuple[int, str, int | None]]:
    """``(num_bits, strategy, group_size)`` of every weight scheme in the quantization config."""
    specs = set()
    for qc in quant_configs(config):
        for group in (qc.get("config_groups") or {}).values():
            w = group.get("weights") if isinstance(group, dict) else None
            if isinstance(w, dict) and isinstance(w.get("num_bits"), int) and w["num_bits"] > 0:
                specs.add((w["num_bits"], str(w.get("strategy")), w.get("group_size")))
    return specs


def check_packed_scales(entries: Mapping[str, TensorEntry], config: dict) -> list[str]:
    """Packed weights whose ``weight_scale`` shape does not fit ``weight_packed``.

    For a 2-D ``weight_packed`` ``[out, p]`` holding ``8 * itemsize / num_bits`` values
    per element (MXFP4: two per byte), a ``group`` / ``tensor_group`` scheme needs a
    ``weight_scale`` of ``[out, ceil(in / group_size)]`` and a ``channel`` scheme
    ``[out, 1]``.  Headers only; a scale that fits any weight scheme of the config passes.
    """
    specs = _weight_quant_specs(config)
    problems: list[str] = []
    if not specs:
        return problems
    for name, packed in entries.items():
        if not name.endswith(".weight_packed"):
            continue
        scale = entries.get(name[: -len("packed")] + "scale")
        item = _ST_DTYPE_BYTES.get(packed.dtype)
        if scale is None or item is None or len(packed.shape) != 2:
            continue
        allowed = []
        for bits, strategy, group_size in sorted(specs, key=str):
            per = item * 8 // bits
            if per < 1:
                continue
            cols = packed.shape[1] * per  # the last element may hold padding
            if strategy in ("group", "tensor_group") and group_size:
                widths = sorted(
                    {-(-n // group_size) for n in range(max(1, cols - per + 1), cols + 1)}
                )
                allowed += [(packed.shape[0], w) for w in widths]
            elif strategy == "channel":
                allowed.append((packed.shape[0], 1))
        if allowed and tuple(scale.shape) not in allowed:
            problems.append(
                f"{scale.name}: shape {list(scale.shape)} does not match {name} "
                f"{packed.dtype}{list(packed.shape)} (expected {list(allowed[-1])} under the "
                "checkpoint's quantization_config); the checkpoint is corrupt or was written "
                "for another scheme: re-export it"
            )
    return problems


def format_ids(ids: list[int], limit: int = 12) -> str:
    s = ", ".join(str(i) for i in ids[:limit])
    return s + (f", ... ({len(ids)} in all)" if len(ids) > limit else "")


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
    blocks = scan_moe_blocks(entries)
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
