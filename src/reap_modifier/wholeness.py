"""Proof that a pruned model is whole, run after the cut and before anything is saved.

Surgery cuts what it knows. This module does not trust that; for every pruned MoE block
it checks, by knowledge of where each tensor lives (never by a size that happens to
equal the old expert count, such as a hidden size of 128 beside 128 experts):

- the experts: a ``ModuleList`` holds the new count of expert modules; every fused
  tensor (any name, packed or not) has the new count on its leading axis;
- the router: its logits weight has the new count of rows (plus any trailing
  shared-expert rows), and no tensor of the router or of the block itself still has the
  old count on its expert axis (rows, per-expert routing vectors such as
  ``e_score_correction_bias`` or ``[1, E]`` statics; the per-tensor rule is
  :mod:`reap_modifier.models.expert_tensors`, shared with the checkpoint rewriter);
- token -> expert tables hold only ids the pruned block has;
- the count attributes of the block, router and experts (``num_experts``, ...,
  ``out_features``) and the config's count keys say the new count.

Then a forward proves the rest (:func:`prove_forward`): the whole model on calibration
token ids when its forward takes them, else each pruned block on hidden states it saw
during calibration (a model whose forward takes hidden states). Any failure raises
:class:`WholenessError` naming the tensor, module or error, so the caller writes nothing
(the modifier raises before ``oneshot`` saves; ``reap prune`` checks the same rule on the
rewritten tensors).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
from loguru import logger
from torch import nn

from .models import MoEArchitecture, MoELayer
from .models.architecture import router_weight_of
from .models.config_keys import MODULE_COUNT_ATTRS
from .models.expert_tensors import left_behind

__all__ = ["WholenessError", "check_whole", "leftovers", "prove_forward", "routing_tensors"]

#: tokens of each MoE block's calibration input kept for the forward proof
SAMPLE_TOKENS = 4


class WholenessError(RuntimeError):
    """The pruned model is not whole; nothing was (or may be) written."""


def routing_tensors(layer: MoELayer):
    """``(qualified name, owner module, attr, tensor)`` of every tensor of the router
    (recursively) and of the block itself (direct only): where per-expert routing
    vectors and token -> expert tables live."""
    seen: set[int] = set()
    router_name = layer.router_attr
    owners = [
        (f"{router_name}.{n}" if n else router_name, m) for n, m in layer.router.named_modules()
    ]
    owners.append(("", layer.block))
    for prefix, module in owners:
        items = list(module.named_parameters(recurse=False)) + list(
            module.named_buffers(recurse=False)
        )
        for attr, tensor in items:
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            name = f"{prefix}.{attr}" if prefix else attr
            yield f"{layer.name}.{name}", module, attr, tensor


def is_table(tensor: torch.Tensor) -> bool:
    """An integer tensor of the routing path: a token -> expert id table."""
    return not tensor.is_floating_point() and tensor.dtype != torch.bool and tensor.dim() >= 1


def sample_rows(hidden: torch.Tensor, tokens: int = SAMPLE_TOKENS) -> torch.Tensor:
    """A few tokens of a MoE block's input, its rank kept (``[1, t, H]`` of ``[B, T, H]``,
    ``[t, H]`` of ``[N, H]``), detached on CPU: what :func:`prove_forward` runs it on."""
    rows = hidden[:1, :tokens] if hidden.dim() >= 3 else hidden[:tokens]
    return rows.detach().to("cpu", copy=True)


def _logits_rows(layer: MoELayer) -> tuple[nn.Module | None, set[int]]:
    """The module owning the router's logits weight and the ids of its weight and bias
    (rows = experts, plus ``extra_rows`` trailing shared-expert rows)."""
    weight = router_weight_of(layer.router)
    if weight is None:
        return None, set()
    owner = next((m for m in layer.router.modules() if getattr(m, "weight", None) is weight), None)
    bias = getattr(owner, "bias", None) if owner is not None else None
    return owner, {id(weight)} | ({id(bias)} if isinstance(bias, torch.Tensor) else set())


def _layer_leftovers(layer: MoELayer, old_count: int, new_count: int) -> list[str]:
    problems: list[str] = []
    owner, rows = _logits_rows(layer)
    want_rows = new_count + layer.extra_rows
    for name, module, _, tensor in routing_tensors(layer):
        if tensor.device.type == "meta":
            continue
        if is_table(tensor):
            if tensor.numel() and int(tensor.max()) >= new_count:
                problems.append(
                    f"{name}: token -> expert table still holds expert id "
                    f"{int(tensor.max())} (the block now has {new_count} experts)"
                )
        elif id(tensor) in rows:
            if tensor.dim() == 0 or tensor.shape[0] != want_rows:
                problems.append(
                    f"{name}: shape {tuple(tensor.shape)}, expected {want_rows} router rows"
                )
        elif left_behind(
            tensor.shape, old_count, "router" if module is not layer.block else "block"
        ):
            problems.append(f"{name}: shape {tuple(tensor.shape)} still has {old_count} experts")
    experts = layer.experts
    if isinstance(experts, nn.ModuleList):
        count = sum(1 for key in experts._modules if key.isdigit())
        if count != new_count:
            problems.append(f"{layer.name}.experts: {count} expert modules, expected {new_count}")
    else:
        for name, tensor in list(experts.named_parameters()) + list(experts.named_buffers()):
            if left_behind(tensor.shape, old_count, "experts"):
                problems.append(
                    f"{layer.name}.experts.{name}: shape {tuple(tensor.shape)} still has "
                    f"{old_count} experts"
                )
    modules = {"": layer.block, "experts": experts}
    modules.update(
        {f"{layer.router_attr}.{n}".rstrip("."): m for n, m in layer.router.named_modules()}
    )
    for prefix, module in modules.items():
        where = f"{layer.name}.{prefix}" if prefix else layer.name
        for key in MODULE_COUNT_ATTRS:
            value = getattr(module, key, None)
            if isinstance(value, int) and value == old_count:
                problems.append(f"{where}.{key} is still {old_count}")
        out = getattr(module, "out_features", None) if module is owner else None
        if isinstance(out, int) and out != want_rows:
            problems.append(f"{where}.out_features is {out}, expected {want_rows} router rows")
    return problems


def leftovers(arch: MoEArchitecture, old_count: int) -> list[str]:
    """What the cut left at the old expert count: one line per tensor, module or count."""
    new_count = arch.num_experts
    if new_count == old_count:
        return []
    problems = [p for layer in arch.layers for p in _layer_leftovers(layer, old_count, new_count)]
    for key in arch.count_keys:
        value = getattr(arch.config, key, None)
        if value != new_count:
            problems.append(f"config {key} is {value}, expected {new_count}")
    return problems


def _takes_token_ids(model: nn.Module) -> bool:
    """Whether ``model.forward`` names an ``input_ids`` parameter."""
    try:
        return "input_ids" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _device(module: nn.Module) -> torch.device:
    from compressed_tensors.offload import get_execution_device

    try:
        device = get_execution_device(module, torch.device("cpu"))
    except Exception:  # noqa: BLE001 - no parameters: run where the input is
        return torch.device("cpu")
    return device if isinstance(device, torch.device) else torch.device("cpu")


def prove_forward(
    model: nn.Module,
    arch: MoEArchitecture,
    block_inputs: Mapping[str, torch.Tensor] | None = None,
    sample_ids: torch.Tensor | None = None,
) -> str:
    """Run the pruned model: the whole model on ``sample_ids`` (or a few ids below the
    vocabulary size) when its forward takes ``input_ids``; otherwise each MoE block on
    its recorded calibration input, or on a few hidden states of its router's input
    width, which it must map to hidden states of the same size. Returns what ran.

    :raises Exception: whatever the forward raises
    """
    if _takes_token_ids(model):
        if sample_ids is None:
            vocab = int(getattr(arch.config, "vocab_size", 8) or 8)
            sample_ids = (torch.arange(8) % vocab).unsqueeze(0)
        device = next((p.device for p in model.parameters() if p.device.type != "meta"), None)
        model(input_ids=sample_ids[:1, :16].to(device or "cpu"), use_cache=False)
        return "the whole model on token ids"
    inputs = dict(block_inputs or {})
    gen = torch.Generator().manual_seed(0)
    for layer in arch.layers:
        if layer.name not in inputs:
            weight = router_weight_of(layer.router)
            inputs[layer.name] = torch.randn(
                1, SAMPLE_TOKENS, weight.shape[-1], generator=gen, dtype=torch.float32
            ).to(weight.dtype)
    _run_blocks(arch.layers, inputs)
    return "each pruned MoE block on hidden states"


def _run_blocks(layers: list[MoELayer], inputs: Mapping[str, torch.Tensor]) -> None:
    for layer in layers:
        x = inputs[layer.name]
        out = layer.block(x.to(_device(layer.router)))
        out = out[0] if isinstance(out, tuple) else out
        if not isinstance(out, torch.Tensor) or out.numel() != x.numel():
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise RuntimeError(f"{layer.name} returned {got} for hidden states {tuple(x.shape)}")


def check_whole(
    model: nn.Module,
    arch: MoEArchitecture,
    old_count: int,
    sample_ids: torch.Tensor | None = None,
    run_forward: bool = True,
    block_inputs: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Raise :class:`WholenessError` unless every pruned block is consistent with
    ``arch.num_experts`` experts and the forward proof (:func:`prove_forward`) runs.

    :param sample_ids: ``[1, T]`` token ids (a calibration sample) for a whole-model
        forward
    :param run_forward: skip the forward (packed compressed-tensors experts, whose
        forward would decompress the whole model; the checkpoint rewriter verifies)
    :param block_inputs: MoE block name -> a few of its calibration input's tokens
        (:func:`sample_rows`)
    """
    problems = leftovers(arch, old_count)
    if problems:
        raise WholenessError(
            f"{arch.model_class}: the pruned model is not whole, nothing was written. "
            f"{len(problems)} tensor(s), module(s) or count(s) of pruned MoE blocks were "
            f"not cut to {arch.num_experts} experts: "
            + "; ".join(problems[:8])
            + ". This family needs an adapter for these tensors (docs/architecture.md, "
            "'Adding a model family')."
        )
    if not run_forward:
        return
    try:
        with torch.no_grad():
            ran = prove_forward(model, arch, block_inputs, sample_ids)
    except Exception as exc:
        raise WholenessError(
            f"{arch.model_class}: the pruned model fails its first forward, nothing was "
            f"written: {type(exc).__name__}: {exc}"
        ) from exc
    logger.info(f"REAP: pruned model is whole ({len(arch.layers)} MoE layers; ran {ran})")
