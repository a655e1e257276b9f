"""The MXFP4 oracle: what exporting compressed-tensors MXFP4 experts to GGUF must give, from
the two formats' specs alone.

- compressed-tensors ``mxfp4-pack-quantized``: ``weight_packed`` uint8 ``[rows, cols/2]``,
  element ``2i`` in the low nibble of byte ``i`` and ``2i+1`` in the high one, each nibble an
  FP4 E2M1 code (sign bit 3, two exponent bits with bias 1, one mantissa bit);
  ``weight_scale`` uint8 ``[rows, cols/32]``, an E8M0 exponent: ``2**(e - 127)``.
- GGML ``block_mxfp4`` (ggml-common.h): per 32 elements, one E8M0 byte ``e`` then 16 bytes
  ``qs``; element ``j < 16`` is the low nibble of ``qs[j]``, element ``j + 16`` its high
  nibble; the value is ``kvalues_mxfp4[code] * 2**(e - 128)`` with ``kvalues_mxfp4 = {0, 1,
  2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12}`` (doubled values, halved scale); code
  8, E2M1's -0, is +0 there.

Also the float reference: a copy of the checkpoint with every MXFP4 weight dequantized to
f32 (the stock converter then writes the float expert tensors the repack must equal)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

#: ggml-common.h kvalues_mxfp4 (the E2M1 values doubled)
GGML_KVALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float64)
#: bytes of one GGML MXFP4 block (32 elements)
BLOCK_BYTES = 17


def e2m1(code: int) -> float:
    """The FP4 E2M1 value of a 4-bit code, from its bits."""
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    mag = man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1)
    return sign * mag


def ct_codes(packed: np.ndarray) -> np.ndarray:
    """``[rows, cols]`` 4-bit codes of a compressed-tensors ``weight_packed``."""
    packed = np.asarray(packed, np.uint8)
    codes = np.empty((packed.shape[0], packed.shape[1] * 2), np.uint8)
    codes[:, 0::2] = packed & 0x0F
    codes[:, 1::2] = packed >> 4
    return codes


def ct_values(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The f32 values of a compressed-tensors MXFP4 weight (exact: powers of two times E2M1)."""
    table = np.array([e2m1(c) for c in range(16)], np.float64)
    codes = ct_codes(packed)
    exps = np.repeat(np.asarray(scale, np.int64) - 127, 32, axis=1)
    return (table[codes] * np.exp2(exps.astype(np.float64))).astype(np.float32)


def ggml_blocks(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The GGML MXFP4 bytes ``[rows, cols/32 * 17]`` holding the same codes and exponents."""
    codes = ct_codes(packed)
    rows, cols = codes.shape
    out = np.empty((rows, cols // 32, BLOCK_BYTES), np.uint8)
    for b in range(cols // 32):
        block = codes[:, 32 * b : 32 * (b + 1)]
        out[:, b, 0] = np.asarray(scale, np.uint8)[:, b]
        for j in range(16):
            out[:, b, 1 + j] = block[:, j] | (block[:, j + 16] << 4)
    return out.reshape(rows, -1)


def ggml_values(raw: np.ndarray, cols: int) -> np.ndarray:
    """The f32 values ``[..., cols]`` of GGML MXFP4 bytes ``[..., cols/32 * 17]``."""
    raw = np.asarray(raw, np.uint8)
    lead = raw.shape[:-1]
    blocks = raw.reshape(-1, BLOCK_BYTES)
    e, qs = blocks[:, 0].astype(np.int64), blocks[:, 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # elements 0..15, then 16..31
    vals = GGML_KVALUES[codes] * np.exp2((e - 128).astype(np.float64))[:, None]
    return vals.astype(np.float32).reshape(*lead, cols)


def same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """``a`` and ``b`` hold the same f32 numbers, bit for bit but for the sign of zero (GGML
    decodes the E2M1 code of -0 as +0)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    nz = (a != 0) | (b != 0)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32)[nz], b.view(np.uint32)[nz])


def read_tensors(model: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (all shards)."""
    out = {}
    for f in sorted(model.glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})
    return out


def expert_weights(model: Path) -> dict[tuple[int, str, int], tuple[np.ndarray, np.ndarray]]:
    """``(layer, proj, expert) -> (weight_packed, weight_scale)`` of a checkpoint's routed
    experts (``model.layers.L.mlp.experts.E.<proj>.weight_packed``)."""
    out = {}
    tensors = read_tensors(model)
    for name, t in tensors.items():
        parts = name.split(".")
        if name.endswith(".weight_packed") and parts[-4] == "experts":
            layer, expert, proj = int(parts[2]), int(parts[-3]), parts[-2]
            scale = tensors[name.removesuffix("_packed") + "_scale"]
            out[layer, proj, expert] = (t.numpy(), scale.numpy())
    return out


def dequantized_copy(src: Path, dst: Path) -> Path:
    """``src`` with every MXFP4 weight written as its f32 values and no quantization_config:
    a plain checkpoint the stock converter takes."""
    dst.mkdir(parents=True)
    tensors = read_tensors(src)
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight_scale") and name.removesuffix("_scale") + "_packed" in tensors:
            continue
        if name.endswith(".weight_packed"):
            scale = tensors[name.removesuffix("_packed") + "_scale"].numpy()
            name, t = name.removesuffix("_packed"), torch.from_numpy(ct_values(t.numpy(), scale))
        out[name] = t.contiguous()
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json",):
            if not f.name.startswith("model.safetensors.index"):
                shutil.copy(f, dst / f.name)
    return dst
