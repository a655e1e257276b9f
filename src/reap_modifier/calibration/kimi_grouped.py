"""Grouped routed dispatch for Kimi blocks during REAP calibration.

llm-compressor's ``KimiSparseMoeBlock.moe_infer`` copies the per-expert token counts
to the host and then calls every expert that received tokens, one small matmul chain
each (896 experts for Kimi K3). During REAP's routed calibration
(``moe_calibrate_all_experts`` off) this module computes the same thing with stacked
expert weights and ``grouped_mm`` (``torch.nn.functional.grouped_mm``, else
``torch._grouped_mm``): tokens sorted by expert on the device, offsets from an
on-device count, two grouped matmuls per layer (gate|up, then down), no host sync.
The per-(token, slot) outputs it produces are the ones the observer takes its norms
from, so REAP's statistics need no expert hook and no extra pass.

Where grouped_mm cannot run (float64, a GPU older than sm80, a size grouped_mm does not
align) or the experts are not plain dense ``Linear`` modules computing ``F.linear``
(packed MXFP4 experts, fake-quantization, accelerate hooks, another modifier's hooks on
them; compressed-tensors' offloading wrapper is accepted), the dispatch is the
sorted-segment loop: one host copy of the counts per layer, then each expert's own
forward on its segment (``moe_infer``'s own arithmetic).

The stacked weights are one extra copy of one layer's routed experts on their device,
built on the layer's first calibration batch and kept for the next batches of that
layer (the sequential pipeline calls one layer for every batch before the next); a
call for another layer drops them. On CUDA, when the device does not have the free
memory for the copy, the layer uses the loop.

Combination into the block's output is ``moe_infer``'s own formula (slot outputs times
gate weights in the gate dtype, summed over slots, cast back).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from loguru import logger
from torch import nn

__all__ = [
    "KimiExpertStack",
    "GroupedKimiDispatch",
    "combine_slots",
    "grouped_mm_supported",
    "routed_slot_outputs",
    "stack_kimi_experts",
]

_PROJECTIONS = ("w1", "w2", "w3")


def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    fn = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return fn(x, weight, offs=offs)


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, *dims: int) -> bool:
    """Whether torch's grouped_mm runs ``[S, d_in] x [E, d_in, d_out]`` for these
    matrix dimensions on ``device`` in ``dtype``: CUDA sm80+ in bf16, or the CPU kernel
    (torch >= 2.9) in bf16 / fp16 / fp32; every row 16-byte aligned."""
    if not (hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return False
    size = torch.empty((), dtype=dtype).element_size()
    if any(d * size % 16 for d in dims):
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 0)
    if device.type == "cpu":
        return dtype in (torch.bfloat16, torch.float16, torch.float32)
    return False


@dataclass
class KimiExpertStack:
    """One layer's routed expert weights stacked for grouped_mm.

    ``gate_up``: ``[E, 2I, D]`` (each expert's ``w1`` rows, then ``w3``'s);
    ``down``: ``[E, D, I]``; both used transposed (``[E, in, out]``).
    """

    gate_up: torch.Tensor
    down: torch.Tensor
    key: tuple

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes


def _qdq_is_identity(module: nn.Module) -> bool:
    """compressed-tensors' ``quantized_forward`` of ``module`` computes exactly
    ``F.linear(x, weight)``: quantization disabled, or no input / output activation
    quantization and no weight fake-quantization (none, or a compressed / decompressed
    module, whose weights are used as they are)."""
    from compressed_tensors.quantization import QuantizationStatus

    scheme = getattr(module, "quantization_scheme", None)
    status = getattr(module, "quantization_status", None)
    if not getattr(module, "quantization_enabled", True) or scheme is None or status is None:
        return True
    if scheme.input_activations or scheme.output_activations:
        return False
    return not scheme.weights or status >= QuantizationStatus.COMPRESSED


def _own_forward(module: nn.Module) -> bool:
    """The module's forward computes its class's forward: not replaced, or wrapped only
    by compressed-tensors' offloading (moves inputs to the weights' device) and by its
    ``quantized_forward`` where that does no quantization; no accelerate hook."""
    if hasattr(module, "_hf_hook"):
        return False
    bound = module.__dict__.get("forward")
    if bound is None:
        return True
    fn = getattr(bound, "__func__", None)
    while fn is not None and fn is not type(module).forward:
        code = getattr(fn, "__code__", None)
        where = (code.co_filename.replace("\\", "/"), code.co_name) if code else ("", "")
        offload = where[0].endswith("compressed_tensors/offload/module.py")
        qdq = where[0].endswith("quantization/lifecycle/forward.py") and (
            where[1] == "quantized_forward" and _qdq_is_identity(module)
        )
        if not (offload or qdq):
            return False
        fn = getattr(fn, "__wrapped__", None)
    return fn is not None


def _plain_linear(module) -> bool:
    """A dense ``nn.Linear`` without bias whose forward is ``F.linear(x, weight)``:
    no hooks, no replaced forward (packed modules have no ``weight``)."""
    if type(module) is not nn.Linear or module.bias is not None:
        return False
    if module._forward_hooks or module._forward_pre_hooks or not _own_forward(module):
        return False
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.device.type != "meta"


def _quick_key(experts: nn.ModuleList) -> tuple:
    """A cheap identity of a layer's experts, checked on every call (no weight access:
    offloaded weights would be fetched)."""
    return (id(experts), len(experts))


def _eligible(experts: nn.ModuleList) -> bool:
    """``KimiBlockSparseMLP`` experts of plain dense ``Linear`` projections, with nothing
    hooked on them but the observer's own one forward hook per expert."""
    for expert in experts:
        if (
            type(expert).__name__ != "KimiBlockSparseMLP"
            or not _own_forward(expert)
            or expert._forward_pre_hooks
            or len(expert._forward_hooks) > 1
        ):
            return False
        if not all(_plain_linear(getattr(expert, name, None)) for name in _PROJECTIONS):
            return False
    return True


def stack_kimi_experts(experts: nn.ModuleList) -> KimiExpertStack | None:
    """Stack a Kimi block's routed experts (``w1``/``w3``/``w2``) for grouped_mm; None
    when they are not plain dense ``Linear`` experts or grouped_mm cannot run them."""
    if len(experts) == 0 or not _eligible(experts):
        return None
    w1 = experts[0].w1.weight
    inter, hidden = w1.shape
    if any(e.w1.weight.dtype != w1.dtype or e.w1.weight.device != w1.device for e in experts):
        return None
    if not grouped_mm_supported(w1.device, w1.dtype, hidden, inter, 2 * inter):
        return None
    need = 3 * len(experts) * w1.numel() * w1.element_size()
    if w1.device.type == "cuda" and torch.cuda.mem_get_info(w1.device)[0] < 1.1 * need:
        logger.info(
            f"REAP: {need / 2**30:.1f} GiB of stacked experts do not fit on {w1.device}; "
            "this layer's calibration uses the per-expert loop"
        )
        return None
    with torch.no_grad():
        gate_up = torch.stack([torch.cat([e.w1.weight, e.w3.weight]) for e in experts])
        down = torch.stack([e.w2.weight for e in experts])
    return KimiExpertStack(gate_up, down, _quick_key(experts))


def _activate(block: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """``KimiBlockSparseMLP``'s activation on ``[gate | up]``: SiTU takes the
    concatenation, the others ``act(gate) * up``."""
    act = block.experts[0].act_fn
    if block.config.hidden_act == "situ":
        return act(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


@torch.no_grad()
def routed_slot_outputs(
    block: nn.Module, x: torch.Tensor, ids: torch.Tensor, stack: KimiExpertStack | None
) -> torch.Tensor:
    """Every routed expert's output for every (token, slot): ``[N, k, D]``, row ``(t, s)``
    = ``experts[ids[t, s]](x[t])``.

    With ``stack``: grouped_mm over tokens sorted by expert, no host sync. Without: the
    sorted-segment loop over each expert's own forward (one host copy of the counts).
    """
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    sorted_x = x[order // k]
    num_experts = len(block.experts)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    if stack is not None:
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        hidden = _activate(block, _grouped_mm(sorted_x, stack.gate_up.transpose(-2, -1), offs))
        sorted_out = _grouped_mm(hidden, stack.down.transpose(-2, -1), offs)
    else:
        pieces, start = [], 0
        for expert_id, count in enumerate(counts.tolist()):
            if count:
                pieces.append(block.experts[expert_id](sorted_x[start : start + count]))
                start += count
        sorted_out = torch.cat(pieces) if pieces else sorted_x.new_empty(0, x.shape[-1])
    out = torch.empty_like(sorted_out)
    out[order] = sorted_out
    return out.view(n, k, -1)


def combine_slots(slot_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``moe_infer``'s combination: ``sum_s g[t, s] * out[t, s]`` in the gate dtype,
    cast back to the outputs' dtype."""
    return slot_out.type(weights.dtype).mul(weights.unsqueeze(-1)).sum(dim=1).type(slot_out.dtype)


class GroupedKimiDispatch:
    """Replaces ``moe_infer`` of the given Kimi blocks while installed.

    :param slot_sink: ``(layer name) -> callback or None``; a callback receives the
        ``[N, k, D]`` slot outputs of a routed calibration forward of that layer. When
        it returns None (no calibration batch pending: hooks disabled, a propagation
        pass) the block runs its own ``moe_infer``.
    """

    def __init__(self, slot_sink: Callable[[str], Callable[[torch.Tensor], None] | None]):
        self._sink = slot_sink
        self._blocks: dict[str, nn.Module] = {}
        self._stack: tuple[str, KimiExpertStack | None] | None = None

    def install(self, name: str, block: nn.Module) -> None:
        """Replace ``block.moe_infer`` (an earlier observer's replacement left behind by an
        interrupted calibration included)."""
        block.moe_infer = partial(self._moe_infer, name, block)
        self._blocks[name] = block

    def remove(self) -> None:
        for block in self._blocks.values():
            block.__dict__.pop("moe_infer", None)
        self._blocks.clear()
        self.drop_stack()

    def drop_stack(self) -> None:
        self._stack = None

    def _stack_for(self, name: str, block: nn.Module) -> KimiExpertStack | None:
        if self._stack is not None and self._stack[0] == name:
            stack = self._stack[1]
            if stack is None or _quick_key(block.experts) == stack.key:
                return stack
        self._stack = None  # free the previous layer's copy before building one
        self._stack = (name, stack_kimi_experts(block.experts))
        return self._stack[1]

    def _moe_infer(self, name: str, block: nn.Module, x, topk_ids, topk_weight):
        sink = self._sink(name)
        if sink is None:
            return type(block).moe_infer(block, x, topk_ids, topk_weight)
        stack = self._stack_for(name, block)
        if stack is not None and (stack.down.device, stack.down.dtype) != (x.device, x.dtype):
            stack = None
        slot_out = routed_slot_outputs(block, x, topk_ids, stack)
        sink(slot_out)
        return combine_slots(slot_out, topk_weight)
