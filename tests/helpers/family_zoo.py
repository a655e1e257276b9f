"""Tiny random models of every MoE decoder family transformers 5.17 and
llm-compressor's modeling ship, built from each family's own config class with
its sizes shrunk by rule (no downloads), for the coverage test.

``FAMILY_TYPES``: the model types covered. ``build_family(model_type, seed)``
-> ``(model, vocab_size)``, a float32 eval model with eager attention and experts.
Encoder-decoder MoE (Switch Transformers, NLLB-MoE) is out of scope.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["ENCODERS", "FAMILY_TYPES", "OUT_OF_SCOPE", "build_family", "family_config"]

#: every model type of transformers 5.17 whose decoder has routed experts, and
#: llm-compressor's Kimi K3 (its other modeling classes patch these families)
FAMILY_TYPES = (
    "afmoe", "aria", "axk1", "axk2", "bamba", "cohere2_moe", "dbrx", "deepseek_ocr2",
    "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "diffusion_gemma", "doge",
    "dots1", "ernie4_5_moe", "ernie4_5_vl_moe", "exaone_moe", "flex_olmo", "gemma4",
    "glm4_moe", "glm4_moe_lite", "glm4v_moe", "glm5_next", "glm_moe_dsa", "gpt_oss",
    "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "hunyuan_v1_moe",
    "hy_v3", "hy_v4", "inkling", "jamba", "jetmoe", "kimi_linear", "laguna", "lfm2_moe",
    "llama4", "longcat_flash", "mellum", "mimo_v2_flash", "minimax", "minimax_m2",
    "minimax_m3_vl", "mistral4", "mixtral", "nemotron_h", "olmoe", "openai_privacy_filter",
    "phimoe", "qwen2_moe", "qwen3_5_moe", "qwen3_moe", "qwen3_next", "qwen3_omni_moe",
    "qwen3_vl_moe", "qwen4_exp", "solar_open", "step3p7", "zaya", "kimi_k3",
    "deepseek_v4+hash",
)  # fmt: skip
OUT_OF_SCOPE = {
    "switch_transformers": "encoder-decoder MoE",
    "nllb_moe": "encoder-decoder MoE",
    "vitpose_backbone": "vision backbone, no decoder",
}
#: MoE encoders (bidirectional attention, a per-token head instead of an LM head):
#: pruned like decoders, the oracle compares their per-token logits
ENCODERS = {"openai_privacy_filter": "token classification"}
#: families this zoo cannot shrink yet (building them exhausts the test machine's memory)
TOO_BIG: dict[str, str] = {}
#: model types whose registered name differs from the package name
_CONFIG_TYPE = {
    "inkling": "inkling_mm_model",
    # the thinker (vision + audio towers and the MoE text model) is the language model;
    # the omni wrapper adds a speech talker and has no forward
    "qwen3_omni_moe": "qwen3_omni_moe_thinker",
}

VOCAB = 128
_INT = {
    "vocab_size": VOCAB,
    "hidden_size": 32, "d_model": 32, "n_embd": 32, "embed_dim": 32,
    "intermediate_size": 64, "ffn_hidden_size": 64, "ffn_dim": 64, "dense_intermediate_size": 64,
    "moe_intermediate_size": 32, "expert_intermediate_size": 32, "expert_dim": 32,
    "shared_expert_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32,
    "num_hidden_layers": 2, "num_layers": 2, "n_layers": 2,
    "num_attention_heads": 4, "num_heads": 4, "n_heads": 4,
    "num_key_value_heads": 4, "head_dim": 8, "attention_head_dim": 8,
    "num_experts": 8, "num_local_experts": 8, "n_routed_experts": 8, "moe_num_experts": 8,
    "num_experts_per_tok": 2, "moe_top_k": 2, "moe_topk": 2, "top_k_experts": 2,
    "experts_per_token": 2, "num_experts_per_token": 2, "moe_k": 2,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1,
    "q_lora_rank": 16, "kv_lora_rank": 16, "o_lora_rank": 16,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "qk_head_dim": 16,
    "max_position_embeddings": 256, "sliding_window": 8,
    "first_k_dense_replace": 0, "decoder_sparse_step": 1, "moe_layer_freq": 1,
    "index_n_heads": 2, "index_head_dim": 8, "index_topk": 4,
    "linear_num_key_heads": 2, "linear_num_value_heads": 2,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "mamba_n_heads": 4, "mamba_d_head": 8, "mamba_head_dim": 8, "mamba_d_state": 8,
    "mamba_n_groups": 1, "ssm_state_size": 8, "mamba_expand": 2, "n_shared_experts": 1,
    "num_nextn_predict_layers": 0, "hc_mult": 2, "o_groups": 2,
    "depth": 1, "out_hidden_size": 32, "num_channels": 3,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
_VISION = {
    "hidden_size": 32, "intermediate_size": 32, "depth": 1, "num_hidden_layers": 1,
    "num_layers": 1, "num_heads": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
    "out_hidden_size": 32, "embed_dim": 32, "head_dim": 16, "projection_dim": 32,
    "vision_output_dim": 32, "output_dim": 32, "d_model": 32, "encoder_layers": 1,
    "encoder_attention_heads": 2, "encoder_ffn_dim": 32, "num_mel_bins": 16,
    "downsample_hidden_size": 8, "n_window": 4,
}  # fmt: skip
_FAMILY = {
    "deepseek_v4": {"mlp_layer_types": ["moe", "moe"]},
    # the released layout: the first MoE layers hash-routed
    "deepseek_v4+hash": {"mlp_layer_types": ["hash_moe", "moe"]},
    "lfm2_moe": {"num_dense_layers": 0, "layer_types": ["full_attention", "conv"]},
    "bamba": {"mamba_n_heads": 8},
    "granitemoehybrid": {"mamba_n_heads": 8},
    # MoE variants behind a flag / layer list (their defaults build dense MLPs)
    "gemma4": {"enable_moe_block": True},
    "step3p7": {"mlp_layer_types": ["dense", "sparse"]},
    "doge": {"is_moe": True, "num_experts": 16},  # product keys: a square expert count
    # its sliding-window layers have twice `num_key_value_heads`: at most the 4 query heads
    "mimo_v2_flash": {"num_key_value_heads": 2},
    # partial rotary 0.5 of head_dim 16: 4 frequencies for the three M-RoPE sections
    "glm4v_moe": {
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1]},
    },
    "glm5_next": {
        "index_topk": 16,
        "qk_rope_head_dim": 0,
        "qk_nope_head_dim": 16,
        "mlp_layer_types": ["sparse", "sparse"],
    },
    "ernie4_5_vl_moe": {
        "moe_intermediate_size": [32, 32],
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [1, 1, 2],
        },
    },
    "zaya": {"num_experts_per_tok": 1},
    "deepseek_ocr2": {"mlp_layer_types": ["sparse", "sparse"]},
    "dbrx": {
        "attn_config": {"kv_n_heads": 4, "rope_theta": 10000.0},
        "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 8, "moe_top_k": 2},
    },
}
#: wrappers whose sub-configs are built here (``AutoConfig`` placeholders, nested vision
#: configs): sub-config -> (registered config type, sizes beyond the shrink tables)
_SUB_CONFIGS = {
    "aria": {
        "text_config": ("aria_text", {}),
        "vision_config": ("idefics3_vision", {"image_size": 28, "patch_size": 14}),
    },
    "minimax_m3_vl": {
        "text_config": ("minimax_m3_vl_text", {}),
        "vision_config": ("minimax_m3_vl_vision", {"image_size": 56}),
    },
    "deepseek_ocr2": {
        "text_config": ("deepseek_ocr2_text", {}),
        "vision_config": (
            "deepseek_ocr2_vision",
            {
                "sam_config": {
                    "hidden_size": 16, "output_channels": 16, "num_hidden_layers": 2,
                    "num_attention_heads": 2, "image_size": 64, "window_size": 2,
                    "global_attn_indexes": [1], "downsample_channels": [16, 32],
                },
                "encoder_config": {
                    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 32,
                    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
                    "max_window_layers": 1,
                },
            },
        ),
    },
}  # fmt: skip
#: wrapper attributes set after construction: sizes outside the shrink tables, and
#: attributes its modeling reads that the config class does not declare (released
#: checkpoints carry them in config.json)
_WRAPPER_ATTRS = {
    "qwen3_omni_moe": {"vision_start_token_id": 151652},
    "minimax_m3_vl": {"projector_hidden_size": 32},
}


def _fields(cls) -> set[str]:
    names = set()
    for klass in cls.__mro__:
        names.update(getattr(klass, "__annotations__", {}))
    if dataclasses.is_dataclass(cls):
        names.update(f.name for f in dataclasses.fields(cls))
    return names


def _shrunk(cls, table: dict, extra: dict) -> dict:
    names = _fields(cls)
    kw = {k: v for k, v in table.items() if k in names}
    kw.update(extra)
    return kw


def _sub_classes(cls) -> dict:
    return dict(getattr(cls, "sub_configs", {}) or {})


def family_config(model_type: str, **overrides):
    """The family's config class with every size shrunk (``overrides`` win)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    variant, model_type = model_type, model_type.split("+")[0]
    if model_type == "kimi_k3":
        from tiny_models import register_kimi, tiny_config

        register_kimi()
        return tiny_config("kimi_k3", **overrides)
    cls = CONFIG_MAPPING[_CONFIG_TYPE.get(model_type, model_type)]
    subs = _sub_classes(cls)
    kw = {}
    extra = dict(_FAMILY.get(variant, {}))
    extra.update(overrides)
    if variant in _SUB_CONFIGS:  # sub-configs built here, nested ones shrunk too
        for name, (sub_type, sub_extra) in _SUB_CONFIGS[variant].items():
            sub_cls = CONFIG_MAPPING[sub_type]
            table, more = (_INT, extra) if name == "text_config" else (_VISION, {})
            kw[name] = sub_cls(**{**_shrunk(sub_cls, table, more), **sub_extra})
    elif "text_config" in subs:
        text_cls = subs["text_config"]
        if not isinstance(text_cls, type):
            text_cls = AutoConfig.for_model(model_type).__class__
        kw["text_config"] = _shrunk(text_cls, _INT, extra)
        for name, sub in subs.items():
            if name != "text_config" and isinstance(sub, type):
                kw[name] = _shrunk(sub, _VISION, {})
    else:
        kw = _shrunk(cls, _INT, extra)
    cfg = cls(**kw)
    for name, value in _WRAPPER_ATTRS.get(variant, {}).items():
        setattr(cfg, name, value)
    if not hasattr(cfg, "pad_token_id"):  # wrappers whose model reads it (Llama-4)
        cfg.pad_token_id = 0
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is not None:
            c._attn_implementation = "eager"
            c._experts_implementation = "eager"
    return cfg


def model_class(model_type: str, config):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    model_type = model_type.split("+")[0]
    if model_type == "kimi_k3":
        from tiny_models import model_class as kimi

        return kimi("kimi_k3")
    autos = [AutoModelForCausalLM, AutoModelForImageTextToText]
    if model_type in ENCODERS:
        from transformers import AutoModelForTokenClassification

        autos = [AutoModelForTokenClassification]
    for auto in autos:
        try:
            return auto._model_mapping[type(config)]
        except KeyError:
            continue
    raise KeyError(f"{model_type}: no causal-LM or image-text-to-text class")


@torch.no_grad()
def build_family(model_type: str, seed: int = 0, **overrides):
    """A tiny random ``model_type`` model -> ``(model, vocab_size)``."""
    from tiny_models import init_weights_

    if model_type in TOO_BIG:
        raise MemoryError(f"{model_type}: {TOO_BIG[model_type]}")
    cfg = family_config(model_type, **overrides)
    cls = model_class(model_type, cfg)
    torch.manual_seed(seed)
    try:
        model = cls(cfg)
    except AttributeError:  # a text-only class mapped to a wrapper config (Llama-4)
        from transformers import AutoModelForImageTextToText

        mapping = AutoModelForImageTextToText._model_mapping
        if type(cfg) not in mapping:
            raise
        model = mapping[type(cfg)](cfg)
    model = model.float().eval()
    init_weights_(model, seed=seed, family=model_type)
    text = getattr(cfg, "text_config", None) or cfg
    return model, int(getattr(text, "vocab_size", VOCAB) or VOCAB)
