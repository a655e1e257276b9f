"""The modifier's save path for models loaded from a compressed checkpoint.

After any forward pass the in-memory model is decompressed; llm-compressor's save
would re-compress it (turning -0 nibbles into +0), and ``oneshot(model=<path>)``
loads with ``dequantize=True`` and would save bf16 experts. So when the model came
from a compressed-tensors checkpoint directory and every modifier in the recipe is a
REAP modifier (nothing else changed weights), ``save_pretrained`` on the model is
routed through the checkpoint rewriter: the output is written from the *source bytes*
with the plan applied, stays in the source format (e.g. ``mxfp4-pack-quantized``), and
kept experts are bit-identical.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from loguru import logger
from torch import nn

from ..models.moe_fields import config_sections
from ..scores.plan import PruningPlan

__all__ = ["compressed_source", "route_save_through_rewriter", "saved_dtypes"]


def compressed_source(model: nn.Module) -> Path | None:
    """The directory the model was loaded from, when it is a compressed-tensors checkpoint."""
    name = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", "")
    if not name or not os.path.isdir(name):
        return None
    config_path = Path(name) / "config.json"
    if not config_path.is_file():
        return None
    config = json.loads(config_path.read_text())
    for _, holder in config_sections(config):
        qc = holder.get("quantization_config") or holder.get("compression_config")
        if isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors":
            if qc.get("format") not in (None, "dense"):
                return Path(name)
    return None


def saved_dtypes(model: nn.Module) -> Callable[[str, str], torch.dtype | None] | None:
    """For a model the rewrite will save (loaded from a compressed checkpoint), the dtype
    each fitted block tensor is written in, the source tensor's: ``(MoE layer name, name in
    the block) -> dtype`` (``None``: not a tensor of the source). ``None`` for any other
    model: its tensors are saved as they are in memory."""
    from .binding import resolve_block
    from .layout import inspect_checkpoint
    from .replaced_tensors import TORCH_DTYPES

    source = compressed_source(model)
    if source is None:
        return None
    layout = inspect_checkpoint(source)

    def dtype_of(layer: str, name: str) -> torch.dtype | None:
        try:
            full = f"{resolve_block(layer, layout.blocks)}.{name}"
        except Exception:  # noqa: BLE001 - a layer the checkpoint does not name
            return None
        if full not in layout.weight_map:
            return None
        return TORCH_DTYPES.get(layout.entry(full).dtype)

    return dtype_of


def route_save_through_rewriter(
    model: nn.Module,
    plan: PruningPlan,
    source: Path,
    *,
    other_modifiers: list[str],
    router_fit: tuple[dict, dict] | None = None,
) -> bool:
    """Make ``model.save_pretrained(dst)`` write ``dst`` with the rewriter.

    :param other_modifiers: names of non-REAP modifiers in the recipe; when any is
        present their weight changes live only in memory, so the regular (re-compressing)
        save is kept and the reason is logged
    :param router_fit: ``(record, tensors)`` of router calibration: the fitted router
        tensors (``{layer: {relative name: tensor}}``) are written from memory, every
        other tensor from the source bytes, and the record goes into the manifest
    :returns: whether the save was routed through the rewriter
    """
    if other_modifiers:
        logger.warning(
            f"REAP: the recipe also runs {', '.join(other_modifiers)}, which change weights "
            "in memory: saving through llm-compressor's compressed save (re-compressed), "
            f"NOT the bit-exact rewrite of {source}"
        )
        return False

    def save_pretrained(save_directory, *args, **kwargs):
        from compressed_tensors.distributed import is_source_process

        from .rewrite import prepare_rewrite

        if not is_source_process():  # one writer, as llm-compressor's own save
            return

        logger.info(
            f"REAP: writing {save_directory} by the bit-exact checkpoint rewrite of "
            f"{source} (kept experts copied verbatim, format unchanged)"
        )
        prepare_rewrite(
            source,
            plan,
            save_directory,
            force=True,  # like save_pretrained: the caller chose this directory
            method="REAP modifier (oneshot) -> bit-exact checkpoint rewrite",
            manifest_extra={
                "saliency": plan.saliency,
                "plan_parameters": plan.params,
                **({"router_fit": router_fit[0]} if router_fit else {}),
            },
            replace_tensors=router_fit[1] if router_fit else None,
            replace_reason=_fit_reason(router_fit[0]) if router_fit else "",
        ).run()

    save_pretrained._reap_rewriter = True
    model.save_pretrained = save_pretrained
    logger.info(
        f"REAP: model was loaded from the compressed checkpoint {source}; save_pretrained "
        "will rewrite it from the source bytes"
    )
    return True


def _fit_reason(record: dict) -> str:
    """Why fitted tensors differ from the source: the kept post-cut components."""
    kept = [c["name"] for c in record.get("components", []) if c.get("kept")] or ["router"]
    return f"{' + '.join(kept)} fitted after the cut (see router_fit)"
