"""The checkpoint rewriter: a :class:`PruningPlan` applied to a safetensors checkpoint.

No model is loaded and nothing is dequantized.  The rewrite runs on the
compressed-tensors ``Converter`` protocol (``convert_checkpoint`` drives it: file
copies, per-shard jobs, meta-tensor validation, config and index rewrite), with the
per-shard work done by a *streaming byte-range writer*: every output tensor is a
run of bytes of the source file (a whole tensor, or the kept rows of a tensor whose
first dimension is the expert dimension), so kept experts' ``weight_packed`` /
``weight_scale`` / any ``weight_*`` are copied verbatim and memory stays at a few
I/O buffers whatever the shard size.

What is rewritten (per MoE block, i.e. a module prefix that owns ``.experts.``):

- per-expert tensors ``{block}.experts.{e}.{rest}``: dropped, or renamed ``e -> new``
  (every parameter: ``weight``, ``weight_packed``, ``weight_scale``, ...);
- fused expert tensors ``{block}.experts.{param}`` (first dim = experts, e.g. GPT-OSS
  ``gate_up_proj`` / ``gate_up_proj_bias`` / ``*_blocks``): kept rows selected;
- router tensors ``{block}.gate.*`` / ``{block}.router.*`` (weight, bias,
  ``e_score_correction_bias``): kept rows selected;
- ``config.json``: every expert-count key (top level and ``text_config`` /
  ``language_config`` / ``llm_config``) that holds the old count, and per-expert
  module names in ``quantization_config`` (``ignore``, group ``targets``) renumbered
  or dropped;
- ``model.safetensors.index.json``; all other files are copied unchanged.

Plan layers are MoE-block module paths of the *loaded* model
(``model.layers.1.mlp``, ``language_model.model.layers.1.block_sparse_moe``).  They
map to checkpoint prefixes by exact match first, else by ``layers.{L}.{container}``
(same layer index and MoE container name, any outer prefix); no match or more than
one match is an error.

MoE blocks in the checkpoint that the plan does not name (a DeepSeek-V3 style MTP
layer ``model.layers.{num_hidden_layers}``, which transformers does not load and so
calibration never scores) are an error by default, naming them.  Pass
``extra_layers="like-last"`` to cut each with the kept ids of the deepest plan layer
(the layer the MTP module follows), or a mapping ``{checkpoint_prefix: plan_layer}``.
The manifest records which rule cut which layer.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import json
import os
import re
import shutil
import struct
import threading
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch
from loguru import logger

from .adapters import COUNT_KEYS, N_GROUP_KEYS, TOP_K_KEYS, TOPK_GROUP_KEYS
from .fileio import sha256_file, write_json_atomic
from .manifest import MANIFEST_NAME, build_manifest
from .plan import PlanError, PruningPlan

__all__ = [
    "CheckpointError",
    "CheckpointLayout",
    "COUNT_KEY_CONTAINERS",
    "DestinationError",
    "ExpertPlanPruner",
    "MoEBlock",
    "RewriteSpec",
    "ShardHeader",
    "TensorEntry",
    "bind_plan",
    "check_destination",
    "find_count_keys",
    "inspect_checkpoint",
    "read_safetensors_header",
    "renumber_module_names",
    "rewrite_checkpoint",
    "ExpertRemap",
    "DEFAULT_METHOD",
    "SourceHasher",
    "default_hash_cache",
    "default_output_checksum",
    "new_hasher",
]

DEFAULT_METHOD = "REAP (checkpoint rewrite)"

#: nested configs searched for count / top-k / group keys (besides the top level)
COUNT_KEY_CONTAINERS = ("text_config", "language_config", "llm_config")
QUANT_CONFIG_KEYS = ("quantization_config", "compression_config")
#: module names (directly under a MoE block) whose tensors are router rows
ROUTER_MODULES = ("gate", "router")

#: streaming I/O: chunk size and number of ring buffers (memory = CHUNK * BUFFERS)
CHUNK_BYTES = int(os.environ.get("REAP_CHUNK_MB", "16")) << 20
RING_BUFFERS = 3

_PER_EXPERT_RE = re.compile(r"^(?P<block>.+)\.experts\.(?P<idx>\d+)\.(?P<rest>.+)$")
_FUSED_RE = re.compile(r"^(?P<block>.+)\.experts\.(?P<rest>[^.\d][^.]*(?:\..+)?)$")
_MODULE_EXPERT_RE = re.compile(r"^(?P<block>.+)\.experts\.(?P<idx>\d+)(?P<rest>(?:\..+)?)$")
_ROUTER_SEGMENT_RE = re.compile(r"\.(?:%s)\." % "|".join(ROUTER_MODULES))
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(?P<idx>\d+)\.(?P<container>.+)$")


class CheckpointError(ValueError):
    """The checkpoint (or the plan against it) cannot be rewritten; says why."""


class DestinationError(CheckpointError):
    """The output path is refused (not empty, the source, inside the source...)."""


# ---------------------------------------------------------------------------
# safetensors headers (read without loading any tensor)

_ST_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a shard: absolute byte range ``[begin, end)`` in the file."""

    name: str
    shard: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    def row_ranges(self, rows: Iterable[int]) -> list[tuple[int, int]]:
        """Absolute byte ranges of ``rows`` along dim 0 (merged when adjacent)."""
        if not self.shape:
            raise CheckpointError(f"{self.name}: a scalar has no rows to select")
        n = self.shape[0]
        if n == 0 or self.nbytes % n:
            raise CheckpointError(
                f"{self.name}: {self.nbytes} bytes do not split into {n} rows"
            )
        row = self.nbytes // n
        out: list[tuple[int, int]] = []
        for r in rows:
            b = self.begin + r * row
            if out and out[-1][1] == b:
                out[-1] = (out[-1][0], b + row)
            else:
                out.append((b, b + row))
        return out


@dataclass
class ShardHeader:
    """Parsed header of one safetensors file."""

    path: Path
    header_len: int
    file_size: int
    metadata: dict | None
    entries: dict[str, TensorEntry]

    @property
    def data_start(self) -> int:
        return 8 + self.header_len


def read_safetensors_header(path: str | os.PathLike, shard: str | None = None, *, strict: bool = True) -> ShardHeader:
    """Parse a safetensors header; with ``strict`` check offsets cover the data exactly."""
    path = Path(path)
    shard = shard or path.name
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8 or n > 512 << 20:
            raise CheckpointError(f"{path}: header length {n} exceeds the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: corrupt safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    start = 8 + n
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        try:
            b, e = (int(x) for x in info["data_offsets"])
            entry = TensorEntry(name, shard, str(info["dtype"]), tuple(int(s) for s in info["shape"]), start + b, start + e)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: bad header entry for {name!r}: {exc}") from exc
        entries[name] = entry
    if strict:
        pos = start
        for entry in sorted(entries.values(), key=lambda t: (t.begin, t.end)):
            if entry.begin != pos or entry.end < entry.begin:
                raise CheckpointError(
                    f"{path}: tensor {entry.name!r} at bytes [{entry.begin}, {entry.end}) "
                    f"does not follow the previous tensor (expected start {pos})"
                )
            item = _ST_DTYPE_BYTES.get(entry.dtype)
            if item is not None:
                numel = 1
                for s in entry.shape:
                    numel *= s
                if numel * item != entry.nbytes:
                    raise CheckpointError(
                        f"{path}: tensor {entry.name!r} {entry.dtype}{list(entry.shape)} "
                        f"needs {numel * item} bytes, header says {entry.nbytes}"
                    )
            pos = entry.end
        if pos != size:
            raise CheckpointError(
                f"{path}: data ends at byte {pos} but the file has {size} bytes "
                "(truncated or trailing garbage)"
            )
    return ShardHeader(path, n, size, metadata, entries)


def _encode_header(entries: list[tuple[str, str, list[int], int, int]], metadata: dict | None) -> bytes:
    """safetensors header bytes (8-byte length + JSON padded with spaces to 8)."""
    header: dict = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, b, e in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [b, e]}
    body = json.dumps(header, separators=(",", ":")).encode("utf-8")
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


# ---------------------------------------------------------------------------
# checkpoint layout: config, weight map, shard headers, MoE blocks


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
        for qc in _quant_configs(self.config):
            fmt = qc.get("format")
            if fmt:
                out.append(fmt)
            for group in (qc.get("config_groups") or {}).values():
                if isinstance(group, dict) and group.get("format") and group["format"] not in out:
                    out.append(group["format"])
        return out


def _quant_configs(config: dict) -> list[dict]:
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


def _set_dotted(config: dict, dotted: str, value) -> None:
    *parents, key = dotted.split(".")
    node = config
    for p in parents:
        node = node[p]
    node[key] = value


def _read_weight_map(path: Path) -> tuple[str | None, dict[str, str]]:
    index_files = sorted(p.name for p in path.iterdir() if p.name.endswith(".safetensors.index.json"))
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
    header = read_safetensors_header(path / shards[0], shards[0], strict=False)
    return None, {name: shards[0] for name in header.entries}


def scan_moe_blocks(entries: Mapping[str, TensorEntry]) -> dict[str, MoEBlock]:
    """Find MoE blocks (prefixes owning ``.experts.``) and classify their tensors."""
    per_expert: dict[str, dict[int, dict[str, str]]] = {}
    fused: dict[str, list[str]] = {}
    for name in entries:
        m = _PER_EXPERT_RE.match(name)
        if m:
            per_expert.setdefault(m["block"], {}).setdefault(int(m["idx"]), {})[m["rest"]] = name
            continue
        m = _FUSED_RE.match(name)
        if m and not _PER_EXPERT_RE.match(name):
            fused.setdefault(m["block"], []).append(name)
    prefixes = set(per_expert) | set(fused)
    # an "experts" segment nested inside another block's expert is not a block
    prefixes = {p for p in prefixes if not any(p.startswith(q + ".experts.") for q in prefixes if q != p)}
    routers: dict[str, list[str]] = {p: [] for p in prefixes}
    for name in entries:
        for m in _ROUTER_SEGMENT_RE.finditer(name):
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


def check_block(block: MoEBlock, entries: Mapping[str, TensorEntry], expected: int | None = None) -> list[str]:
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
            problems.append(f"{p}: expert(s) {_fmt_ids(missing)} missing (expected 0..{E - 1})")
        if orphan:
            problems.append(f"{p}: orphan expert index(es) {_fmt_ids(orphan)} (count is {E})")
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


def _fmt_ids(ids: list[int], limit: int = 12) -> str:
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
    index_file, weight_map = _read_weight_map(path)
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


# ---------------------------------------------------------------------------
# plan -> checkpoint prefixes


def _layer_key(name: str) -> tuple[int, str] | None:
    m = _LAYER_RE.search(name)
    return (int(m["idx"]), m["container"]) if m else None


def resolve_block(name: str, blocks: Iterable[str], *, what: str = "plan layer") -> str:
    """Checkpoint prefix for a module path: exact, else same ``layers.{L}.{container}``."""
    blocks = list(blocks)
    if name in blocks:
        return name
    key = _layer_key(name)
    if key is None:
        raise CheckpointError(
            f"{what} {name!r} is not a MoE block of the checkpoint and has no "
            f"'layers.<index>.<container>' part to match by; checkpoint MoE blocks: "
            f"{_preview(blocks)}"
        )
    matches = [b for b in blocks if _layer_key(b) == key]
    if not matches:
        raise CheckpointError(
            f"{what} {name!r}: no MoE block of the checkpoint is layer {key[0]} "
            f"'{key[1]}'; checkpoint MoE blocks: {_preview(blocks)}"
        )
    if len(matches) > 1:
        raise CheckpointError(
            f"{what} {name!r} is ambiguous: checkpoint MoE blocks {matches} all are "
            f"layer {key[0]} '{key[1]}'; give the plan exact checkpoint prefixes"
        )
    return matches[0]


def _preview(items: list[str], n: int = 4) -> str:
    items = list(items)
    s = ", ".join(items[:n])
    return s + (f", ... ({len(items)} in all)" if len(items) > n else "") if items else "(none)"


ExtraLayers = str | Mapping[str, str]


class ExpertRemap:
    """Per-tensor fate under ``block_kept`` (checkpoint prefix -> kept original ids)."""

    def __init__(self, blocks: Mapping[str, MoEBlock], block_kept: Mapping[str, list[int]]):
        self.block_kept = {p: list(k) for p, k in block_kept.items()}
        self._remaps = {p: {old: new for new, old in enumerate(k)} for p, k in self.block_kept.items()}
        self._row_blocks = {
            n: p for p, b in blocks.items() if p in self.block_kept for n in (*b.router, *b.fused)
        }

    def action(self, name: str) -> tuple[str, list[int] | None] | None:
        """``None`` (dropped) or ``(out_name, rows)``: ``rows`` is ``None`` for a
        verbatim copy, else the dim-0 rows kept (router and fused expert tensors)."""
        m = _PER_EXPERT_RE.match(name)
        if m and m["block"] in self._remaps:
            new = self._remaps[m["block"]].get(int(m["idx"]))
            if new is None:
                return None
            return f"{m['block']}.experts.{new}.{m['rest']}", None
        block = self._row_blocks.get(name)
        if block is not None:
            return name, self.block_kept[block]
        return name, None


@dataclass
class RewriteSpec:
    """A plan bound to a checkpoint: kept ids per checkpoint MoE block."""

    layout: CheckpointLayout
    plan: PruningPlan
    #: checkpoint prefix -> ascending kept original ids
    block_kept: dict[str, list[int]]
    #: plan layer -> checkpoint prefix
    layer_map: dict[str, str]
    #: checkpoint prefix not in the plan -> {"policy", "kept_from", "kept_original_ids"}
    extra: dict[str, dict]
    #: dotted config keys updated to the new count
    count_keys: list[str]

    @property
    def new_count(self) -> int:
        return self.plan.num_kept

    def action(self, name: str) -> tuple[str, list[int] | None] | None:
        """What becomes of tensor ``name`` (see :meth:`ExpertRemap.action`)."""
        return self.remap.action(name)

    def __post_init__(self):
        self.remap = ExpertRemap(self.layout.blocks, self.block_kept)

    def output_plan(self, shard: str, names: Iterable[str] | None = None) -> list[tuple[str, TensorEntry, list[tuple[int, int]], tuple[int, ...]]]:
        """``(out_name, source entry, source byte ranges, out shape)`` in source byte order."""
        header = self.layout.shards[shard]
        names = list(header.entries) if names is None else list(names)
        out = []
        for entry in sorted((header.entries[n] for n in names), key=lambda t: t.begin):
            act = self.action(entry.name)
            if act is None:
                continue
            out_name, rows = act
            if rows is None:
                out.append((out_name, entry, [(entry.begin, entry.end)], entry.shape))
            else:
                out.append((out_name, entry, entry.row_ranges(rows), (len(rows), *entry.shape[1:])))
        return out


def bind_plan(layout: CheckpointLayout, plan: PruningPlan, *, extra_layers: ExtraLayers = "error") -> RewriteSpec:
    """Map plan layers to checkpoint MoE blocks and check the plan fits the checkpoint.

    Raises :class:`CheckpointError` / :class:`PlanError` before any byte is written:
    unmatched or ambiguous layers, uncovered MoE blocks (per ``extra_layers``), expert
    counts that differ from the plan, missing count keys, a keep count below top-k,
    and, for group-limited routers, kept experts not spread equally over groups.
    """
    plan.validate()
    if not layout.blocks:
        raise CheckpointError(f"{layout.path}: no MoE block (no '.experts.' tensors) in the checkpoint")
    E = plan.num_experts
    problems = []
    for b in layout.blocks.values():
        problems += check_block(b, {n: layout.entry(n) for n in (*b.router, *b.fused)}, None)
        if b.num_experts != E:
            problems.append(f"{b.prefix}: {b.num_experts} experts in the checkpoint, the plan is for {E}")
    if problems:
        raise CheckpointError("checkpoint does not fit the plan:\n  " + "\n  ".join(problems))
    layer_map: dict[str, str] = {}
    for layer in plan.kept:
        layer_map[layer] = resolve_block(layer, layout.blocks)
    dup = {p for p in layer_map.values() if list(layer_map.values()).count(p) > 1}
    if dup:
        raise CheckpointError(f"several plan layers map to the same checkpoint block(s) {sorted(dup)}")
    block_kept = {p: list(plan.kept[layer]) for layer, p in layer_map.items()}
    extra: dict[str, dict] = {}
    uncovered = [p for p in layout.blocks if p not in block_kept]
    if uncovered:
        if isinstance(extra_layers, Mapping):
            mapping = {resolve_block(k, layout.blocks, what="extra_layers key"): v for k, v in extra_layers.items()}
            for p in uncovered:
                src = mapping.get(p)
                if src is None:
                    raise CheckpointError(f"checkpoint MoE block {p!r} is neither in the plan nor in extra_layers")
                if src not in plan.kept:
                    raise CheckpointError(f"extra_layers maps {p!r} to {src!r}, which is not a plan layer")
                extra[p] = {"policy": "mapped", "kept_from": src}
        elif extra_layers == "like-last":
            deepest = max(plan.kept, key=lambda n: (_layer_key(n) or (-1, ""))[0])
            for p in uncovered:
                extra[p] = {"policy": "like-last", "kept_from": deepest}
        elif extra_layers == "error":
            described = ", ".join(f"{p} ({layout.blocks[p].num_experts} experts)" for p in uncovered)
            nh = layout.config_value(("num_hidden_layers",))
            hint = ""
            if nh is not None and any(layout.blocks[p].layer_index is not None and layout.blocks[p].layer_index >= int(nh) for p in uncovered):
                hint = f" (layer index >= num_hidden_layers={nh}: an MTP / next-token-prediction layer)"
            raise CheckpointError(
                f"the checkpoint has MoE layer(s) the plan does not cover: {described}{hint}. "
                "Every MoE layer must end with the same expert count. Pass --extra-layers "
                "like-last (extra_layers='like-last') to cut them with the kept ids of the "
                "deepest plan layer, or extra_layers={prefix: plan_layer}"
            )
        else:
            raise CheckpointError(f"extra_layers must be 'error', 'like-last' or a mapping, got {extra_layers!r}")
        for p, info in extra.items():
            info["kept_original_ids"] = list(plan.kept[info["kept_from"]])
            block_kept[p] = info["kept_original_ids"]
    # count keys
    count_keys = find_count_keys(layout.config, E)
    if not count_keys:
        found = find_count_keys(layout.config)
        raise CheckpointError(
            f"config.json has no expert-count key ({', '.join(COUNT_KEYS)}, top level or "
            f"{'/'.join(COUNT_KEY_CONTAINERS)}) equal to {E}"
            + (f"; found {found}" if found else "")
        )
    others = {k: v for k, v in find_count_keys(layout.config).items() if k not in count_keys}
    if others:
        logger.warning(f"config count keys {others} differ from the expert count {E}; left unchanged")
    keep = plan.num_kept
    top_k = layout.top_k
    if top_k is not None and keep < top_k:
        raise PlanError(f"the plan keeps {keep} experts per layer, fewer than top-k={top_k} in config.json")
    n_group, topk_group = layout.groups
    if n_group and n_group > 1 and (topk_group or n_group) < n_group:
        if E % n_group or keep % n_group:
            raise PlanError(f"{E} -> {keep} experts do not split into n_group={n_group} equal groups")
        size = E // n_group
        for p, ids in block_kept.items():
            per = [sum(1 for i in ids if i // size == g) for g in range(n_group)]
            if len(set(per)) != 1:
                raise PlanError(
                    f"{p}: group-limited routing (n_group={n_group}, topk_group={topk_group}) "
                    f"needs the same number kept in every group; the plan keeps {per}"
                )
    spec = RewriteSpec(layout, plan, block_kept, layer_map, extra, sorted(count_keys))
    return spec


# ---------------------------------------------------------------------------
# quantization_config per-expert names


def renumber_module_names(names: list, block_kept: Mapping[str, list[int]]) -> tuple[list, int, int]:
    """Renumber / drop per-expert module names (``re:`` patterns are kept as they are).

    Returns ``(new_list, renumbered, dropped)``.
    """
    out, renumbered, dropped = [], 0, 0
    blocks = list(block_kept)
    remaps = {p: {old: new for new, old in enumerate(k)} for p, k in block_kept.items()}
    for item in names:
        m = _MODULE_EXPERT_RE.match(item) if isinstance(item, str) and not item.startswith("re:") else None
        if not m:
            out.append(item)
            continue
        try:
            block = resolve_block(m["block"], blocks, what="quantization_config entry")
        except CheckpointError:
            out.append(item)
            continue
        old = int(m["idx"])
        new = remaps[block].get(old)
        if new is None:
            dropped += 1
            continue
        if new != old:
            renumbered += 1
        out.append(f"{m['block']}.experts.{new}{m['rest']}")
    return out, renumbered, dropped


def rewrite_quant_config(qc: dict, block_kept: Mapping[str, list[int]]) -> tuple[dict, dict]:
    """A copy of one quantization/compression config with per-expert names fixed."""
    qc = json.loads(json.dumps(qc))
    stats = {"renumbered": 0, "dropped": 0}

    def fix(container: dict, key: str):
        if isinstance(container.get(key), list):
            container[key], r, d = renumber_module_names(container[key], block_kept)
            stats["renumbered"] += r
            stats["dropped"] += d

    fix(qc, "ignore")
    for group in (qc.get("config_groups") or {}).values():
        if isinstance(group, dict):
            fix(group, "targets")
    sc = qc.get("sparsity_config")
    if isinstance(sc, dict):
        fix(sc, "ignore")
        fix(sc, "targets")
    return qc, stats


# ---------------------------------------------------------------------------
# the Converter


try:  # the protocol class; a plain base when compressed-tensors lacks it
    from compressed_tensors.entrypoints.convert.converters import Converter as _ConverterBase
except Exception:  # pragma: no cover - pinned stack has it
    _ConverterBase = object


class ExpertPlanPruner(_ConverterBase):
    """compressed-tensors ``Converter`` applying a bound plan (:class:`RewriteSpec`).

    ``process`` works on tensors (real or meta) and is what ``validate`` runs;
    :meth:`stream_shard` is the same rewrite done on bytes, straight from the source
    file (see :func:`_upstream_gaps`), so kept tensors are verbatim and memory is a
    few buffers.  Both are driven by :meth:`RewriteSpec.action`, so they cannot
    disagree.  Records a checksum (``output_checksums``, kind ``output_checksum``) and
    the size of every shard it streams.  Call :meth:`close` when done.
    """

    def __init__(
        self,
        spec: RewriteSpec,
        *,
        progress: Callable[[int], None] | None = None,
        output_checksum: str | None = None,
    ):
        self.spec = spec
        self.progress = progress
        self.output_checksum = output_checksum or default_output_checksum()
        new_hasher(self.output_checksum)  # fail early on an unknown kind
        self.output_checksums: dict[str, str] = {}
        self.output_bytes: dict[str, int] = {}
        self.counts = {"copied": 0, "renamed": 0, "rows_selected": 0, "dropped": 0}
        self.quant_stats = {"renumbered": 0, "dropped": 0}
        self._lock = threading.Lock()
        self._mover: _ByteMover | None = None

    def close(self) -> None:
        """Release the writer's buffers and helper thread."""
        if self._mover is not None:
            self._mover.close()
            self._mover = None

    # -- Converter protocol ------------------------------------------------------

    def process(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            act = self.spec.action(name)
            if act is None:
                continue
            out_name, rows = act
            if rows is not None:
                idx = torch.tensor(rows, dtype=torch.long, device=tensor.device)
                tensor = tensor.index_select(0, idx).contiguous()
            if out_name in out:
                raise CheckpointError(f"two tensors would be written as {out_name!r}")
            out[out_name] = tensor
        return out

    def validate(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = self.process(tensors)
        n = self.spec.new_count
        for name, t in out.items():
            m = _PER_EXPERT_RE.match(name)
            if m and m["block"] in self.spec.block_kept and int(m["idx"]) >= n:
                raise CheckpointError(f"{name}: expert index beyond the new count {n}")
        return out

    def update_config(self, config):
        # The quantization scheme does not change: packed bytes are copied as they are.
        # (The per-expert names in ``ignore`` are fixed in update_model_config, on the
        # source's raw dict - see _upstream_gaps, gap 2.)
        return config

    def update_model_config(self, model_config: dict) -> dict:
        new = self.spec.new_count
        for key in self.spec.count_keys:
            _set_dotted(model_config, key, new)
        # restore each quantization config exactly as the source had it, names fixed
        source = self.spec.layout.config
        for cname in ("", *COUNT_KEY_CONTAINERS):
            src_c = source if not cname else source.get(cname)
            dst_c = model_config if not cname else model_config.get(cname)
            if not isinstance(src_c, dict) or not isinstance(dst_c, dict):
                continue
            for key in QUANT_CONFIG_KEYS:
                if isinstance(src_c.get(key), dict):
                    dst_c[key], stats = rewrite_quant_config(src_c[key], self.spec.block_kept)
                    for k in stats:
                        self.quant_stats[k] += stats[k]
                elif key not in src_c and key in dst_c:
                    del dst_c[key]
        return model_config

    def get_dependencies(self, weight_name: str) -> set[str]:
        return set()

    # -- streaming writer ----------------------------------------------------------

    def stream_shard(self, inverse_weight_map: Mapping[str, list[str]], save_path: str | os.PathLike) -> tuple[int, dict[str, str]]:
        """Write one output shard from source byte ranges (``convert_file``'s contract)."""
        if len(inverse_weight_map) != 1:
            raise CheckpointError(f"a shard job reads {len(inverse_weight_map)} files; expected one")
        ((src_file, names),) = inverse_weight_map.items()
        src_file = Path(src_file)
        layout = self.spec.layout
        shard = Path(os.path.relpath(src_file.resolve(), layout.path.resolve())).as_posix()
        if shard not in layout.shards:
            raise CheckpointError(f"{src_file} is not a shard of {layout.path}")
        header = layout.shards[shard]
        unindexed = set(header.entries) - set(names)
        if unindexed:
            logger.warning(f"{shard}: {len(unindexed)} tensor(s) not in the index are not copied: {_preview(sorted(unindexed))}")
        plan = self.spec.output_plan(shard, names)
        out_entries, segments, pos = [], [], 0
        for out_name, entry, ranges, shape in plan:
            size = sum(e - b for b, e in ranges)
            out_entries.append((out_name, entry.dtype, list(shape), pos, pos + size))
            pos += size
            segments.extend(ranges)
            kind = "rows_selected" if shape != entry.shape else ("renamed" if out_name != entry.name else "copied")
            with self._lock:
                self.counts[kind] += 1
        with self._lock:
            self.counts["dropped"] += len(names) - len(plan)
        head = _encode_header(out_entries, header.metadata)
        if self._mover is None:
            self._mover = _ByteMover(self.output_checksum)
        out_hash = self._mover.copy(src_file, Path(save_path), head, _merge_ranges(segments), progress=self.progress)
        expect = len(head) + pos
        if (got := Path(save_path).stat().st_size) != expect:
            raise CheckpointError(f"{save_path}: wrote {got} bytes, expected {expect}")
        name = Path(save_path).name
        with self._lock:
            self.output_checksums[name] = out_hash
            self.output_bytes[name] = expect
        return pos, {n: name for n, *_ in out_entries}


def _merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
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


#: gaps between kept byte ranges smaller than this are read through (one read
#: instead of two); they are never written
READ_THROUGH_GAP = 64 << 10


def _read_windows(segments: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for b, e in segments:
        if out and b - out[-1][1] < READ_THROUGH_GAP:
            out[-1] = (out[-1][0], e)
        else:
            out.append((b, e))
    return out


class _ByteMover:
    """Copies byte ranges of a source file into a new file and hashes what it writes.

    The main thread reads (``preadv``, only the kept ranges) and writes; a helper
    thread checksums the written pieces (hashlib / xxhash release the GIL), over a
    ring of :data:`RING_BUFFERS` buffers of :data:`CHUNK_BYTES` allocated once per
    rewrite.  Memory: the ring, whatever the shard size.
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
    ) -> str:
        """Write ``head`` then source byte ``segments`` (ascending) to ``dst``; return
        the checksum (:attr:`kind`) of ``dst``."""
        out_h = new_hasher(self.kind)
        out_h.update(head)
        pending: list[Future | None] = [None] * RING_BUFFERS
        slot = 0
        seg = deque(segments)
        fd_in = os.open(src, os.O_RDONLY)
        try:
            fd_out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _write_all(fd_out, memoryview(head))
                for w_begin, w_end in _read_windows(segments):
                    pos = w_begin
                    while pos < w_end:
                        if pending[slot] is not None:
                            pending[slot].result()
                            pending[slot] = None
                        buf = self.ring[slot]
                        n = os.preadv(fd_in, [buf[: min(CHUNK_BYTES, w_end - pos)]], pos)
                        if n <= 0:
                            raise CheckpointError(f"{src}: unexpected end of file at byte {pos}")
                        chunk, end = buf[:n], pos + n
                        pieces = []
                        while seg and seg[0][0] < end:
                            b, e = seg[0]
                            lo, hi = max(b, pos), min(e, end)
                            if lo < hi:
                                pieces.append(chunk[lo - pos : hi - pos])
                            if e <= end:
                                seg.popleft()
                            else:
                                break
                        pending[slot] = self.pool.submit(_update_all, out_h, pieces)
                        for piece in pieces:
                            _write_all(fd_out, piece)
                        if progress is not None:
                            progress(sum(len(p) for p in pieces))
                        pos = end
                        slot = (slot + 1) % RING_BUFFERS
                if seg:
                    raise CheckpointError(f"internal error: {len(seg)} byte range(s) of {src} not written")
            finally:
                for i, f in enumerate(pending):  # never leave a buffer in use
                    if f is not None:
                        f.result()
                        pending[i] = None
                os.close(fd_out)
        finally:
            os.close(fd_in)
        return out_h.hexdigest()


def _update_all(h, pieces) -> None:
    for p in pieces:
        h.update(p)


# ---------------------------------------------------------------------------
# sha256 of the source shards: a pool alongside the writer, with a cache


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
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino, "dev": st.st_dev}


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

    def prepare(self) -> "SourceHasher":
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

    def start(self) -> "SourceHasher":
        """Start hashing the shards the cache did not answer for."""
        self.prepare()
        todo = [s for s in self.files if s not in self._results]
        if todo:
            self._pool = ThreadPoolExecutor(min(self.workers, len(todo)), thread_name_prefix="reap-src-sha256")
            for shard in todo:
                self._futures[shard] = self._pool.submit(self._hash, shard)
        return self

    def _hash(self, shard: str) -> str:
        h = hashlib.sha256()
        buf = memoryview(bytearray(CHUNK_BYTES))
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
            write_json_atomic(self.cache_path, {"format": "reap-sha256-cache", "files": self._cache})
        except OSError as exc:  # a cache is an optimisation, never a failure
            logger.warning(f"could not write the sha256 cache {self.cache_path}: {exc}")


# ---------------------------------------------------------------------------
# upstream gaps: ALL workarounds for compressed-tensors 0.19 live here


_CONVERT_MODULE = "compressed_tensors.entrypoints.convert.convert_checkpoint"


@contextlib.contextmanager
def _upstream_gaps(converter: ExpertPlanPruner):
    """Run ``convert_checkpoint`` with the workarounds this rewriter needs.

    compressed-tensors 0.19 gaps, and what is done about each:

    1. ``convert_file`` loads every tensor of a shard into memory and ``save_file``
       serialises copies of them (about 2x the shard in RAM), reads the dropped
       experts too, and hashes nothing.  For our converter the ``convert_file`` that
       ``convert_checkpoint`` calls is swapped, for the duration of the call, for
       :meth:`ExpertPlanPruner.stream_shard` (same signature and return value; other
       converters still get the stock function).  The swap is checked against the
       upstream signature and skipped with a warning if it ever changes (the stock
       path is still bit-exact, only heavier).
    2. ``write_checkpoint_quantization_config`` round-trips ``quantization_config``
       through pydantic (normalising fields; dropping it if it does not validate) and
       only passes the *parsed* config to ``update_config``.  The converter's
       ``update_model_config`` therefore writes back the source's raw dict, with
       per-expert names in ``ignore`` / ``targets`` renumbered or dropped (done on
       the raw dict, which ``MagnitudeExpertPruner`` never does).
    3. ``update_safetensors_index`` creates ``model.safetensors.index.json`` even for
       a single-file checkpoint; it is removed after the run when the source had none.
       ``convert_checkpoint`` also writes a shard file when every tensor of it was
       dropped (a shard of dropped experts only); such empty shards, which the new
       index does not reference, are removed.
    4. ``MagnitudeExpertPruner`` is not used: its ``from_pretrained`` scores routers
       itself (crashing when the router pattern also matches the 1-D bias), it pairs
       experts with routers by longest common name prefix, assumes one layout (2-D or
       3-D) for the whole checkpoint, does not touch ``quantization_config.ignore`` and
       sets the count key in one place only.  :class:`ExpertPlanPruner` takes the plan
       instead.  (llm-compressor's ``model_free_ptq(converter=...)`` never calls
       ``update_model_config``; ``convert_checkpoint`` does, so we call that.)
    """
    module = importlib.import_module(_CONVERT_MODULE)
    stock = module.convert_file
    expected = ["inverse_weight_map", "save_path", "converters", "device"]
    if list(inspect.signature(stock).parameters) != expected:
        logger.warning(
            "compressed-tensors convert_file changed its signature; using the stock "
            "(in-memory) shard writer"
        )
        yield
        return

    def convert_file(inverse_weight_map, save_path, converters, device=torch.device("cpu")):
        if len(converters) == 1 and converters[0] is converter:
            return converter.stream_shard(inverse_weight_map, save_path)
        return stock(inverse_weight_map, save_path, converters, device)

    module.convert_file = convert_file
    try:
        yield
    finally:
        module.convert_file = stock


#: the swap in _upstream_gaps patches a module global: one conversion at a time
_CONVERT_LOCK = threading.Lock()


def _convert(src: Path, tmp: Path, converter: ExpertPlanPruner, *, stream: bool = True) -> None:
    from compressed_tensors.entrypoints.convert import convert_checkpoint

    ctx = _upstream_gaps(converter) if stream else contextlib.nullcontext()
    try:
        with _CONVERT_LOCK, ctx, _quiet_upstream_logs():
            convert_checkpoint(src, tmp, converter, device="cpu")
    finally:
        converter.close()
    # gap 3: empty shards, index file for a single-file source
    index_path = tmp / "model.safetensors.index.json"
    if index_path.is_file():
        referenced = set(json.loads(index_path.read_text())["weight_map"].values())
        for shard in converter.spec.layout.shards:
            if shard not in referenced and (tmp / shard).is_file():
                logger.info(f"REAP: {shard} held only dropped experts; not written")
                (tmp / shard).unlink()
                converter.output_bytes.pop(Path(shard).name, None)
                converter.output_checksums.pop(Path(shard).name, None)
    if converter.spec.layout.index_file is None:
        index_path.unlink(missing_ok=True)
    # shards written by the stock convert_file (gap 1 swap skipped): checksum them now
    for path in sorted(tmp.rglob("*.safetensors")):
        if path.name not in converter.output_bytes:
            h = new_hasher(converter.output_checksum)
            with open(path, "rb") as f:
                while block := f.read(CHUNK_BYTES):
                    h.update(block)
            converter.output_checksums[path.name] = h.hexdigest()
            converter.output_bytes[path.name] = path.stat().st_size


@contextlib.contextmanager
def _quiet_upstream_logs():
    """compressed-tensors logs every file copy and warns that the existing
    quantization config "may be overwritten" (ours restores it): keep that quiet."""
    logger.disable("compressed_tensors.entrypoints")
    try:
        yield
    finally:
        logger.enable("compressed_tensors.entrypoints")


# ---------------------------------------------------------------------------
# destination handling and the public entry point


def _is_within(child: Path, parent: Path) -> bool:
    try:
        child.relative_to(parent)
        return True
    except ValueError:
        return False


def check_destination(src: str | os.PathLike, dst: str | os.PathLike, *, force: bool = False) -> Path:
    """Refuse a destination that would overwrite or modify the source, or existing data.

    ``dst == src``, ``dst`` inside ``src`` and ``src`` inside ``dst`` are refused
    always; an existing non-empty ``dst`` (or a file) unless ``force``.
    Returns the absolute destination path.
    """
    src_r = Path(src).resolve()
    dst_abs = Path(os.path.abspath(dst))
    dst_r = dst_abs.resolve()
    if dst_r == src_r:
        raise DestinationError(f"output {dst} is the source checkpoint; refusing to overwrite it (even with --force)")
    if _is_within(dst_r, src_r):
        raise DestinationError(f"output {dst} is inside the source checkpoint {src}; the source is never modified")
    if _is_within(src_r, dst_r):
        raise DestinationError(f"the source {src} is inside the output {dst}; refusing (it would be replaced)")
    if dst_abs.exists() or dst_abs.is_symlink():
        if dst_abs.is_dir() and not dst_abs.is_symlink() and not any(dst_abs.iterdir()):
            return dst_abs
        if not force:
            kind = "a non-empty directory" if dst_abs.is_dir() else "a file"
            raise DestinationError(f"output {dst} exists and is {kind}; pass --force (force=True) to replace it")
    if not dst_abs.parent.is_dir():
        raise DestinationError(f"the parent directory of {dst} does not exist")
    return dst_abs


def _swap_into_place(tmp: Path, dst: Path) -> None:
    old = None
    if dst.exists() or dst.is_symlink():
        if dst.is_dir() and not dst.is_symlink():
            if any(dst.iterdir()):
                old = dst.with_name(f".{dst.name}.reap-old-{uuid.uuid4().hex[:8]}")
                os.rename(dst, old)
            else:
                dst.rmdir()
        else:
            old = dst.with_name(f".{dst.name}.reap-old-{uuid.uuid4().hex[:8]}")
            os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except BaseException:
        if old is not None:
            os.rename(old, dst)
        raise
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def rewrite_checkpoint(
    src: str | os.PathLike,
    plan: PruningPlan,
    dst: str | os.PathLike,
    *,
    scores_path: str | os.PathLike | None = None,
    force: bool = False,
    method: str = DEFAULT_METHOD,
    extra_layers: ExtraLayers = "error",
    progress: bool = True,
    hash_source: bool = True,
    hash_cache: str | os.PathLike | None | bool = None,
    hash_workers: int | None = None,
    output_checksum: str | None = None,
    manifest_extra: dict | None = None,
) -> Path:
    """Write ``dst``: the checkpoint at ``src`` with ``plan`` applied, bit-exact.

    Everything that can be checked is checked before any byte is written (see
    :func:`bind_plan`, :func:`check_destination`).  The output is built in a
    temporary directory next to ``dst`` and renamed into place when complete; on any
    error (or interrupt) the temporary directory is removed and ``dst`` is left as it
    was.  ``src`` is only read.  ``dst/pruning_manifest.json`` records the plan, the
    sha256 of every source shard (unless ``hash_source=False``) and of the scores
    file, the layer map, and the size and checksum of every output shard.

    :param plan: kept original ids per MoE layer (model module paths)
    :param scores_path: the scores file the plan was cut from (hashed into the manifest)
    :param force: replace an existing non-empty ``dst`` (never ``src``)
    :param method: recorded in the manifest
    :param extra_layers: what to do with MoE blocks the plan does not name:
        ``"error"`` (default), ``"like-last"`` or ``{checkpoint_prefix: plan_layer}``
    :param hash_source: sha256 every source shard (in a pool beside the writer)
    :param hash_cache: cache file for source shard hashes, keyed by file identity;
        ``None`` = :func:`default_hash_cache`, ``False`` = no cache
    :param hash_workers: threads hashing source shards (default ``min(8, cpus - 1)``)
    :param output_checksum: checksum recorded per output shard: ``"xxh3_128"``
        (default when ``xxhash`` is installed) or ``"sha256"``
    :param manifest_extra: merged into the manifest (e.g. the caller's parameters)
    :returns: the destination path
    """
    src = Path(src)
    layout = inspect_checkpoint(src)
    if layout.unindexed_files:
        raise CheckpointError(
            f"{src}: safetensors file(s) {layout.unindexed_files} are not referenced by "
            "the weight index; remove them or add them to the index"
        )
    spec = bind_plan(layout, plan, extra_layers=extra_layers)
    dst = check_destination(src, dst, force=force)
    scores = None
    if scores_path is not None:
        scores_path = Path(scores_path)
        if not scores_path.is_file():
            raise CheckpointError(f"scores file {scores_path} does not exist")
        scores = {"path": str(scores_path.resolve()), "sha256": sha256_file(scores_path)}

    cache = default_hash_cache() if hash_cache is None or hash_cache is True else (Path(hash_cache) if hash_cache else None)
    hasher = None
    if hash_source:
        hasher = SourceHasher(
            {shard: layout.path / shard for shard in layout.shards}, workers=hash_workers, cache=cache
        )
    bar = None
    tmp = dst.parent / f".{dst.name}.reap-tmp-{uuid.uuid4().hex[:8]}"
    converter = None
    try:
        if hasher is not None:
            hasher.prepare()
        if progress:
            from tqdm.auto import tqdm

            kept = sum(
                r[1] - r[0]
                for shard in layout.shards
                for _, _, ranges, _ in spec.output_plan(shard, [n for n, s in layout.weight_map.items() if s == shard])
                for r in ranges
            )
            total = kept + (hasher.bytes_to_hash if hasher is not None else 0)
            bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="reap prune", dynamic_ncols=True)
            if hasher is not None:
                hasher.progress = bar.update
        if hasher is not None:
            hasher.start()
        converter = ExpertPlanPruner(spec, progress=bar.update if bar else None, output_checksum=output_checksum)
        _convert(layout.path, tmp, converter)
        source_shards = hasher.result() if hasher is not None else None
        if bar is not None:
            bar.close()
        written = {p.relative_to(tmp).as_posix() for p in tmp.rglob("*.safetensors")}
        if written != set(converter.output_bytes):
            raise CheckpointError(
                f"internal error: shards written {sorted(written)} != recorded {sorted(converter.output_bytes)}"
            )
        extra = {
            "checkpoint": {
                "source_format": layout.quantization_formats,
                "layer_map": spec.layer_map,
                "extra_layers": spec.extra,
                "block_kept": spec.block_kept,
                "count_keys": spec.count_keys,
                "index_file": layout.index_file,
                "output_shards": {
                    name: {"bytes": converter.output_bytes[name], converter.output_checksum: converter.output_checksums.get(name)}
                    for name in sorted(converter.output_bytes)
                },
                "output_checksum": converter.output_checksum,
                "tensors": dict(converter.counts),
                "quantization_config_names": dict(converter.quant_stats),
            }
        }
        if manifest_extra:
            extra.update(manifest_extra)
        source = {"path": str(layout.path.resolve()), "shards": source_shards}
        if hasher is not None:
            source["sha256_from_cache"] = sorted(hasher.cached)
        manifest = build_manifest(
            plan,
            method=method,
            model_class=layout.model_class,
            count_key=spec.count_keys[0] if len(spec.count_keys) == 1 else ",".join(spec.count_keys),
            source=source,
            scores=scores,
            extra=extra,
        )
        write_json_atomic(tmp / MANIFEST_NAME, manifest)
        _swap_into_place(tmp, dst)
    except BaseException:
        if hasher is not None:
            hasher.cancel()
        if bar is not None:
            bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info(
        f"REAP: wrote {dst} ({plan.num_experts} -> {plan.num_kept} experts in "
        f"{len(spec.block_kept)} MoE layers; {converter.counts})"
    )
    return dst
