"""Binding a :class:`PruningPlan` to a checkpoint: plan layers -> checkpoint MoE blocks,
the fate of every tensor (dropped, renamed, rows selected), and per-expert module
names in ``quantization_config``.

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

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NoReturn

from loguru import logger

from ..models.config_keys import COUNT_KEYS, group_limit
from ..models.expert_tensors import hash_routed_message
from ..scores.plan import PlanError, PruningPlan
from .errors import CheckpointError, NotWholeError
from .layout import COUNT_KEY_CONTAINERS, CheckpointLayout, find_count_keys, preview
from .moe_blocks import (
    LAYER_RE,
    MODULE_EXPERT_RE,
    PER_EXPERT_RE,
    MoEBlock,
    check_block,
    left_behind_in,
)
from .quantization import check_packed_scales
from .safetensors_header import TensorEntry

__all__ = [
    "ExpertRemap",
    "ExtraLayers",
    "RewriteSpec",
    "bind_plan",
    "renumber_module_names",
    "resolve_block",
    "rewrite_quant_config",
]


def _layer_key(name: str) -> tuple[int, str] | None:
    m = LAYER_RE.search(name)
    return (int(m["idx"]), m["container"]) if m else None


#: MoE container names that transformers renames on load, both ways: a plan names the
#: loaded model's module (``model.layers.0.mlp``), the checkpoint its own tensors
#: (``model.layers.0.block_sparse_moe``). transformers 5's conversion mappings rename
#: ``.block_sparse_moe.`` to ``.mlp.`` for Mixtral-style checkpoints, ``.ffn.`` to
#: ``.mlp.`` for DeepSeek-V4.
CONTAINER_ALIASES = {
    "mlp": ("block_sparse_moe", "ffn"),
    "block_sparse_moe": ("mlp",),
    "ffn": ("mlp",),
}


def resolve_block(name: str, blocks: Iterable[str], *, what: str = "plan layer") -> str:
    """Checkpoint prefix for a module path: exact, else same ``layers.{L}.{container}``
    (the container may be its transformers alias, see :data:`CONTAINER_ALIASES`)."""
    blocks = list(blocks)
    if name in blocks:
        return name
    key = _layer_key(name)
    if key is None:
        raise CheckpointError(
            f"{what} {name!r} is not a MoE block of the checkpoint and has no "
            f"'layers.<index>.<container>' part to match by; checkpoint MoE blocks: "
            f"{preview(blocks)}"
        )
    matches = [b for b in blocks if _layer_key(b) == key]
    if not matches:
        aliases = {(key[0], alias) for alias in CONTAINER_ALIASES.get(key[1], ())}
        matches = [b for b in blocks if _layer_key(b) in aliases]
    if not matches:
        raise CheckpointError(
            f"{what} {name!r}: no MoE block of the checkpoint is layer {key[0]} "
            f"'{key[1]}'; checkpoint MoE blocks: {preview(blocks)}"
        )
    if len(matches) > 1:
        raise CheckpointError(
            f"{what} {name!r} is ambiguous: checkpoint MoE blocks {matches} all are "
            f"layer {key[0]} '{key[1]}'; give the plan exact checkpoint prefixes"
        )
    return matches[0]


ExtraLayers = str | Mapping[str, str]


class ExpertRemap:
    """Per-tensor fate under ``block_kept`` (checkpoint prefix -> kept original ids)."""

    def __init__(self, blocks: Mapping[str, MoEBlock], block_kept: Mapping[str, list[int]]):
        self.block_kept = {p: list(k) for p, k in block_kept.items()}
        self._remaps = {
            p: {old: new for new, old in enumerate(k)} for p, k in self.block_kept.items()
        }
        #: cut tensor -> (block, dimension)
        self._cut = {
            n: (blocks[p], dim)
            for p in self.block_kept
            if p in blocks
            for n, dim in blocks[p].cuts.items()
        }

    def action(self, name: str) -> tuple[str, list[int] | None] | None:
        """``None`` (dropped) or ``(out_name, entries)``: ``entries`` is ``None`` for a
        verbatim copy, else the entries kept along :meth:`dim` (router rows, fused expert
        rows, per-expert vectors)."""
        m = PER_EXPERT_RE.match(name)
        if m and m["block"] in self._remaps:
            new = self._remaps[m["block"]].get(int(m["idx"]))
            if new is None:
                return None
            return f"{m['block']}.experts.{new}.{m['rest']}", None
        cut = self._cut.get(name)
        if cut is not None:
            block = cut[0]
            return name, block.rows_for(name, self.block_kept[block.prefix])
        return name, None

    def dim(self, name: str) -> int:
        """The dimension a cut tensor is cut along (0: rows)."""
        cut = self._cut.get(name)
        return cut[1] if cut is not None else 0

    def out_shape(self, name: str, shape: tuple[int, ...], rows: list[int] | None):
        """The shape of ``name`` after the cut."""
        if rows is None:
            return tuple(shape)
        d = self.dim(name)
        return (*shape[:d], len(rows), *shape[d + 1 :])


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

    def output_plan(
        self, shard: str, names: Iterable[str] | None = None
    ) -> list[tuple[str, TensorEntry, list[tuple[int, int]], tuple[int, ...]]]:
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
                dim = self.remap.dim(entry.name)
                shape = self.remap.out_shape(entry.name, entry.shape, rows)
                out.append((out_name, entry, entry.index_ranges(rows, dim), shape))
        return out

    def cut_tensors(self) -> dict[str, int]:
        """Every tensor cut to the kept experts -> the dimension cut (for the manifest)."""
        return {
            name: dim
            for p in sorted(self.block_kept)
            for name, dim in sorted(self.layout.blocks[p].cuts.items())
        }

    def output_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every output tensor's name -> shape (headers only, before anything is written)."""
        out = {}
        for name in self.layout.weight_map:
            act = self.action(name)
            if act is not None:
                out[act[0]] = self.remap.out_shape(name, self.layout.entry(name).shape, act[1])
        return out

    def left_behind(self, shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
        """The wholeness rule on output ``shapes``: tensors of pruned blocks that still
        have the old expert count, and expert indices at or beyond the new count."""
        old, new = self.plan.num_experts, self.plan.num_kept
        problems = []
        for p in self.block_kept:
            block = self.layout.blocks[p]
            if new != old:
                problems += left_behind_in(block, shapes, old)
            for name in shapes:
                m = PER_EXPERT_RE.match(name)
                if m and m["block"] == p and int(m["idx"]) >= new:
                    problems.append(f"{name}: expert index beyond the new count {new}")
        return problems


def bind_plan(
    layout: CheckpointLayout, plan: PruningPlan, *, extra_layers: ExtraLayers = "error"
) -> RewriteSpec:
    """Map plan layers to checkpoint MoE blocks and check the plan fits the checkpoint.

    Raises :class:`CheckpointError` / :class:`PlanError` before any byte is written:
    unmatched or ambiguous layers, uncovered MoE blocks (per ``extra_layers``), expert
    counts that differ from the plan, missing count keys, a keep count below top-k,
    and, for group-limited routers, kept experts not spread equally over groups. The
    checks run in the order their errors should be reported.
    """
    plan.validate()
    _check_blocks_fit(layout, plan.num_experts)
    _refuse_unprunable(layout)
    _check_scales(layout)
    layer_map = _map_layers(layout, plan)
    block_kept = {p: list(plan.kept[layer]) for layer, p in layer_map.items()}
    uncovered = [p for p in layout.blocks if p not in block_kept]
    extra: dict[str, dict] = {}
    if uncovered:
        extra = _bind_extra_layers(layout, plan, uncovered, extra_layers)
        for p, info in extra.items():
            info["kept_original_ids"] = list(plan.kept[info["kept_from"]])
            block_kept[p] = info["kept_original_ids"]
    count_keys = _count_keys(layout, plan.num_experts)
    _check_keep_fits_routing(layout, plan, block_kept)
    spec = RewriteSpec(layout, plan, block_kept, layer_map, extra, sorted(count_keys))
    problems = spec.left_behind(spec.output_shapes())
    if problems:  # the rules above should make this impossible: the last line of defence
        raise NotWholeError(_not_whole(layout, problems))
    return spec


def _check_blocks_fit(layout: CheckpointLayout, E: int) -> None:
    """The checkpoint has MoE blocks, each consistent and holding the plan's ``E`` experts."""
    if not layout.blocks:
        raise CheckpointError(
            f"{layout.path}: no MoE block (no '.experts.' tensors) in the checkpoint"
        )
    problems = []
    for b in layout.blocks.values():
        problems += check_block(b, {n: layout.entry(n) for n in b.cuts}, None)
        if b.num_experts != E:
            problems.append(
                f"{b.prefix}: {b.num_experts} experts in the checkpoint, the plan is for {E}"
            )
    if problems:
        raise CheckpointError("checkpoint does not fit the plan:\n  " + "\n  ".join(problems))


def _check_scales(layout: CheckpointLayout) -> None:
    """Packed weights and their scales agree with the quantization config."""
    problems = check_packed_scales({n: layout.entry(n) for n in layout.weight_map}, layout.config)
    if problems:
        raise CheckpointError(
            f"{layout.path}: packed weights and scales disagree:\n  "
            + "\n  ".join(problems[:20])
            + (f"\n  ... {len(problems) - 20} more" if len(problems) > 20 else "")
        )


def _map_layers(layout: CheckpointLayout, plan: PruningPlan) -> dict[str, str]:
    """Plan layer -> checkpoint block, each block named by one plan layer at most."""
    layer_map: dict[str, str] = {}
    for layer in plan.kept:
        layer_map[layer] = resolve_block(layer, layout.blocks)
    dup = {p for p in layer_map.values() if list(layer_map.values()).count(p) > 1}
    if dup:
        raise CheckpointError(
            f"several plan layers map to the same checkpoint block(s) {sorted(dup)}"
        )
    return layer_map


def _bind_extra_layers(
    layout: CheckpointLayout, plan: PruningPlan, uncovered: list[str], extra_layers: ExtraLayers
) -> dict[str, dict]:
    """The rule for each MoE block the plan does not name (``extra_layers``): ``{prefix:
    {"policy", "kept_from"}}``; ``"error"`` raises, naming them."""
    extra: dict[str, dict] = {}
    if isinstance(extra_layers, Mapping):
        mapping = {
            resolve_block(k, layout.blocks, what="extra_layers key"): v
            for k, v in extra_layers.items()
        }
        for p in uncovered:
            src = mapping.get(p)
            if src is None:
                raise CheckpointError(
                    f"checkpoint MoE block {p!r} is neither in the plan nor in extra_layers"
                )
            if src not in plan.kept:
                raise CheckpointError(
                    f"extra_layers maps {p!r} to {src!r}, which is not a plan layer"
                )
            extra[p] = {"policy": "mapped", "kept_from": src}
    elif extra_layers == "like-last":
        deepest = max(plan.kept, key=lambda n: (_layer_key(n) or (-1, ""))[0])
        for p in uncovered:
            extra[p] = {"policy": "like-last", "kept_from": deepest}
    elif extra_layers == "error":
        _refuse_uncovered(layout, uncovered)
    else:
        raise CheckpointError(
            f"extra_layers must be 'error', 'like-last' or a mapping, got {extra_layers!r}"
        )
    return extra


def _refuse_uncovered(layout: CheckpointLayout, uncovered: list[str]) -> NoReturn:
    """``extra_layers="error"``: the blocks the plan does not cover, named, with the hint
    for an MTP layer (index at or past ``num_hidden_layers``) or the fix for a plan that
    misses decoder layers."""
    described = ", ".join(f"{p} ({layout.blocks[p].num_experts} experts)" for p in uncovered)
    nh = layout.config_value(("num_hidden_layers",))
    hint = ""
    if nh is not None and any(
        layout.blocks[p].layer_index is not None and layout.blocks[p].layer_index >= int(nh)
        for p in uncovered
    ):
        hint = f" (layer index >= num_hidden_layers={nh}: an MTP / next-token-prediction layer)"
    regular = [
        p
        for p in uncovered
        if nh is not None
        and layout.blocks[p].layer_index is not None
        and layout.blocks[p].layer_index < int(nh)
    ]
    if regular:  # not an MTP layer: the plan is incomplete or for another model
        raise CheckpointError(
            f"the plan does not cover MoE layer(s) {', '.join(regular)} of the checkpoint "
            f"(decoder layers, below num_hidden_layers={nh}); a plan must name every MoE "
            "layer the model runs: cut it from scores of this checkpoint (reap cut, or "
            "reap prune --scores)"
        )
    raise CheckpointError(
        f"the checkpoint has MoE layer(s) the plan does not cover: {described}{hint}. "
        "Every MoE layer must end with the same expert count. Pass --extra-layers "
        "like-last (extra_layers='like-last') to cut them with the kept ids of the "
        "deepest plan layer, or extra_layers={prefix: plan_layer}"
    )


def _count_keys(layout: CheckpointLayout, E: int) -> dict[str, int]:
    """The config's expert-count keys equal to ``E`` (the rewriter sets them); other count
    keys are left unchanged, with a warning."""
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
        logger.warning(
            f"config count keys {others} differ from the expert count {E}; left unchanged"
        )
    return count_keys


def _check_keep_fits_routing(
    layout: CheckpointLayout, plan: PruningPlan, block_kept: dict[str, list[int]]
) -> None:
    """The keep count is at least top-k, and a group-limited router keeps the same number
    of experts in every group."""
    E, keep = plan.num_experts, plan.num_kept
    top_k = layout.top_k
    if top_k is not None and keep < top_k:
        raise PlanError(
            f"the plan keeps {keep} experts per layer, fewer than top-k={top_k} in config.json"
        )
    n_group, topk_group = layout.groups
    if group_limit(n_group, topk_group) is not None:
        if E % n_group or keep % n_group:
            raise PlanError(
                f"{E} -> {keep} experts do not split into n_group={n_group} equal groups"
            )
        size = E // n_group
        for p, ids in block_kept.items():
            per = [sum(1 for i in ids if i // size == g) for g in range(n_group)]
            if len(set(per)) != 1:
                raise PlanError(
                    f"{p}: group-limited routing (n_group={n_group}, topk_group={topk_group}) "
                    f"needs the same number kept in every group; the plan keeps {per}"
                )


def _not_whole(layout: CheckpointLayout, problems: list[str]) -> str:
    return (
        f"{layout.path}: the pruned checkpoint would not be whole, nothing was written. "
        f"{len(problems)} tensor(s) of MoE blocks would keep the old expert count: "
        + "; ".join(problems[:8])
        + (f"; ... {len(problems) - 8} more" if len(problems) > 8 else "")
        + ". REAP does not know how to cut them; this family needs support for them "
        "(docs/architecture.md, 'Adding a model family')."
    )


def _refuse_unprunable(layout: CheckpointLayout) -> None:
    """Refuse, before anything is written, a checkpoint whose pruned blocks could not be
    whole: hash-routed layers (token -> expert tables), tensors holding the expert count
    where no rule cuts them, router rows beyond the experts that are not shared-expert
    logits. The same rules as the modifier's (:mod:`reap_modifier.models.refusals`,
    :mod:`reap_modifier.wholeness`)."""
    family = str(layout.config.get("model_type") or layout.model_class or "checkpoint")
    for p, block in sorted(layout.blocks.items()):
        if block.tables:
            table = block.tables[0][len(p) + 1 :]
            raise CheckpointError(hash_routed_message(family, layout.model_class, p, table))
    uncut = [
        f"{n}: shape {list(layout.entry(n).shape)} has {b.num_experts} (experts) in a "
        "dimension no rule cuts"
        for b in layout.blocks.values()
        for n in b.uncut
    ]
    if uncut:
        raise NotWholeError(_not_whole(layout, uncut))
    shared = layout.config_value(("n_shared_experts", "num_shared_experts"))
    for _, block in sorted(layout.blocks.items()):
        if block.extra_rows and block.extra_rows != shared:
            raise CheckpointError(
                f"{family} ({layout.model_class}): {block.router_weight}: the router has "
                f"{block.num_experts + block.extra_rows} rows for {block.num_experts} routed "
                f"experts; the other {block.extra_rows} route to slots that are not routed "
                "experts (n_shared_experts is "
                f"{shared}), which REAP cannot renumber. Not supported (docs/families.md)."
            )


# ---------------------------------------------------------------------------
# quantization_config per-expert names


def renumber_module_names(
    names: list, block_kept: Mapping[str, list[int]]
) -> tuple[list, int, int]:
    """Renumber / drop per-expert module names (``re:`` patterns are kept as they are).

    Returns ``(new_list, renumbered, dropped)``.
    """
    out, renumbered, dropped = [], 0, 0
    blocks = list(block_kept)
    remaps = {p: {old: new for new, old in enumerate(k)} for p, k in block_kept.items()}
    for item in names:
        m = (
            MODULE_EXPERT_RE.match(item)
            if isinstance(item, str) and not item.startswith("re:")
            else None
        )
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
