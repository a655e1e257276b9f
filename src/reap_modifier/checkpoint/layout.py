"""A checkpoint directory's layout: config, weight map, shard headers and MoE blocks.

Tensor-name conventions the rewriter and ``reap verify`` share live here. A MoE block is
a module prefix owning ``{block}.experts.*`` tensors (or, for Granite-MoE, a router
weight beside 3-D tensors with a leading expert dim). Every tensor under it gets a scope
(:func:`tensor_scope`): per-expert ``{block}.experts.{e}.{rest}``, fused experts
``{block}.experts.{param}``, router ``{block}.gate.*`` / ``{block}.router.*`` (any
depth), shared experts, or the block's own; the rule of
:mod:`reap_modifier.models.expert_tensors` (the one surgery and the wholeness check use
in memory) then says which are cut along which dimension, which are token -> expert
tables, and which hold the expert count where no rule can cut them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..models.config_keys import ROUTER_ATTRS
from ..models.expert_tensors import cut_dim, left_behind, unknown_count
from ..models.moe_fields import NESTED_CONFIGS, config_sections, config_value, moe_fields
from ..models.tensor_names import ROUTER_WEIGHT_RE, layer_index
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
    "config_count",
    "inspect_checkpoint",
    "left_behind_in",
    "preview",
    "quant_configs",
    "read_weight_map",
    "scan_moe_blocks",
    "set_dotted",
    "tensor_scope",
]

#: nested configs searched for count / top-k / group keys (besides the top level)
COUNT_KEY_CONTAINERS = NESTED_CONFIGS
QUANT_CONFIG_KEYS = ("quantization_config", "compression_config")
#: module names (directly under a MoE block) whose tensors are router rows
ROUTER_MODULES = ROUTER_ATTRS
#: the one safetensors file of an unindexed checkpoint
SINGLE_FILE_NAME = "model.safetensors"

PER_EXPERT_RE = re.compile(r"^(?P<block>.+)\.experts\.(?P<idx>\d+)\.(?P<rest>.+)$")
FUSED_RE = re.compile(r"^(?P<block>.+)\.experts\.(?P<rest>[^.\d][^.]*(?:\..+)?)$")
MODULE_EXPERT_RE = re.compile(r"^(?P<block>.+)\.experts\.(?P<idx>\d+)(?P<rest>(?:\..+)?)$")
LAYER_RE = re.compile(r"(?:^|\.)layers\.(?P<idx>\d+)\.(?P<container>.+)$")


@dataclass
class MoEBlock:
    """A module prefix that owns routed experts, as found in the checkpoint, with every
    tensor under it classified by :mod:`reap_modifier.models.expert_tensors`' rule."""

    prefix: str
    num_experts: int
    #: expert index -> {rest-of-name: tensor name}
    per_expert: dict[int, dict[str, str]] = field(default_factory=dict)
    #: fused expert tensors, cut on their first dim (``experts.gate_up_proj``, and
    #: 3-D tensors of other submodules with a leading expert dim: Granite's
    #: ``input_linear.weight``)
    fused: list[str] = field(default_factory=list)
    #: router tensors cut to the kept experts (rows, or a per-expert vector)
    router: list[str] = field(default_factory=list)
    #: per-expert vectors of the block outside the router (``expert_bias``,
    #: ``e_score_correction_bias`` on the block, ERNIE's ``moe_statics`` ``[1, E]``)
    vectors: list[str] = field(default_factory=list)
    #: every cut tensor -> the dimension cut (0 for rows)
    cuts: dict[str, int] = field(default_factory=dict)
    #: the router's logits weight ``[E (+ extra_rows), hidden]``
    router_weight: str | None = None
    #: router rows after the routed experts' (a logit per shared expert), kept as they are
    extra_rows: int = 0
    #: integer tensors of the router or the block: token -> expert tables (hash routing)
    tables: list[str] = field(default_factory=list)
    #: tensors with the expert count in a dimension that no rule cuts
    uncut: list[str] = field(default_factory=list)
    #: name -> scope (``per_expert``, ``experts``, ``router``, ``block``, ``shared``)
    scopes: dict[str, str] = field(default_factory=dict)

    @property
    def layer_index(self) -> int | None:
        return layer_index(self.prefix)

    def rows_for(self, name: str, kept: list[int]) -> list[int]:
        """The entries of tensor ``name`` (a cut tensor) that survive keeping ``kept``:
        the kept experts, then any trailing non-expert router rows."""
        if self.extra_rows and name == self.router_weight:
            E = self.num_experts
            return [*kept, *range(E, E + self.extra_rows)]
        return list(kept)


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


def quant_configs(config: dict) -> list[dict]:
    out = []
    for _, container in config_sections(config):
        for key in QUANT_CONFIG_KEYS:
            if isinstance(container.get(key), dict):
                out.append(container[key])
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


#: safetensors dtypes of token -> expert tables (``U8`` is packed weights, never a table)
TABLE_DTYPES = frozenset({"I8", "I16", "I32", "I64", "U16", "U32", "U64"})
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"})


def tensor_scope(rel: str) -> str:
    """Where a tensor named ``{block}.{rel}`` lives in its MoE block: ``per_expert``
    (``experts.{e}.*``), ``experts`` (fused), ``router`` (``gate.*`` / ``router.*``),
    ``shared`` (a shared expert: ``shared_*``), else ``block`` (the block's own tensors
    and, on disk, its other submodules, e.g. ERNIE's ``moe_statics``)."""
    head, _, tail = rel.partition(".")
    if head == "experts" and tail:
        return "per_expert" if tail.split(".", 1)[0].isdigit() else "experts"
    if head in ROUTER_MODULES and tail:
        return "router"
    if tail and head.startswith("shared"):
        return "shared"
    return "block"


def _router_weight(names: list[str], entries: Mapping[str, TensorEntry]) -> list[str]:
    """Router tensors that can be the logits weight: floating, 2-D, named ``*.weight``."""
    return [
        n
        for n in names
        if n.endswith(".weight")
        and len(entries[n].shape) == 2
        and entries[n].dtype in FLOAT_DTYPES | {"U8"}
    ]


def _prefixes(entries: Mapping[str, TensorEntry], num_experts: int | None) -> set[str]:
    """MoE block prefixes: owners of ``.experts.`` tensors, and (with the config's count)
    owners of a router weight of that many rows beside a 3-D tensor with a leading expert
    dim (Granite-MoE's ``router.layer.weight`` + ``input_linear.weight``)."""
    prefixes = set()
    for name in entries:
        m = PER_EXPERT_RE.match(name) or FUSED_RE.match(name)
        if m:
            prefixes.add(m["block"])
    if num_experts:
        for name, entry in entries.items():
            m = ROUTER_WEIGHT_RE.match(name)
            if not m or len(entry.shape) != 2 or entry.shape[0] != num_experts:
                continue
            p = m["block"]
            if p in prefixes or any(p.startswith(q + ".") for q in prefixes):
                continue
            if any(
                n.startswith(p + ".")
                and tensor_scope(n[len(p) + 1 :]) == "block"
                and "." in n[len(p) + 1 :]
                and len(e.shape) == 3
                and e.shape[0] == num_experts
                for n, e in entries.items()
            ):
                prefixes.add(p)
    # an "experts" segment nested inside another block's expert is not a block
    return {
        p for p in prefixes if not any(p.startswith(q + ".experts.") for q in prefixes if q != p)
    }


def _block_count(
    per_expert: dict, members: dict[str, str], entries: Mapping[str, TensorEntry], hint
) -> int | None:
    """The block's expert count: per-expert indices, else the leading dim of fused
    tensors (and other 3-D ones), else the router weight's rows."""
    if per_expert:
        return max(per_expert) + 1
    lead = [
        entries[n].shape[0]
        for n, scope in members.items()
        if entries[n].shape
        and (
            (scope == "experts" and len(entries[n].shape) >= 2)
            or (scope == "block" and len(entries[n].shape) == 3)
        )
    ]
    if lead:
        return hint if hint in lead else max(set(lead), key=lead.count)
    weights = _router_weight([n for n, s in members.items() if s == "router"], entries)
    rows = [entries[n].shape[0] for n in weights]
    if rows:
        return hint if hint in rows else min(rows)
    return None


def _classify_block(
    p: str, members: dict[str, str], per_expert: dict, entries: Mapping[str, TensorEntry], E: int
) -> MoEBlock:
    block = MoEBlock(prefix=p, num_experts=E, per_expert=per_expert, scopes=dict(members))
    router_names = sorted(n for n, s in members.items() if s == "router")
    weights = _router_weight(router_names, entries)
    exact = [n for n in weights if entries[n].shape[0] == E]
    wider = [n for n in weights if entries[n].shape[0] > E]
    if exact:
        block.router_weight = exact[0]
    elif len(wider) == 1:
        block.router_weight = wider[0]
        block.extra_rows = entries[wider[0]].shape[0] - E
    fused_3d_subs = {
        n[len(p) + 1 :].split(".", 1)[0]
        for n, s in members.items()
        if s == "block" and len(entries[n].shape) == 3 and entries[n].shape[0] == E
    }
    for name in sorted(members):
        scope, entry = members[name], entries[name]
        rel = name[len(p) + 1 :]
        if scope in ("per_expert", "shared"):
            continue
        if scope in ("router", "block") and entry.dtype in TABLE_DTYPES and entry.shape:
            block.tables.append(name)
            continue
        if scope == "block" and "." in rel and rel.split(".", 1)[0] in fused_3d_subs:
            scope = block.scopes[name] = "experts"  # stacked experts under another name
        elif _submodule_weight(scope, rel):
            continue
        if name == block.router_weight and block.extra_rows:
            dim = 0
        else:
            dim = cut_dim(entry.shape, E, scope)
        if dim is not None:
            block.cuts[name] = dim
            {"experts": block.fused, "router": block.router, "block": block.vectors}[scope].append(
                name
            )
        elif _unknown(entry.shape, E, scope, rel):
            block.uncut.append(name)
    return block


def _submodule_weight(scope: str, rel: str) -> bool:
    """A ``weight`` of a submodule of the block that is neither experts, router nor
    shared expert: that module's own parameter (a norm's scale, a projection), never one
    entry per expert, whatever its size. Where the MoE block on disk is the decoder layer
    itself (Gemma 4, DiffusionGemma: ``layers.N.experts`` / ``layers.N.router``), its
    attention's ``q_norm.weight`` is ``[head_dim]``, and ``head_dim`` may equal the expert
    count; per-expert routing vectors of a submodule are biases and statistics (ERNIE's
    ``moe_statics.e_score_correction_bias``)."""
    return scope == "block" and "." in rel and rel.rsplit(".", 1)[1] == "weight"


def _unknown(shape, count: int, scope: str, rel: str) -> bool:
    """:func:`unknown_count` (the expert count in a dimension no rule cuts: refused, as no
    forward proves the checkpoint), except for a tensor of a submodule of the block
    (``rel`` has a dot) that is neither experts, router nor shared expert: only its
    per-expert vectors are per expert (ERNIE's ``moe_statics``), its other tensors are
    that module's own (Kimi K3's latent ``routed_expert_up_proj`` ``[hidden, latent]``
    with latent = E)."""
    return not (scope == "block" and "." in rel) and unknown_count(shape, count, scope)


def scan_moe_blocks(
    entries: Mapping[str, TensorEntry], num_experts: int | None = None
) -> dict[str, MoEBlock]:
    """Find MoE blocks and classify every tensor under each (``num_experts``: the
    config's count, which also finds blocks without an ``experts`` module)."""
    prefixes = _prefixes(entries, num_experts)
    ordered = sorted(prefixes, key=len, reverse=True)
    members: dict[str, dict[str, str]] = {p: {} for p in prefixes}
    per_expert: dict[str, dict[int, dict[str, str]]] = {p: {} for p in prefixes}
    for name in entries:
        p = next((q for q in ordered if name.startswith(q + ".")), None)
        if p is None:
            continue
        rel = name[len(p) + 1 :]
        scope = tensor_scope(rel)
        members[p][name] = scope
        if scope == "per_expert":
            m = PER_EXPERT_RE.match(name)
            per_expert[p].setdefault(int(m["idx"]), {})[m["rest"]] = name
    blocks = {}
    for p in sorted(prefixes):
        E = _block_count(per_expert[p], members[p], entries, num_experts)
        if E is None:
            raise CheckpointError(f"MoE block {p}: cannot tell its expert count")
        blocks[p] = _classify_block(p, members[p], per_expert[p], entries, E)
    return blocks


def check_block(
    block: MoEBlock,
    entries: Mapping[str, TensorEntry],
    expected: int | None = None,
    cuts: Mapping[str, int] | None = None,
) -> list[str]:
    """Structural problems of one MoE block (empty list when consistent): no router
    weight, a cut tensor without ``expected`` entries (``cuts``: name -> dimension, e.g.
    as a manifest records them; default the block's own), missing / orphan / incomplete
    experts."""
    problems = []
    E = expected if expected is not None else block.num_experts
    p = block.prefix
    if block.router_weight is None:
        problems.append(
            f"{p}: no router weight ({' / '.join(ROUTER_MODULES)} tensor named *.weight, "
            f"2-D, {block.num_experts} rows) found"
        )
    if cuts is None:
        cuts = block.cuts
    for name, dim in sorted(cuts.items()):
        if not name.startswith(p + ".") or PER_EXPERT_RE.match(name):
            continue
        if name not in entries:
            problems.append(f"{name}: missing (a tensor of {p} cut to the kept experts)")
            continue
        shape = entries[name].shape
        want = E + (block.extra_rows if name == block.router_weight else 0)
        if len(shape) <= dim or shape[dim] != want:
            what = "first dim" if dim == 0 else f"dim {dim}"
            problems.append(f"{name}: shape {list(shape)}, expected {what} {want} (experts)")
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


def left_behind_in(
    block: MoEBlock, shapes: Mapping[str, tuple[int, ...]], old_count: int
) -> list[str]:
    """The wholeness rule on a block's tensors after a cut (``shapes``: name -> shape of
    the output): each router, block or fused tensor whose expert axis still has
    ``old_count`` (the router weight with trailing shared-expert rows is checked by
    :func:`check_block`, whose count it knows)."""
    out = []
    for name, scope in sorted(block.scopes.items()):
        if scope in ("per_expert", "shared") or name in block.tables or name not in shapes:
            continue
        if block.extra_rows and name == block.router_weight:
            continue
        if _submodule_weight(scope, name[len(block.prefix) + 1 :]):
            continue
        if left_behind(shapes[name], old_count, scope):
            out.append(
                f"{name}: shape {list(shapes[name])} still has {old_count} experts ({scope} tensor)"
            )
    return out


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
