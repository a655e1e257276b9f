"""MoE blocks as a checkpoint stores them: which tensors belong to which block, and how
each is cut.

A MoE block is a module prefix owning ``{block}.experts.*`` tensors (or, for Granite-MoE,
a router weight beside 3-D tensors with a leading expert dim). Every tensor under it gets
a scope (:func:`tensor_scope`): per-expert ``{block}.experts.{e}.{rest}``, fused experts
``{block}.experts.{param}``, router ``{block}.gate.*`` / ``{block}.router.*`` (any
depth), shared experts, or the block's own; the rule of
:mod:`reap_modifier.models.expert_tensors` (the one surgery and the wholeness check use
in memory) then says which are cut along which dimension, which are token -> expert
tables, and which hold the expert count where no rule can cut them. Headers only: the
rewriter and ``reap verify`` share these names and checks.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..models.config_keys import ROUTER_ATTRS
from ..models.expert_tensors import cut_dim, left_behind, unknown_count
from ..models.tensor_names import ROUTER_WEIGHT_RE, layer_index
from .errors import CheckpointError
from .safetensors_header import TensorEntry

__all__ = [
    "FUSED_RE",
    "LAYER_RE",
    "MODULE_EXPERT_RE",
    "MoEBlock",
    "PER_EXPERT_RE",
    "ROUTER_MODULES",
    "check_block",
    "format_ids",
    "left_behind_in",
    "scan_moe_blocks",
    "tensor_scope",
]

#: module names (directly under a MoE block) whose tensors are router rows
ROUTER_MODULES = ROUTER_ATTRS

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


def format_ids(ids: list[int], limit: int = 12) -> str:
    s = ", ".join(str(i) for i in ids[:limit])
    return s + (f", ... ({len(ids)} in all)" if len(ids) > limit else "")
