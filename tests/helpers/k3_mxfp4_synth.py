"""Loadable Kimi-K3-shaped MXFP4 checkpoints of any size, written shard by shard.

``write_k3_mxfp4(out, K3Shape(...))`` enumerates the tensors of
``KimiK3ForConditionalGeneration`` on the meta device and writes them as a
compressed-tensors ``mxfp4-pack-quantized`` checkpoint: routed experts (``w1/w2/w3``)
as random E2M1 codes (``weight_packed`` uint8, two per byte) with E8M0 scales
(``weight_scale`` uint8) chosen so activations stay O(1); everything else bf16 with
the tiny-model initialisation. No dense model is ever built, so a checkpoint whose
dense size exceeds the machine's memory is written with one shard in memory.
Used by the packed-calibration memory test (tens of MB) and benchmark (GBs).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

EXPERT_WEIGHT = re.compile(r"^(?P<module>.+\.experts\.\d+\.(w1|w2|w3))\.weight$")
EXPERT_TARGET = r"re:.*\.experts\.\d+\.(w1|w2|w3)$"
#: E2M1 codes uniform over all 16 nibbles: E[v^2] = 68.5 / 8 -> std ~2.93
_E2M1_STD = math.sqrt(68.5 / 8)


@dataclass
class K3Shape:
    """A Kimi-K3-shaped latent MoE (sizes of the text model; the vision tower is tiny)."""

    hidden: int = 256
    latent: int = 128  # routed_expert_hidden_size
    inter: int = 128  # moe_intermediate_size
    experts: int = 64
    top_k: int = 8
    moe_layers: int = 2
    dense_layers: int = 1
    vocab: int = 512
    n_group: int = 4
    topk_group: int = 2

    def text_config(self) -> dict:
        heads = max(2, self.hidden // 64)
        return dict(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=2 * self.hidden,
            num_hidden_layers=self.dense_layers + self.moe_layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            moe_intermediate_size=self.inter,
            num_experts=self.experts,
            num_experts_per_token=self.top_k,
            num_shared_experts=1,
            routed_scaling_factor=2.5,
            first_k_dense_replace=self.dense_layers,
            num_expert_group=self.n_group,
            topk_group=self.topk_group,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            v_head_dim=16,
            routed_expert_hidden_size=self.latent,
            linear_attn_config=None,
            max_position_embeddings=4096,
            mla_use_nope=True,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )

    # sizes (bytes)
    def expert_params(self) -> int:
        return 3 * self.latent * self.inter

    def packed_expert_bytes(self) -> int:
        """weight_packed (1/2 byte per value) + weight_scale (1 byte per 32 values)."""
        return self.experts * self.moe_layers * self.expert_params() * 17 // 32

    def dense_expert_bytes(self) -> int:
        return self.experts * self.moe_layers * self.expert_params() * 2

    def dense_layer_expert_bytes(self) -> int:
        """One MoE layer's routed experts in bf16 (what per-layer dequantization holds)."""
        return self.experts * self.expert_params() * 2


def k3_config(shape: K3Shape):
    from llmcompressor.modeling.kimi_k3.configuration_kimi_k3 import KimiK3Config

    vision = dict(
        vt_num_attention_heads=2,
        vt_num_hidden_layers=1,
        vt_hidden_size=16,
        vt_intermediate_size=32,
        text_hidden_size=shape.hidden,
        mm_hidden_size=16,
        qkv_hidden_size=16,
        _attn_implementation="eager",
    )
    cfg = KimiK3Config(text_config=shape.text_config(), vision_config=vision)
    cfg.text_config._attn_implementation = "eager"
    return cfg


def _meta_state(config) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype]], list[str]]:
    """(name, shape, dtype) of every state-dict tensor, and the names of non-expert Linears."""
    from llmcompressor.modeling.kimi_k3.modeling_kimi_k3 import KimiK3ForConditionalGeneration

    with torch.device("meta"):
        model = KimiK3ForConditionalGeneration(config)
    entries = [(k, tuple(v.shape), v.dtype) for k, v in model.state_dict().items()]
    linears = [
        n
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and not re.match(r".*\.experts\.\d+\.(w1|w2|w3)$", n)
    ]
    return entries, linears


def _tensors(entries, gen: torch.Generator):
    """Yield (name, tensor) in state-dict order; experts packed, the rest bf16."""
    from tiny_models import _std_for

    for name, shape, dtype in entries:
        m = EXPERT_WEIGHT.match(name)
        if m:
            out_f, in_f = shape
            yield (
                f"{m['module']}.weight_packed",
                torch.randint(0, 256, (out_f, in_f // 2), dtype=torch.uint8, generator=gen),
            )
            # scale ~ 1 / (E2M1 std * sqrt(fan_in)) as a power of two, +-1 octave jitter
            exp = 127 - round(math.log2(_E2M1_STD * math.sqrt(in_f)))
            yield (
                f"{m['module']}.weight_scale",
                (exp + torch.randint(-1, 2, (out_f, in_f // 32), generator=gen)).to(torch.uint8),
            )
            continue
        probe = torch.empty(shape, device="meta")
        mean, std = _std_for(name, probe, "kimi_k3")
        t = torch.randn(shape, generator=gen) * std + mean
        yield name, t.to(torch.bfloat16 if dtype.is_floating_point else dtype)


def quantization_config(ignore: list[str]) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "format": "mxfp4-pack-quantized",
                "targets": [EXPERT_TARGET],
                "weights": {
                    "num_bits": 4,
                    "type": "float",
                    "strategy": "group",
                    "group_size": 32,
                    "symmetric": True,
                    "dynamic": False,
                    "scale_dtype": "torch.uint8",
                    "observer": "memoryless_minmax",
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ignore,
        "sparsity_config": {},
        "transform_config": {},
    }


def write_k3_mxfp4(
    out: str | os.PathLike, shape: K3Shape, *, shard_bytes: int = 512 << 20, seed: int = 0
) -> dict:
    """Write the checkpoint to ``out`` (one shard in memory at a time); returns its sizes."""
    from safetensors.torch import save_file

    from reap_modifier.models.loading import register_kimi_auto_classes

    register_kimi_auto_classes()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = k3_config(shape)
    entries, linears = _meta_state(config)
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, int] = {}
    written: list[str] = []
    current: dict[str, torch.Tensor] = {}
    size = total = packed = 0

    def flush():
        name = f"model-{len(written) + 1:05d}.safetensors"
        save_file(current, str(out / name), metadata={"format": "pt"})
        written.append(name)

    for name, t in _tensors(entries, gen):
        if current and size + t.nbytes > shard_bytes:
            flush()
            current, size = {}, 0
        current[name] = t
        weight_map[name] = len(written)
        size += t.nbytes
        total += t.nbytes
        if name.endswith(("weight_packed", "weight_scale")):
            packed += t.nbytes
    flush()
    n = len(written)
    final = []
    for i, old in enumerate(written):
        new = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(out / old, out / new)
        final.append(new)
    index = {
        "metadata": {"total_size": total},
        "weight_map": {k: final[v] for k, v in weight_map.items()},
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(linears)
    cfg["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    info = {
        "path": str(out),
        "shape": asdict(shape),
        "files": final,
        "checkpoint_bytes": total,
        "packed_expert_bytes": packed,
        "other_bytes": total - packed,
        "dense_expert_bytes": shape.dense_expert_bytes(),
        "dense_layer_expert_bytes": shape.dense_layer_expert_bytes(),
        "dense_checkpoint_bytes": total - packed + shape.dense_expert_bytes(),
    }
    (out / "synthetic.json").write_text(json.dumps(info, indent=2))
    return info
