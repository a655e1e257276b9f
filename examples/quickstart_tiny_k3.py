"""Quickstart: REAP-prune a tiny random Kimi-K3-architecture model with oneshot.

Builds the model from a config (no downloads), saves it, calibrates on random token
ids, prunes 50% of the routed experts, saves, reloads the result and checks the
expert count. Runs in about ten seconds on a laptop CPU.

    .venv/bin/python examples/quickstart_tiny_k3.py [OUT_DIR]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modeling.kimi_k3.configuration_kimi_k3 import KimiK3Config
from llmcompressor.modeling.kimi_k3.modeling_kimi_k3 import KimiK3ForConditionalGeneration
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import reap_modifier  # noqa: F401  registers REAPPruningModifier and the kimi_k3 auto classes
from reap_modifier.models.moe_fields import moe_fields

VOCAB = 256


def tiny_k3() -> KimiK3ForConditionalGeneration:
    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        moe_intermediate_size=32,
        num_experts=32,
        num_experts_per_token=4,
        num_shared_experts=1,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        routed_expert_hidden_size=32,
        linear_attn_config=None,
        mla_use_nope=True,
        max_position_embeddings=512,
    )
    vision = dict(
        vt_num_attention_heads=2,
        vt_num_hidden_layers=1,
        vt_hidden_size=16,
        vt_intermediate_size=32,
        text_hidden_size=64,
        mm_hidden_size=16,
        qkv_hidden_size=16,
        _attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = KimiK3ForConditionalGeneration(KimiK3Config(text_config=text, vision_config=vision))
    with torch.no_grad():  # K3's _init_weights is a no-op: initialise explicitly
        for name, p in model.named_parameters():
            p.normal_(0, 0.02 if "e_score_correction_bias" in name else 0.1)
    return model.eval()


def word_tokenizer() -> PreTrainedTokenizerFast:
    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", pad_token="t0")


def main(out: Path) -> None:
    src, dst = out / "tiny-k3", out / "tiny-k3-reap50"
    tiny_k3().save_pretrained(src)
    model = KimiK3ForConditionalGeneration.from_pretrained(src)  # oneshot re-reads its config
    gen = torch.Generator().manual_seed(0)
    data = Dataset.from_dict(
        {"input_ids": [torch.randint(3, VOCAB, (64,), generator=gen).tolist() for _ in range(16)]}
    )
    data = data.map(lambda row: {"attention_mask": [1] * len(row["input_ids"])})
    recipe = f"""
    reap_stage:
      reap_modifiers:
        REAPPruningModifier:
          sparsity: 0.5
          divisible_by: 8
          scores_path: {out}/scores.safetensors
          manifest_path: {dst}/pruning_manifest.json
          report_path: {out}/report.json
    """
    oneshot(
        model=model,
        dataset=data,
        recipe=recipe,
        processor=word_tokenizer(),
        num_calibration_samples=16,
        output_dir=str(dst),
    )
    reloaded = KimiK3ForConditionalGeneration.from_pretrained(dst)
    print(f"experts per MoE layer after pruning: {moe_fields(reloaded.config).num_experts}")
    manifest = json.loads((dst / "pruning_manifest.json").read_text())
    print(f"mean retained saliency mass: {manifest['retained_saliency_mass_mean']:.3f}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "out/quickstart"))
