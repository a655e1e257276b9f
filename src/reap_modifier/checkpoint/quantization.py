"""A checkpoint's quantization config: its sections (``quantization_config``,
``compression_config``, top level or nested) and the check that packed weights and their
scales agree with it. Headers only."""

from __future__ import annotations

from collections.abc import Mapping

from ..models.moe_fields import config_sections
from .safetensors_header import _ST_DTYPE_BYTES, TensorEntry

__all__ = ["QUANT_CONFIG_KEYS", "check_packed_scales", "quant_configs"]

QUANT_CONFIG_KEYS = ("quantization_config", "compression_config")


def quant_configs(config: dict) -> list[dict]:
    out = []
    for _, container in config_sections(config):
        for key in QUANT_CONFIG_KEYS:
            if isinstance(container.get(key), dict):
                out.append(container[key])
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
