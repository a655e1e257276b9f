"""Calibration on packed experts: dequantize one MoE layer (or one expert) at a time.

A model loaded from a compressed-tensors checkpoint without dequantization keeps each
compressed ``Linear`` as its packed parameters (MXFP4: ``weight_packed`` uint8 and
``weight_scale`` E8M0) with no ``weight``. :class:`PackedCompute` lets such a model
run forward passes without ever holding more than one MoE layer's experts dense:

- ``granularity="layer"``: an expert projection is dequantized on its first call and
  kept while its MoE layer is being computed; the first call of another layer's
  expert drops them. llm-compressor's sequential pipeline calls one decoder layer for
  every batch (calibration pass, then propagation pass) before moving to the next,
  so each expert that receives tokens is dequantized once per pass, and at most one
  MoE layer's experts are dense at any time;
- ``granularity="expert"``: each expert projection is dequantized when it is called
  and dropped when it returns (smallest memory, one dequantization per call).

Compressed modules outside routed experts (rare: e.g. a checkpoint quantizing
attention too) are dequantized when the overlay attaches and kept until it detaches.

The arithmetic is compressed-tensors' own: the module's compressor (looked up from its
``quantization_scheme.format``) ``decompress``-es the module's own parameters, exactly
what ``decompress_module`` (and so the whole-model decompression) does, so forward
passes are bit-identical to those of the fully decompressed model. The dense weight
is a plain attribute of the module, never a registered parameter: it does not enter
the state dict, and compressed-tensors' offload caches (CPU / disk) never see it.
Detaching removes every dense weight: the model is back to its packed state.
"""

from __future__ import annotations

import ctypes
import functools
import re
from dataclasses import dataclass
from typing import Literal

import torch
from loguru import logger
from torch import nn

from ..models.moe_fields import config_sections
from .decompress_hook import pause_decompress_hook

__all__ = [
    "Granularity",
    "PackedCompute",
    "PackedFormatError",
    "compressed_modules",
    "check_checkpoint_formats",
    "check_module_formats",
]

Granularity = Literal["layer", "expert"]

#: ``<...>.experts.<id>[.<proj>]``: a routed expert (K3 ``w1/w2/w3``, linearized
#: ``gate_proj/up_proj/down_proj``); the unit is the ``experts`` container
_EXPERT_NAME = re.compile(r"^(?P<container>.+\.experts)\.\d+(\..+)?$")


def _fallback(formats: list[str]) -> str:
    names = ", ".join(repr(f) for f in formats)
    return (
        "Fallback: calibrate a dense (bf16) copy of the checkpoint, decompressed with a tool "
        f"that reads {names} (the sparse formats were dropped after compressed-tensors "
        "0.14); `dequantize: model` does not help, it decompresses with the same "
        "per-module decompressors"
    )


class PackedFormatError(ValueError):
    """Compressed modules in a format compressed-tensors cannot decompress per module."""


def _status_compressed(module: nn.Module) -> bool:
    from compressed_tensors.quantization import QuantizationScheme, QuantizationStatus

    return isinstance(getattr(module, "quantization_scheme", None), QuantizationScheme) and (
        getattr(module, "quantization_status", None) == QuantizationStatus.COMPRESSED
    )


def compressed_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Modules of ``model`` that hold compressed (packed) parameters, by name."""
    return {name: m for name, m in model.named_modules() if _status_compressed(m)}


def _compressor_for_format(fmt: str | None):
    """compressed-tensors' compressor class for ``fmt`` when it decompresses one
    module's state dict (the classmethod ``decompress``), else None."""
    from compressed_tensors.compressors import BaseCompressor

    if fmt is None:
        return None
    try:
        cls = BaseCompressor.get_value_from_registry(str(getattr(fmt, "value", fmt)))
    except (KeyError, ValueError):
        return None
    decompress = getattr(cls, "decompress", None)
    if getattr(decompress, "__func__", None) in (None, BaseCompressor.decompress.__func__):
        return None
    return cls


def _module_format(module: nn.Module) -> str:
    from compressed_tensors.compressors.format import infer_module_format

    scheme = module.quantization_scheme
    fmt = scheme.format
    if fmt is None:
        try:
            fmt = infer_module_format(type(module), scheme)
        except StopIteration:
            return "unknown"
    return str(getattr(fmt, "value", fmt))


def _refuse(bad: dict[str, list[str]], where: str) -> None:
    if not bad:
        return
    parts = [
        f"{fmt!r} (in {names[0]}" + (f" and {len(names) - 1} more" if len(names) > 1 else "") + ")"
        for fmt, names in sorted(bad.items())
    ]
    from compressed_tensors import __version__ as ct_version

    raise PackedFormatError(
        f"REAP: {where} holds compressed-tensors format {', '.join(parts)}, for which "
        f"compressed-tensors {ct_version} registers no per-module decompressor: "
        f"calibration on packed experts cannot compute it. {_fallback(sorted(bad))}."
    )


def check_checkpoint_formats(config: dict) -> None:
    """Refuse a compressed-tensors ``config.json`` (dict) naming a format without a
    per-module decompressor, before anything is loaded.

    :raises PackedFormatError: naming the format and the fallback
    """
    bad: dict[str, list[str]] = {}
    for _, holder in config_sections(config):
        qc = holder.get("quantization_config") or holder.get("compression_config")
        if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
            continue
        for name, group in (qc.get("config_groups") or {}).items():
            fmt = (group or {}).get("format") or qc.get("format")
            if fmt in (None, "dense", "mixed-precision"):
                continue  # per-group formats decide; dense needs nothing
            if _compressor_for_format(fmt) is None:
                bad.setdefault(fmt, []).append(f"config group {name}")
        fmt = qc.get("format")
        if fmt not in (None, "dense", "mixed-precision") and _compressor_for_format(fmt) is None:
            bad.setdefault(fmt, []).append("quantization_config.format")
    _refuse(bad, "the checkpoint")


def check_module_formats(modules: dict[str, nn.Module]) -> dict[nn.Module, type]:
    """Each compressed module's compressor; refuses formats without a per-module
    decompressor.

    :raises PackedFormatError: naming the format(s), modules and the fallback
    """
    bad: dict[str, list[str]] = {}
    found: dict[nn.Module, type] = {}
    for name, module in modules.items():
        fmt = _module_format(module)
        compressor = _compressor_for_format(fmt)
        if compressor is None:
            bad.setdefault(fmt, []).append(name)
        else:
            found[module] = compressor
    _refuse(bad, "the model")
    return found


@dataclass
class PackedStats:
    """What the overlay did, for logs and tests."""

    dequantized_modules: int = 0  # module dequantizations (a module can count many times)
    layers_entered: int = 0  # "layer": how often the dense layer changed
    dense_now: int = 0  # dense expert weights alive right now
    peak_dense: int = 0  # most dense expert weights alive at once
    dense_bytes: int = 0
    peak_dense_bytes: int = 0


def return_freed_memory() -> None:
    """Hand the heap memory that released dense weights and their dequantization
    temporaries leave free back to the operating system (glibc only; elsewhere a no-op).

    Why: glibc keeps freed heap memory for reuse, and past its first frees it serves
    allocations of a dense expert weight's size from the heap rather than ``mmap``; a
    layer's weights and temporaries then leave holes that the next layer's do not fill,
    and peak RSS grew by more than one dense MoE layer over a calibration (measured in
    docs/packed-calibration.md). ``malloc_trim(0)`` at each MoE layer switch and at the
    end returns those pages.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def _dtype(args: tuple) -> torch.dtype | None:
    """The dtype a linear is called with (its first positional input)."""
    return args[0].dtype if args and isinstance(args[0], torch.Tensor) else None


class PackedCompute:
    """Forward passes on a packed compressed-tensors model, one MoE layer (or one expert)
    dense at a time. See the module docstring.

    :param model: model whose compressed modules are still packed (``from_pretrained``
        without ``dequantize=True``)
    :param granularity: ``"layer"`` or ``"expert"``
    :raises PackedFormatError: a compressed module's format has no per-module
        decompressor in compressed-tensors
    """

    def __init__(self, model: nn.Module, granularity: Granularity = "layer"):
        if granularity not in ("layer", "expert"):
            raise ValueError(f"granularity must be 'layer' or 'expert', got {granularity!r}")
        self.model = model
        self.granularity = granularity
        self.stats = PackedStats()
        modules = compressed_modules(model)
        self._compressor = check_module_formats(modules)
        self.formats = sorted({_module_format(m) for m in modules.values()})
        #: expert module -> its MoE layer (the name of its ``experts`` container)
        self._layer_of: dict[nn.Module, str] = {}
        self.resident: list[tuple[str, nn.Module]] = []
        for name, module in modules.items():
            match = _EXPERT_NAME.match(name)
            if match:
                self._layer_of[module] = match["container"]
            else:
                self.resident.append((name, module))
        self.layers = sorted(set(self._layer_of.values()))
        self._dense: dict[nn.Module, int] = {}  # module -> bytes of its dense weight
        self._current: str | None = None
        self._handles: list = []
        self._resume_decompress = None
        self.attached = False
        embed = getattr(model, "get_input_embeddings", lambda: None)()
        #: dtype of dense weights dequantized outside a forward call (resident modules)
        self._compute_dtype: torch.dtype | None = getattr(
            getattr(embed, "weight", None), "dtype", None
        )

    @property
    def num_expert_modules(self) -> int:
        return len(self._layer_of)

    def _materialise(
        self, module: nn.Module, *, expert: bool = True, dtype: torch.dtype | None = None
    ) -> None:
        if module in self._dense:
            return
        from compressed_tensors.utils import get_direct_state_dict

        scheme = module.quantization_scheme
        dense = self._compressor[module].decompress(get_direct_state_dict(module), scheme)["weight"]
        # compressed-tensors dequantizes to bf16 whatever the model's dtype; a model cast to
        # float32 after loading calls its linears with float32 inputs (values are exact either way)
        dtype = dtype or self._compute_dtype
        if dtype is not None and dtype.is_floating_point and dense.dtype != dtype:
            dense = dense.to(dtype)
        # a plain attribute, not a Parameter: offload caches and state dicts never see it
        object.__setattr__(module, "weight", dense)
        nbytes = dense.numel() * dense.element_size()
        self._dense[module] = nbytes
        self.stats.dequantized_modules += 1
        if expert:
            self.stats.dense_now += 1
            self.stats.dense_bytes += nbytes
            self.stats.peak_dense = max(self.stats.peak_dense, self.stats.dense_now)
            self.stats.peak_dense_bytes = max(self.stats.peak_dense_bytes, self.stats.dense_bytes)

    def _release(self, module: nn.Module, *, expert: bool = True) -> None:
        nbytes = self._dense.pop(module, None)
        if nbytes is None:
            return
        module.__dict__.pop("weight", None)
        if expert:
            self.stats.dense_now -= 1
            self.stats.dense_bytes -= nbytes

    def _release_experts(self) -> None:
        for module in [m for m in self._dense if m in self._layer_of]:
            self._release(module)
        return_freed_memory()

    def _enter_layer(self, module: nn.Module) -> None:
        """An expert of another MoE layer: drop the current layer's dense weights (none
        are alive in ``expert`` mode) and hand the freed memory back."""
        layer = self._layer_of[module]
        if layer != self._current:
            self._release_experts()
            self._current = layer
            self.stats.layers_entered += 1

    def _before_expert(self, module: nn.Module, dtype: torch.dtype | None = None) -> None:
        """An expert of another MoE layer drops the current layer's dense weights; the
        expert is dequantized unless it already is: ``layer`` keeps it until then (so
        experts that get no tokens are never dequantized), ``expert`` releases it when
        the call returns."""
        self._enter_layer(module)
        self._materialise(module, dtype=dtype)

    # -- hooks ------------------------------------------------------------------------

    def attach(self) -> None:
        """Pause compressed-tensors' whole-model decompression, dequantize resident
        (non-expert) compressed modules, and hook the experts."""
        if self.attached:
            return
        self._resume_decompress = pause_decompress_hook(self.model)
        for _, module in self.resident:
            self._materialise(module, expert=False)
        for module in self._layer_of:
            pre = module.register_forward_pre_hook(
                lambda mod, args: self._before_expert(mod, _dtype(args))
            )
            self._handles.append(pre)
            if self.granularity == "expert":
                post = module.register_forward_hook(lambda mod, args, out: self._release(mod))
                self._handles.append(post)
        self.attached = True
        logger.info(
            f"REAP: calibrating on packed experts ({', '.join(self.formats)}): "
            f"{self.num_expert_modules} expert modules in {len(self.layers)} MoE layers stay "
            f"packed, dequantized one {self.granularity} at a time with compressed-tensors' "
            f"decompressor; {len(self.resident)} other compressed modules dequantized up front"
        )

    def detach(self) -> None:
        """Remove the hooks and every dense weight; resume compressed-tensors'
        decompress-on-first-forward for later use of the model."""
        if not self.attached:
            return
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for _, module in self.resident:
            self._release(module, expert=False)
        self._release_experts()  # and the freed memory back
        self._current = None
        if self._resume_decompress is not None:
            self._resume_decompress()
            self._resume_decompress = None
        self.attached = False
        logger.info(
            f"REAP: packed calibration done: {self.stats.dequantized_modules} module "
            f"dequantizations, at most {self.stats.peak_dense} dense expert weights "
            f"({self.stats.peak_dense_bytes / 2**20:.1f} MiB) alive at once"
        )

    def __enter__(self) -> PackedCompute:
        self.attach()
        return self

    def __exit__(self, *exc) -> None:
        self.detach()
