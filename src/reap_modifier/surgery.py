"""In-memory surgery: apply a :class:`PruningPlan` to a loaded model.

Per MoE layer: keep the planned experts (ascending original order, renumbered
0..n-1), slice the router's weight / bias / ``e_score_correction_bias`` rows
(keeping Parameter vs buffer), cut every other per-expert routing tensor of the router
or the block whatever its name or rank (``expert_bias``, a ``[1, E]`` statics bias),
remap token -> expert tables where that is exact, update every module attribute that
mirrors the expert count, and finally the count keys of the (text) config.
:mod:`reap_modifier.wholeness` then proves nothing was left behind.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from compressed_tensors import align_module_device
from compressed_tensors.offload.utils import to_tensor
from loguru import logger
from torch import nn

from .models import MoEArchitecture, MoELayer
from .models.config_keys import MODULE_COUNT_ATTRS
from .models.expert_tensors import cut_dim
from .scores.plan import PlanError, PruningPlan

__all__ = ["apply_plan", "prune_layer", "update_config_counts"]

_ROUTER_ROW_TENSORS = ("weight", "bias", "e_score_correction_bias")


def _select_rows(module: nn.Module, attr: str, index: torch.Tensor, num_experts: int) -> bool:
    """Replace ``module.<attr>`` by its rows ``index``, keeping Parameter vs buffer;
    whether it had ``num_experts`` rows to cut."""
    current = getattr(module, attr, None)
    if not isinstance(current, torch.Tensor) or current.dim() == 0:
        return False
    if current.shape[0] != num_experts:
        return False
    with align_module_device(module):
        live = getattr(module, attr)
        rows = live.detach().index_select(0, index.to(live.device)).contiguous()
    if isinstance(current, nn.Parameter):
        setattr(module, attr, nn.Parameter(rows, requires_grad=current.requires_grad))
    else:
        # buffers: `to_tensor` keeps offloaded buffers offloaded
        setattr(module, attr, to_tensor(rows, current))
    return True


def _select_dim(module: nn.Module, attr: str, index: torch.Tensor, dim: int) -> None:
    """Replace ``module.<attr>`` by its entries ``index`` along ``dim`` (Parameter vs
    buffer kept)."""
    current = getattr(module, attr)
    with align_module_device(module):
        live = getattr(module, attr)
        cut = live.detach().index_select(dim, index.to(live.device)).contiguous()
    if isinstance(current, nn.Parameter):
        setattr(module, attr, nn.Parameter(cut, requires_grad=current.requires_grad))
    else:
        setattr(module, attr, to_tensor(cut, current))


def _remap_table(name: str, module: nn.Module, attr: str, kept: list[int], num_experts: int):
    """A token -> expert table: renumber to the kept experts when it references only
    kept ones (then routing is exactly the masked routing); otherwise refuse."""
    table = getattr(module, attr)
    if table.numel() == 0 or int(table.min()) < 0 or int(table.max()) >= num_experts:
        return  # not expert ids
    new_id = torch.full((num_experts,), -1, dtype=table.dtype)
    new_id[torch.tensor(kept)] = torch.arange(len(kept), dtype=table.dtype)
    remapped = new_id.to(table.device)[table.long()]
    if bool((remapped < 0).any()):
        dropped = sorted(set(table.unique().tolist()) - set(kept))
        raise PlanError(
            f"{name}: token -> expert table routes tokens to dropped experts {dropped[:8]}; "
            "a hash-routed layer has no pruned equivalent of masking them. Keep those "
            "experts in this layer's plan or leave hash-routed models unpruned."
        )
    if isinstance(table, nn.Parameter):
        setattr(module, attr, nn.Parameter(remapped, requires_grad=False))
    else:
        setattr(module, attr, to_tensor(remapped, table))


def _cut_routing_tensors(
    layer: MoELayer, kept: list[int], num_experts: int, done: set[int]
) -> None:
    """Per-expert tensors of the router (any depth) and of the block (direct) not
    cut yet (``done``: ids of those cut as router rows): leading-dim rows of the router,
    expert-count vectors (``[E]``, ``[1, E]``) of either, token -> expert tables."""
    from .wholeness import is_table, routing_tensors

    index = torch.tensor(kept, dtype=torch.long)
    for name, module, attr, tensor in list(routing_tensors(layer)):
        if tensor.device.type == "meta" or id(tensor) in done:
            continue
        if is_table(tensor):
            _remap_table(name, module, attr, kept, num_experts)
            continue
        # no expert axis (not per expert) or already cut: None
        dim = cut_dim(tensor.shape, num_experts, "router" if module is not layer.block else "block")
        if dim is not None:
            _select_dim(module, attr, index, dim)


def _update_module_counts(module: nn.Module, new_count: int, old_count: int) -> None:
    for key in MODULE_COUNT_ATTRS:
        if getattr(module, key, None) == old_count and isinstance(getattr(module, key), int):
            setattr(module, key, new_count)
    if getattr(module, "out_features", None) == old_count:
        module.out_features = new_count


def _prune_fused_experts(experts: nn.Module, index: torch.Tensor, num_experts: int) -> None:
    """Fused 3-D experts: every direct parameter/buffer with a leading expert dim."""
    for name, _ in list(experts.named_parameters(recurse=False)) + list(
        experts.named_buffers(recurse=False)
    ):
        _select_rows(experts, name, index, num_experts)


def _prune_module_list(experts: nn.ModuleList, kept: list[int], num_experts: int) -> None:
    """Per-expert modules: keep the planned ones (objects reused, so offload state stays)."""
    modules = list(experts._modules.items())
    expert_mods = modules[:num_experts]
    rest = modules[num_experts:]  # e.g. LinearExperts2D's trailing act_fn
    new = OrderedDict((str(i), expert_mods[old][1]) for i, old in enumerate(kept))
    new.update(rest)
    experts._modules = new


def prune_layer(layer: MoELayer, kept: list[int], num_experts: int) -> None:
    """Prune one MoE block in place to the experts ``kept`` (ascending original ids)."""
    index = torch.tensor(kept, dtype=torch.long)
    experts = layer.experts
    if isinstance(experts, nn.ModuleList):
        _prune_module_list(experts, kept, num_experts)
    else:
        _prune_fused_experts(experts, index, num_experts)
    router = layer.router
    cut = [
        (router, attr)
        for attr in _ROUTER_ROW_TENSORS
        if _select_rows(router, attr, index, num_experts)
    ]
    if layer.extra_rows:  # trailing non-expert rows (shared-expert logits) stay
        total = num_experts + layer.extra_rows
        rows = torch.cat([index, torch.arange(num_experts, total)])
        cut += [(router, a) for a in ("weight", "bias") if _select_rows(router, a, rows, total)]
    # some families keep the correction bias on the block itself
    if _select_rows(layer.block, "e_score_correction_bias", index, num_experts):
        cut.append((layer.block, "e_score_correction_bias"))
    # never cut twice (kept + shared rows may equal the old count)
    _cut_routing_tensors(layer, kept, num_experts, {id(getattr(m, a)) for m, a in cut})
    for module in (layer.block, *router.modules(), experts):
        _update_module_counts(module, len(kept), num_experts)


def update_config_counts(config, keys: list[str], new_count: int) -> None:
    for key in keys:
        old = getattr(config, key, None)
        setattr(config, key, new_count)
        logger.info(f"REAP: {type(config).__name__}.{key}: {old} -> {new_count}")


def check_plan_fits(arch: MoEArchitecture, plan: PruningPlan) -> None:
    """Raise :class:`PlanError` unless ``plan`` covers exactly the model's MoE layers,
    with the model's expert count, and is itself valid (checked before any change)."""
    if plan.num_experts != arch.num_experts:
        raise PlanError(
            f"plan was made for {plan.num_experts} experts per layer, the model has "
            f"{arch.num_experts}"
        )
    names = set(arch.layer_names)
    missing = sorted(names - set(plan.kept))
    extra = sorted(set(plan.kept) - names)
    if missing or extra:
        raise PlanError(
            f"plan layers do not match the model's MoE layers: missing {missing[:4]}, "
            f"unknown {extra[:4]}"
        )
    plan.validate()


def apply_plan(model: nn.Module, arch: MoEArchitecture, plan: PruningPlan) -> None:
    """Apply ``plan`` to every MoE layer of ``model`` and update the config counts.

    :raises PlanError: the plan does not cover exactly the model's MoE layers or its
        expert count differs from the model's
    """
    check_plan_fits(arch, plan)
    for layer in arch.layers:
        prune_layer(layer, plan.kept[layer.name], arch.num_experts)
    update_config_counts(arch.config, arch.count_keys, plan.num_kept)
    arch.num_experts = plan.num_kept
    logger.info(
        f"REAP: pruned {len(arch.layers)} MoE layers to {plan.num_kept} of "
        f"{plan.num_experts} experts"
    )
