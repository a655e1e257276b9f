"""Loading a checkpoint directory as a transformers model (the main job's and the vLLM
check's loader), and Kimi K3's transformers auto classes."""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["load_checkpoint_model", "register_kimi_auto_classes"]


def register_kimi_auto_classes() -> None:
    """Why: ``oneshot`` re-reads the config through ``AutoConfig``; Kimi K3's
    ``kimi_k3`` model type is not registered with transformers (and transformers' own
    ``kimi_linear`` is a different architecture), so register llm-compressor's classes.
    """
    from llmcompressor.modeling.kimi_k3.configuration_kimi_k3 import KimiK3Config
    from llmcompressor.modeling.kimi_k3.modeling_kimi_k3 import (
        KimiK3ForConditionalGeneration,
    )
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    for auto in (AutoConfig,):
        try:
            auto.register("kimi_k3", KimiK3Config, exist_ok=True)
        except TypeError:  # older signature
            auto.register("kimi_k3", KimiK3Config)
    for auto in (AutoModel, AutoModelForCausalLM):
        try:
            auto.register(KimiK3Config, KimiK3ForConditionalGeneration, exist_ok=True)
        except ValueError:
            pass


def load_checkpoint_model(
    path: str | os.PathLike,
    *,
    dtype: str = "auto",
    packed: bool = False,
    device_map: str | dict | None = None,
):
    """A checkpoint directory through transformers' ``AutoModelForCausalLM`` (Kimi K3 via
    llm-compressor's class), eval mode, floating weights in ``dtype`` (``"auto"``: the
    config's), placed by ``device_map`` (``from_pretrained``'s: ``None`` the CPU, ``"auto"``
    spread over the GPUs, ``{"": "cuda:1"}`` one GPU). compressed-tensors checkpoints are
    decompressed on load, or with ``packed`` keep ``weight_packed`` / ``weight_scale`` as stored.

    Why: compressed-tensors 0.19 dequantizes to bf16 whatever ``from_pretrained``'s dtype,
    so a float32 load leaves bf16 experts in a float32 model, whose first forward fails.
    A compressed checkpoint is therefore loaded in bf16 and then cast; ``Module.to(dtype)``
    casts floating tensors only, so packed uint8 stays as stored.
    """
    import torch
    from transformers import AutoModelForCausalLM

    cfg = json.loads((Path(path) / "config.json").read_text())
    if cfg.get("model_type") == "kimi_k3":
        register_kimi_auto_classes()
    target = "auto" if dtype == "auto" else getattr(torch, dtype)
    if (cfg.get("quantization_config") or {}).get("quant_method") != "compressed-tensors":
        return AutoModelForCausalLM.from_pretrained(
            str(path), dtype=target, device_map=device_map
        ).eval()
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(path),
        dtype=torch.bfloat16,
        device_map=device_map,
        quantization_config=CompressedTensorsConfig(dequantize=not packed),
    ).eval()
    if target == "auto":
        target = getattr(torch, cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
    return model.to(target)
