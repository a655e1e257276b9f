"""Why a model that has experts is not one REAP can prune: the reason named when
architecture discovery finds no MoE block it recognises.

Each rule is structural (what the modules hold, not their class names), so a new family
of the same shape gets the same explanation. A model with nothing sized by an expert
count is simply dense and gets no explanation here.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

from torch import nn

from .config_keys import COUNT_KEYS, text_config

__all__ = ["UnmatchedBlock", "expert_count", "explain_unrecognised"]


class UnmatchedBlock(NamedTuple):
    """A block with an ``experts`` module beside a ``gate`` / ``router`` that discovery
    did not recognise (found by :func:`~.architecture.find_moe_architecture`)."""

    name: str
    experts: nn.Module
    router: nn.Module
    #: whether the router has one ``[E, hidden]`` logits weight
    logits_weight: bool


_UNSUPPORTED = "Not supported in this version: no workaround (docs/families.md)."


def expert_count(config) -> tuple[str, int] | None:
    """The config's routed-expert count key and value, looked up in the (text) config
    and in its sub-configs (DBRX keeps ``moe_num_experts`` in ``ffn_config``)."""
    cfg = text_config(config)
    subs = [(f"{k}.", v) for k, v in vars(cfg).items() if hasattr(v, "to_dict")]
    for prefix, holder in [("", cfg), *subs]:
        for key in COUNT_KEYS:
            value = getattr(holder, key, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 1:
                return prefix + key, value
    return None


def _positional(module: nn.Module) -> list[str]:
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _linears(module: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Linear)]


def _router_network(family: str, name: str, router: nn.Module, count: int) -> str:
    linears = _linears(router)
    last_name, last = linears[-1] if linears else ("-", None)
    extra = (last.out_features - count) if last is not None else 0
    skip = (
        f" Its output layer `{last_name}` has {extra} class(es) beyond the {count} "
        "experts (a skip / no-compute expert), which REAP cannot renumber."
        if extra > 0
        else ""
    )
    return (
        f"{family}: {name}: the router ({type(router).__name__}) is a network of "
        f"{len(linears)} linear layers, not one logits row per expert (e.g. ZAYA's MLP "
        "router, whose hidden states also feed the next layer's router); REAP cuts a "
        f"router by dropping expert rows of its one logits weight.{skip} {_UNSUPPORTED}"
    )


def _experts_layout(family: str, name: str, experts: nn.Module, count: int) -> str:
    args = _positional(experts)
    call = f"experts({', '.join(args)})"
    if args[1:2] and "logit" in args[1]:
        why = (
            f"the block calls {call}: the experts module receives router logits and picks "
            "its own top-k (e.g. Aria's grouped GEMM experts), so REAP cannot see or "
            "mask which experts a token went to"
        )
    else:
        shapes = [
            f"{n} {list(p.shape)}"
            for n, p in experts.named_parameters()
            if p.dim() >= 2 and p.shape[0] != count
        ][:3]
        why = (
            f"no parameter of {type(experts).__name__} has the {count} experts as its "
            f"leading dimension ({', '.join(shapes)}): the experts are stacked into one "
            "[experts x width, hidden] matrix (as in DBRX), a layout surgery and the "
            "checkpoint rewriter do not cut yet"
        )
    return f"{family}: {name}: {why}. {_UNSUPPORTED}"


def _sized_by_count(model: nn.Module, count: int) -> list[tuple[str, nn.Module, str]]:
    """(module name, module, tensor) for every tensor whose leading dimension is the
    expert count, or every embedding table with that many rows."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and module.num_embeddings == count:
            found.append((name, module, "weight"))
            continue
        for pname, param in module.named_parameters(recurse=False):
            if param.dim() >= 3 and param.shape[0] == count:
                found.append((name, module, pname))
    return found


def _top_block(name: str) -> str:
    """``model.layers.0.self_attention.experts.input_linear`` -> ``self_attention``."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit() and i + 1 < len(parts):
            return parts[i + 1]
    return parts[0]


def explain_unrecognised(model: nn.Module, unmatched: list[UnmatchedBlock]) -> str | None:
    """The reason this model's experts cannot be pruned, or ``None`` when nothing in it
    is sized by an expert count (a dense model).

    :param unmatched: the blocks discovery found but no adapter recognised, in model order
    """
    config = getattr(model, "config", None)
    counted = expert_count(config) if config is not None else None
    if counted is None:
        return None
    key, count = counted
    family = f"{getattr(config, 'model_type', '?')} ({type(model).__name__}, {key}={count})"

    if unmatched:
        block = unmatched[0]
        if not block.logits_weight:
            return _router_network(family, block.name, block.router, count)
        return _experts_layout(family, block.name, block.experts, count)

    sized = _sized_by_count(model, count)
    if not sized:
        return None
    embeddings = [n for n, m, _ in sized if isinstance(m, nn.Embedding)]
    if embeddings:
        return (
            f"{family}: {embeddings[0]} holds the experts as the {count} rows of an "
            "embedding table retrieved by product keys (e.g. Doge's CDMoE: the router "
            "scores two sets of sqrt(experts) keys, and each expert is a pair of them). "
            "An expert has no router row of its own, so dropping one cannot be expressed "
            f"as cutting the router. {_UNSUPPORTED}"
        )
    kinds = sorted({_top_block(n) for n, _, _ in sized})
    if len(kinds) > 1:
        where = ", ".join(
            f"{k} (e.g. {next(n for n, _, _ in sized if _top_block(n) == k)})" for k in kinds
        )
        return (
            f"{family}: tensors sized by the expert count sit in {len(kinds)} kinds of "
            f"block: {where}. A mixture of experts in attention beside the MoE MLP (e.g. "
            "JetMoE's MoA) shares the one count in the config, so pruning the MLP's "
            "experts alone would save a config that contradicts the attention's. "
            f"{_UNSUPPORTED}"
        )
    return (
        f"{family}: {sized[0][0]}.{sized[0][2]} is sized by the expert count, but no "
        f"block holds it as an `experts` module beside a `gate` / `router`. {_UNSUPPORTED}"
    )
