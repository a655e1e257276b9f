"""Architecture discovery: every prunable MoE block of a model and the config's MoE fields.

:func:`find_moe_architecture` walks the model, asks the registered adapters
(:mod:`.base`) which dispatch shape each block has, and reads the expert count,
top-k and expert groups from the (text) config. The result, a
:class:`MoEArchitecture`, is what the observer, the plan and the surgery work from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

# register the adapters adapter_for tries; the first match wins, so input-side gating (whose
# experts are also fused 3-D tensors) before the `experts(hidden, ids, weights)` shape
from . import input_gated, experts_call, kimi  # noqa: F401  # isort: skip
from .base import adapter_for
from .config_keys import (
    COUNT_KEYS,
    EXPERTS_ATTR,
    N_GROUP_KEYS,
    ROUTER_ATTRS,
    TOP_K_KEYS,
    TOPK_GROUP_KEYS,
    first_key,
    group_limit,
    text_config,
)
from .unrecognised import UnmatchedBlock, explain_unrecognised

__all__ = [
    "MoEArchitecture",
    "MoELayer",
    "NoMoEError",
    "UnsupportedMoEError",
    "find_moe_architecture",
    "router_weight_of",
]


class NoMoEError(ValueError):
    """The model has no MoE layer this package can prune."""


class UnsupportedMoEError(ValueError):
    """The model's MoE layers have a routing REAP cannot prune exactly (refused before
    calibration; the rules are in :mod:`.refusals`)."""


@dataclass
class MoELayer:
    """One prunable MoE block."""

    name: str
    block: nn.Module
    router_attr: str
    kind: str  # "experts_call" | "input_gated" | "kimi"
    #: router rows after the routed experts' (Inkling: one logit per shared expert,
    #: which joins the weight normalisation); kept as they are by surgery
    extra_rows: int = 0

    @property
    def router(self) -> nn.Module:
        return getattr(self.block, self.router_attr)

    @property
    def experts(self) -> nn.Module:
        return getattr(self.block, EXPERTS_ATTR)

    def router_weight(self) -> torch.Tensor:
        return router_weight_of(self.router)


@dataclass
class MoEArchitecture:
    """Everything the observer, the plan and the surgery need to know about a model."""

    model_class: str
    config: object  # the (text) config that holds the expert count
    count_keys: list[str]
    num_experts: int
    top_k: int
    n_group: int | None
    topk_group: int | None
    layers: list[MoELayer]
    ignored: list[str] = field(default_factory=list)

    @property
    def group_limited(self) -> bool:
        return group_limit(self.n_group, self.topk_group) is not None

    @property
    def layer_names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    def describe(self) -> dict:
        return {
            "model_class": self.model_class,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "count_keys": self.count_keys,
            "num_moe_layers": len(self.layers),
        }


def router_weight_of(router: nn.Module) -> torch.Tensor | None:
    """The router's ``[E, hidden]`` logits weight: its own ``weight``, or that of its
    only ``nn.Linear`` (AFMoE's ``router.gate``, Hunyuan's ``gate.wg``, DBRX's
    ``router.layer``). A router with several linears (ZAYA's down-projection and MLP)
    has no single logits weight: ``None``."""
    weight = getattr(router, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight
    linears = [m for m in router.modules() if isinstance(m, nn.Linear)]
    return linears[0].weight if len(linears) == 1 else None


def _block_parts(module: nn.Module) -> tuple[nn.Module, str] | None:
    """``(experts, router attribute)`` when ``module`` holds an ``experts`` module beside
    a ``gate`` / ``router`` module (a MoE block, recognised or not), else ``None``."""
    experts = getattr(module, EXPERTS_ATTR, None)
    if experts is None or not isinstance(experts, nn.Module):
        return None
    router_attr = next(
        (a for a in ROUTER_ATTRS if isinstance(getattr(module, a, None), nn.Module)), None
    )
    return (experts, router_attr) if router_attr is not None else None


def _matches(pattern: str, name: str) -> bool:
    """Upstream semantics (``re.search``), plus llm-compressor's ``re:`` prefix."""
    if pattern.startswith("re:"):
        pattern = pattern[3:]
    return re.search(pattern, name) is not None


def _find_blocks(model: nn.Module, ignore: list[str]) -> tuple[list[MoELayer], list[str]]:
    """The MoE blocks an adapter recognises (those ``ignore`` matches apart, by name);
    refuses a model with none (saying why where a block is unrecognised) and ``ignore``
    patterns that leave some MoE layers unpruned."""
    found: list[MoELayer] = []
    ignored: list[str] = []
    unmatched: list[UnmatchedBlock] = []
    for name, module in model.named_modules():
        parts = _block_parts(module)
        if parts is None:
            continue
        experts, router_attr = parts
        router = getattr(module, router_attr)
        logits_weight = router_weight_of(router) is not None
        adapter = adapter_for(module, experts, router) if logits_weight else None
        if adapter is None:
            unmatched.append(UnmatchedBlock(name, experts, router, logits_weight))
            continue
        if any(_matches(p, name) for p in ignore):
            ignored.append(name)
            continue
        found.append(MoELayer(name=name, block=module, router_attr=router_attr, kind=adapter.kind))

    if not found and not ignored:
        reason = explain_unrecognised(model, unmatched)
        if reason is not None:
            raise UnsupportedMoEError(reason)
        raise NoMoEError(
            f"{type(model).__name__} has no MoE layer REAP can prune (looked for blocks "
            f"with an `experts` module and a `gate`/`router` holding a weight). "
            "docs/families.md lists every family and whether it prunes."
        )
    if ignored:
        if not found:
            raise ValueError(
                f"`ignore` patterns {ignore} exclude every MoE layer ({len(ignored)}); "
                "nothing would be pruned. Remove the patterns that match MoE blocks."
            )
        raise ValueError(
            f"`ignore` patterns {ignore} leave {len(ignored)} MoE layers unpruned "
            f"(e.g. {ignored[:3]}) while {len(found)} would be pruned; the saved config "
            "holds a single expert count, so the checkpoint could not load. Prune every "
            "MoE layer (drop the patterns matching MoE blocks) or none."
        )
    return found, ignored


def _check_router_rows(
    model: nn.Module, found: list[MoELayer], num_experts: int, count_key: str
) -> None:
    """Each router has one row per routed expert, or as many more as the block has shared
    experts (recorded as ``extra_rows``); other extra rows are refused."""
    for layer in found:
        rows = layer.router_weight().shape[0]
        shared = getattr(layer.router, "n_shared_experts", 0)
        if isinstance(shared, int) and shared > 0 and rows == num_experts + shared:
            layer.extra_rows = shared
        elif rows > num_experts:
            family = getattr(model.config, "model_type", type(model).__name__)
            raise UnsupportedMoEError(
                f"{family} ({type(model).__name__}): {layer.name}: the router has {rows} "
                f"rows for {count_key}={num_experts} routed experts; the other "
                f"{rows - num_experts} route to slots that are not routed experts (e.g. "
                "LongCat-Flash's zero-computation experts), which REAP cannot renumber "
                "yet. Not supported: no workaround in this version (docs/families.md)."
            )
        elif rows != num_experts:
            raise ValueError(
                f"{layer.name}: router has {rows} rows but the config says "
                f"{count_key}={num_experts}; the model is inconsistent"
            )


def find_moe_architecture(model: nn.Module, ignore: list[str] | None = None) -> MoEArchitecture:
    """Locate every prunable MoE block and read the MoE fields of the config.

    :param ignore: regex patterns (``re.search``) of module names to leave alone; a
        pattern that would leave *some* MoE layers unpruned is refused, because the
        saved config can hold only one expert count
    :raises NoMoEError: the model has no supported MoE block
    :raises ValueError: ``ignore`` excludes some but not all MoE layers
    """
    ignore = list(ignore or [])
    config = getattr(model, "config", None)
    if config is None:
        raise NoMoEError(f"{type(model).__name__} has no `config`; pass a transformers model")
    cfg = text_config(config)

    found, ignored = _find_blocks(model, ignore)

    # real keys only (transformers' attribute_map aliases resolve to one of them)
    stored = cfg.to_dict()
    count_keys = [k for k in COUNT_KEYS if isinstance(stored.get(k), int)] or [
        k for k in COUNT_KEYS if isinstance(getattr(cfg, k, None), int)
    ]
    if not count_keys:
        raise NoMoEError(f"{type(cfg).__name__} has none of the expert-count keys {COUNT_KEYS}")
    num_experts = int(getattr(cfg, count_keys[0]))
    _, top_k = first_key(cfg, TOP_K_KEYS)
    if top_k is None:
        raise NoMoEError(f"{type(cfg).__name__} has none of the top-k keys {TOP_K_KEYS}")
    _, n_group = first_key(cfg, N_GROUP_KEYS)
    _, topk_group = first_key(cfg, TOPK_GROUP_KEYS)

    _check_router_rows(model, found, num_experts, count_keys[0])

    return MoEArchitecture(
        model_class=type(model).__name__,
        config=cfg,
        count_keys=count_keys,
        num_experts=num_experts,
        top_k=int(top_k),
        n_group=int(n_group) if n_group is not None else None,
        topk_group=int(topk_group) if topk_group is not None else None,
        layers=found,
        ignored=ignored,
    )
