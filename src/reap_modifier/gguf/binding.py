"""A :class:`PruningPlan` bound to a GGUF model: which layer each plan layer is, the kept
experts of every MoE layer, and what becomes of each tensor; every refusal is here, made
before anything is written.

In a GGUF the expert is the outermost dimension of every per-expert tensor
(``ffn_{gate,up,down,gate_up}_exps`` and their biases, the router ``ffn_gate_inp``, the
routing bias ``exp_probs_b``), so each expert is one contiguous slab of whole quantization
blocks and a kept expert is a byte range of the source. Everything else is copied whole.

Refused, one line each: a plan for another expert count or other layers (router shape),
keep below ``expert_used_count`` (llama.cpp aborts on it), groups that
``expert_group_count`` does not divide or a plan keeping uneven groups, hash-routed layers
(a token -> expert table), and MoE layers the plan does not name (such as the MTP /
next-token layers) unless ``extra_layers="like-last"``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..models.tensor_names import layer_index
from ..scores.plan import PruningPlan
from .errors import GGUFError
from .layout import BLOCK_RE, GGUFLayout, GGUFTensor

__all__ = ["GGUFSpec", "bind_gguf_plan", "is_per_expert", "moe_layers", "plan_layer_number"]

#: per-expert tensors of a layer, by the name after ``blk.<L>.``: the stacked experts (and
#: their biases / scales), the router rows and bias, the sigmoid routers' selection bias
PER_EXPERT_RE = re.compile(r"^(?:[a-z_]+_exps|ffn_gate_inp|exp_probs_b)\.[a-z_]+$")
ROUTER = "ffn_gate_inp.weight"
#: a token -> expert table (hash routing): pruning cannot keep it exact
HASH_ROUTED_RE = re.compile(r"tid2eid")


def is_per_expert(rest: str) -> bool:
    """Whether a layer tensor (its name after ``blk.<L>.``) has the expert as its
    outermost dimension."""
    return PER_EXPERT_RE.match(rest) is not None


def moe_layers(layout: GGUFLayout) -> dict[int, list[str]]:
    """Layer number -> its per-expert tensors, for every layer with a router."""
    out = {}
    for layer, names in layout.layer_tensors().items():
        rests = [BLOCK_RE.match(n)["rest"] for n in names]
        if ROUTER in rests:
            out[layer] = [n for n, r in zip(names, rests) if is_per_expert(r)]
    return dict(sorted(out.items()))


def plan_layer_number(name: str) -> int | None:
    """The GGUF layer of a plan layer: ``model.layers.<L>.mlp`` (a module path) or
    ``blk.<L>``."""
    m = re.fullmatch(r"blk\.(\d+)", name)
    return int(m[1]) if m else layer_index(name)


@dataclass
class GGUFSpec:
    """The bound plan: kept original ids per layer, and the fate of every tensor."""

    num_experts: int
    num_kept: int
    block_kept: dict[int, list[int]]
    #: layers the plan does not name, cut like another: ``{L: {"policy", "kept_from"}}``
    extra: dict[int, dict] = field(default_factory=dict)
    #: tensor name -> layer, for every per-expert tensor
    per_expert: dict[str, int] = field(default_factory=dict)

    def output_tensor(self, t: GGUFTensor) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
        """The output dims of ``t`` and the byte ranges of its source file that make its
        data, in order (the kept slabs, merged where adjacent)."""
        layer = self.per_expert.get(t.name)
        if layer is None:
            return t.dims, [(t.offset, t.offset + t.nbytes)]
        kept = self.block_kept[layer]
        return (*t.dims[:-1], len(kept)), slab_ranges(t, kept)


def slab_ranges(t: GGUFTensor, kept: Iterable[int]) -> list[tuple[int, int]]:
    """The byte ranges of ``t``'s slabs ``kept`` (outermost index), adjacent ones merged."""
    slab = t.nbytes // t.dims[-1]
    ranges: list[tuple[int, int]] = []
    for e in kept:
        b = t.offset + e * slab
        if ranges and ranges[-1][1] == b:
            ranges[-1] = (ranges[-1][0], b + slab)
        else:
            ranges.append((b, b + slab))
    return ranges


def bind_gguf_plan(
    layout: GGUFLayout, plan: PruningPlan, *, extra_layers: str = "error"
) -> GGUFSpec:
    """Bind ``plan`` to ``layout``: one refusal (:class:`GGUFError`) per bad input, before
    anything is written (see the module docstring).

    :param extra_layers: MoE layers the plan does not name: ``"error"`` or
        ``"like-last"`` (cut with the kept ids of the deepest plan layer)
    """
    plan.validate()
    n, top_k = layout.num_experts, layout.top_k
    if n is None:
        raise GGUFError(
            f"{layout.path}: no {layout.key('expert_count')} key; it is not a MoE model"
        )
    layers = moe_layers(layout)
    _refuse_hash_routing(layout)
    if plan.num_experts != n:
        raise GGUFError(
            f"the plan is for {plan.num_experts} experts per layer but {layout.path} has {n}; "
            "use the plan (or scores) made for this model"
        )
    keep = plan.num_kept
    if top_k is not None and keep < top_k:
        raise GGUFError(
            f"the plan keeps {keep} experts but the model routes each token to {top_k} "
            f"({layout.key('expert_used_count')}); keep at least {top_k}"
        )
    kept = _plan_layers(layout, plan, layers)
    extra = _extra_layers(layout, layers, kept, extra_layers)
    block_kept = {**kept, **{L: kept[v["kept_from"]] for L, v in extra.items()}}
    _check_groups(layout, block_kept, keep, top_k)
    per_expert = {}
    tensors = layout.tensors
    for L, names in layers.items():
        for name in names:
            t = tensors[name][1]
            if t.dims[-1] != n:
                raise GGUFError(
                    f"{name} has {t.dims[-1]} rows on its expert axis but the model has {n} "
                    "experts; the file is inconsistent, reconvert it"
                )
            per_expert[name] = L
    return GGUFSpec(
        num_experts=n,
        num_kept=keep,
        block_kept=dict(sorted(block_kept.items())),
        extra=extra,
        per_expert=per_expert,
    )


def _refuse_hash_routing(layout: GGUFLayout) -> None:
    hashed = sorted(n for n in layout.tensors if HASH_ROUTED_RE.search(n))
    if hashed:
        raise GGUFError(
            f"{layout.path} has hash-routed layers ({hashed[0]}: a token -> expert table); "
            "pruning cannot keep their routing exact, so they are refused"
        )


def _plan_layers(
    layout: GGUFLayout, plan: PruningPlan, layers: dict[int, list[str]]
) -> dict[int, list[int]]:
    """Plan layer -> GGUF layer, each a MoE layer of the file, none twice."""
    kept: dict[int, list[int]] = {}
    for name, ids in plan.kept.items():
        L = plan_layer_number(name)
        if L is None:
            raise GGUFError(
                f"plan layer {name!r} names no layer number ('model.layers.<L>.mlp' or 'blk.<L>')"
            )
        if L not in layers:
            raise GGUFError(
                f"plan layer {name!r} is layer {L}, which is not a MoE layer of {layout.path} "
                f"(MoE layers: {_preview(layers)}); use the plan made for this model"
            )
        if L in kept:
            raise GGUFError(f"plan names layer {L} twice ({name!r}); give each layer once")
        kept[L] = list(ids)
    return kept


def _extra_layers(
    layout: GGUFLayout, layers: dict[int, list[str]], kept: dict[int, list[int]], policy: str
) -> dict[int, dict]:
    uncovered = [L for L in layers if L not in kept]
    if not uncovered:
        return {}
    if policy == "like-last":
        deepest = max(kept)
        return {L: {"policy": "like-last", "kept_from": deepest} for L in uncovered}
    if policy != "error":
        raise GGUFError(f"extra_layers must be 'error' or 'like-last', got {policy!r}")
    nextn = [L for L in uncovered if L in layout.nextn_layers]
    what = (
        f"the MTP / next-token layer(s) {nextn}"
        if nextn == uncovered
        else f"MoE layer(s) {uncovered}" + (f" (next-token: {nextn})" if nextn else "")
    )
    raise GGUFError(
        f"{layout.path} has {what} that the plan does not name; pass --extra-layers like-last "
        "to cut them with the kept ids of the deepest plan layer, or add them to the plan"
    )


def _check_groups(
    layout: GGUFLayout, block_kept: dict[int, list[int]], keep: int, top_k: int | None
) -> None:
    n = layout.num_experts
    n_group, group_used = layout.groups
    if not n_group or n_group <= 1:
        return
    key = layout.key("expert_group_count")
    if n % n_group:
        raise GGUFError(
            f"{key} = {n_group} does not divide the {n} experts; the file is inconsistent"
        )
    if keep % n_group:
        raise GGUFError(
            f"keeping {keep} experts cannot keep the {n_group} expert groups ({key}) even; "
            f"keep a multiple of {n_group}"
        )
    size = n // n_group
    for L, ids in block_kept.items():
        per = [sum(1 for i in ids if i // size == g) for g in range(n_group)]
        if len(set(per)) != 1:
            raise GGUFError(
                f"layer {L}: the plan keeps {per} experts in the {n_group} groups; llama.cpp's "
                "grouped routing needs the same count in every group: cut per group"
            )
    if group_used and top_k and (keep // n_group) * group_used < top_k:
        raise GGUFError(
            f"keeping {keep // n_group} experts per group leaves {group_used} groups "
            f"({layout.key('expert_group_used_count')}) fewer than the {top_k} experts each "
            f"token needs; keep at least {-(-top_k // group_used) * n_group}"
        )


def _preview(layers) -> str:
    names = [f"blk.{L}" for L in layers]
    return ", ".join(names[:6]) + (f" (+{len(names) - 6} more)" if len(names) > 6 else "")
