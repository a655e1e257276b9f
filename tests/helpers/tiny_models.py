"""Tiny, random, deterministic MoE causal LMs for tests (no downloads).

``build_tiny(family, seed=0, dtype=torch.float32, **overrides) -> (model, info)``
builds a 2-4 layer model with 8-16 routed experts from a config, initialises
*every* parameter explicitly from ``seed`` (some models' ``_init_weights`` are
no-ops, e.g. Kimi K3, whose parameters would otherwise be ``torch.empty``
garbage), then casts to ``dtype``.  ``overrides`` are merged into the (text)
config kwargs.

Families (``FAMILIES``):

==============  ============================================  ======  =======
family          class                                         router  experts
==============  ============================================  ======  =======
kimi_k3         llmcompressor KimiK3ForConditionalGeneration  gate    experts (ModuleList of w1/w2/w3, latent)
kimi_linear     llmcompressor KimiLinearForCausalLM           gate    experts (same as K3, text-only)
deepseek_v3     transformers DeepseekV3ForCausalLM            gate    experts (fused 3-D)
qwen3_moe       transformers Qwen3MoeForCausalLM              gate    experts (fused 3-D)
olmoe           transformers OlmoeForCausalLM                 gate    experts (fused 3-D)
mixtral         transformers MixtralForCausalLM               gate    experts (fused 3-D)
glm4_moe        transformers Glm4MoeForCausalLM               gate    experts (fused 3-D)
gpt_oss         transformers GptOssForCausalLM                router  experts (fused 3-D, transposed, interleaved, biases)
==============  ============================================  ======  =======

Variants via overrides, e.g. ``build_tiny("kimi_k3", num_expert_group=4,
topk_group=2)`` (also ``grouped=True`` as a shorthand for exactly that) or
``build_tiny("kimi_k3", latent_moe_use_norm=True)``.

Note: transformers 5.17 ships its *own* ``kimi_linear`` model type (fused
experts, no latent MoE).  A checkpoint saved from llm-compressor's
``KimiLinearForCausalLM`` therefore reloads through ``AutoConfig`` /
``AutoModelForCausalLM`` as the *transformers* class, which is a different
architecture; reload it with ``reload_class("kimi_linear")`` instead.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "FAMILIES",
    "capture_block_io",
    "ALL_FAMILIES",
    "TinyInfo",
    "build_tiny",
    "tiny_config",
    "model_class",
    "reload_class",
    "register_kimi",
    "init_weights_",
    "find_moe_blocks",
    "info_for",
    "sample_input_ids",
    "text_config",
    "batch_invariant_numerics",
]

#: the seven families of the brief (kimi_linear is extra, see ``ALL_FAMILIES``)
FAMILIES = (
    "kimi_k3",
    "deepseek_v3",
    "qwen3_moe",
    "olmoe",
    "mixtral",
    "glm4_moe",
    "gpt_oss",
)
ALL_FAMILIES = FAMILIES + ("kimi_linear",)

#: families whose router is sigmoid + e_score_correction_bias (+ groups)
SIGMOID_FAMILIES = ("kimi_k3", "kimi_linear", "deepseek_v3", "glm4_moe")

VOCAB = 128


@dataclass
class TinyInfo:
    """What a test needs to know about a tiny model (also readable as a dict)."""

    family: str
    moe_blocks: list[str]
    router_attr: str
    experts_attr: str
    num_experts: int
    top_k: int
    vocab_size: int
    hidden_size: int
    #: width of the space the routed experts work in (latent size for K3)
    expert_hidden_size: int
    #: "softmax" | "sigmoid" | "gpt_oss"
    scoring: str
    #: True when routed experts live in a latent space (Kimi K3 latent MoE)
    latent: bool
    num_layers: int
    dense_layers: list[int] = field(default_factory=list)
    config: Any = None

    def __getitem__(self, key):
        return getattr(self, key)

    def get(self, key, default=None):
        return getattr(self, key, default)


# ---------------------------------------------------------------------------
# configs


def _kimi_text_kwargs() -> dict:
    return dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        moe_intermediate_size=16,
        num_experts=16,
        num_experts_per_token=4,
        num_shared_experts=1,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        num_expert_group=1,
        topk_group=1,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        routed_expert_hidden_size=24,
        linear_attn_config=None,
        max_position_embeddings=256,
        mla_use_nope=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _kimi_vision_kwargs() -> dict:
    return dict(
        vt_num_attention_heads=2,
        vt_num_hidden_layers=1,
        vt_hidden_size=16,
        vt_intermediate_size=32,
        text_hidden_size=32,
        mm_hidden_size=16,
        qkv_hidden_size=16,
        _attn_implementation="eager",
    )


_NATIVE_KWARGS: dict[str, dict] = {
    "deepseek_v3": dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_shared_experts=1,
        n_routed_experts=16,
        routed_scaling_factor=2.5,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        v_head_dim=8,
        qk_nope_head_dim=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
    "qwen3_moe": dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
    "olmoe": dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
    "mixtral": dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
    "glm4_moe": dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        n_shared_experts=1,
        n_routed_experts=16,
        num_experts_per_tok=4,
        routed_scaling_factor=1.5,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
    "gpt_oss": dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=16,
        head_dim=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=4,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=256,
        # consistent yarn settings (256 / 8 == 32) so transformers does not warn
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 8,
        },
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
}


def _native_classes(family: str):
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        return DeepseekV3Config, DeepseekV3ForCausalLM
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        return Qwen3MoeConfig, Qwen3MoeForCausalLM
    if family == "olmoe":
        from transformers import OlmoeConfig, OlmoeForCausalLM

        return OlmoeConfig, OlmoeForCausalLM
    if family == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        return MixtralConfig, MixtralForCausalLM
    if family == "glm4_moe":
        from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

        return Glm4MoeConfig, Glm4MoeForCausalLM
    if family == "gpt_oss":
        from transformers import GptOssConfig, GptOssForCausalLM

        return GptOssConfig, GptOssForCausalLM
    raise ValueError(f"unknown family {family!r}")


def model_class(family: str):
    """The class ``build_tiny`` instantiates for ``family``."""
    if family == "kimi_k3":
        from llmcompressor.modeling.kimi_k3.modeling_kimi_k3 import (
            KimiK3ForConditionalGeneration,
        )

        return KimiK3ForConditionalGeneration
    if family == "kimi_linear":
        from llmcompressor.modeling.kimi_k3.modeling_kimi_linear import (
            KimiLinearForCausalLM,
        )

        return KimiLinearForCausalLM
    return _native_classes(family)[1]


def reload_class(family: str):
    """Class to ``from_pretrained`` a saved tiny model of ``family`` with.

    ``AutoModelForCausalLM`` for the transformers-native families; the
    llm-compressor class for kimi_k3 (after ``register_kimi()``, the auto class
    also works for it) and for kimi_linear (whose model_type collides with
    transformers' own, different, ``kimi_linear``).
    """
    if family in ("kimi_k3", "kimi_linear"):
        register_kimi()
        return model_class(family)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


_KIMI_REGISTERED = False


def register_kimi() -> None:
    """Register Kimi K3 with the transformers auto classes (idempotent).

    ``AutoConfig`` learns ``kimi_k3 -> KimiK3Config`` and ``AutoModelForCausalLM``
    learns ``KimiK3Config -> KimiK3ForConditionalGeneration``, so code that
    re-reads a saved tiny K3 through the auto classes (e.g. ``oneshot``) works.
    ``kimi_linear`` is NOT registered: transformers 5.17 already owns that
    model type (a different implementation), see the module docstring.
    """
    global _KIMI_REGISTERED
    if _KIMI_REGISTERED:
        return
    from llmcompressor.modeling.kimi_k3.configuration_kimi_k3 import KimiK3Config
    from llmcompressor.modeling.kimi_k3.modeling_kimi_k3 import (
        KimiK3ForConditionalGeneration,
    )
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        existing = CONFIG_MAPPING["kimi_k3"]
    except KeyError:
        existing = None
    if existing is None:
        AutoConfig.register("kimi_k3", KimiK3Config, exist_ok=True)
    try:
        AutoModelForCausalLM.register(KimiK3Config, KimiK3ForConditionalGeneration, exist_ok=True)
    except ValueError:  # already registered (by someone else) - fine
        pass
    _KIMI_REGISTERED = True


def text_config(model_or_config):
    """The text (decoder) config of a model/config (K3 nests it)."""
    cfg = getattr(model_or_config, "config", model_or_config)
    return getattr(cfg, "text_config", None) or cfg


def tiny_config(family: str, **overrides):
    """Config object for ``family``; ``overrides`` go into the (text) config.

    ``grouped=True`` (kimi families) is shorthand for ``num_expert_group=4,
    topk_group=2``.  For kimi_k3, ``vision_config=`` overrides the vision part.
    """
    overrides = dict(overrides)
    if family in ("kimi_k3", "kimi_linear"):
        from llmcompressor.modeling.kimi_k3.configuration_kimi_k3 import (
            KimiK3Config,
            KimiLinearConfig,
        )

        kw = _kimi_text_kwargs()
        if overrides.pop("grouped", False):
            kw.update(num_expert_group=4, topk_group=2)
        vision = _kimi_vision_kwargs()
        vision.update(overrides.pop("vision_config", {}) or {})
        kw.update(overrides)
        if family == "kimi_linear":
            cfg = KimiLinearConfig(**kw)
            cfg._attn_implementation = "eager"
            return cfg
        cfg = KimiK3Config(text_config=kw, vision_config=vision)
        cfg.text_config._attn_implementation = "eager"
        return cfg

    config_cls, _ = _native_classes(family)
    kw = dict(_NATIVE_KWARGS[family])
    kw.update(overrides)
    kw.setdefault("attn_implementation", "eager")
    kw.setdefault("experts_implementation", "eager")
    return config_cls(**kw)


# ---------------------------------------------------------------------------
# initialisation


def _std_for(name: str, p: torch.Tensor, family: str) -> tuple[float, float]:
    """(mean, std) for parameter ``name``: big enough routers, sane activations."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "e_score_correction_bias":
        return 0.0, 0.1
    if "norm" in name and p.dim() == 1 and leaf == "weight":
        return 1.0, 0.1
    # routers: logits ~ N(0, 0.3^2 * hidden) -> std ~1.7 for hidden 32
    if name.endswith(".router.weight") or (name.endswith(".gate.weight") and p.dim() == 2):
        return 0.0, 0.3
    if name.endswith(".router.bias"):
        return 0.0, 0.5
    if leaf in ("gate_up_proj", "down_proj") and p.dim() == 3:
        return 0.0, 0.2
    if leaf in ("gate_up_proj_bias", "down_proj_bias"):
        return 0.0, 0.1
    if leaf == "sinks":
        return 0.0, 0.1
    if leaf == "bias":
        return 0.0, 0.05
    if "embed_tokens" in name or "embedding" in leaf:
        return 0.0, 1.0
    if p.dim() >= 2:
        fan_in = math.prod(p.shape[1:])
        if ".experts." in name:
            return 0.0, 0.2
        return 0.0, 0.5 / math.sqrt(fan_in)
    return 0.0, 0.05


@torch.no_grad()
def init_weights_(model: torch.nn.Module, seed: int = 0, family: str = "") -> None:
    """Overwrite every floating parameter (and every ``e_score_correction_bias``,
    parameter or buffer) from ``torch.Generator().manual_seed(seed)``, in
    ``named_parameters`` order.  Deterministic for a given structure + seed."""
    gen = torch.Generator().manual_seed(int(seed))
    seen = set()
    tensors = list(model.named_parameters())
    tensors += [
        (n, b)
        for n, b in model.named_buffers()
        if n.rsplit(".", 1)[-1] == "e_score_correction_bias"
    ]
    for name, t in tensors:
        if id(t) in seen or not t.is_floating_point():
            continue
        seen.add(id(t))
        mean, std = _std_for(name, t, family)
        vals = torch.randn(t.shape, generator=gen, dtype=torch.float32) * std + mean
        t.copy_(vals.to(t.dtype))


def find_moe_blocks(model: torch.nn.Module, router_attr: str, experts_attr: str) -> list[str]:
    """Names of modules that own both a router and a routed-experts child."""
    out = []
    for name, mod in model.named_modules():
        r = getattr(mod, router_attr, None)
        e = getattr(mod, experts_attr, None)
        if isinstance(r, torch.nn.Module) and isinstance(e, torch.nn.Module):
            out.append(name)
    return out


def _make_info(family: str, model) -> TinyInfo:
    cfg = text_config(model)
    router_attr = "router" if family == "gpt_oss" else "gate"
    experts_attr = "experts"
    blocks = find_moe_blocks(model, router_attr, experts_attr)
    block0 = model.get_submodule(blocks[0])
    router = getattr(block0, router_attr)
    num_experts = int(router.num_experts)
    top_k = int(router.top_k)
    latent = bool(getattr(block0, "use_latent_moe", False))
    expert_hidden = int(getattr(block0, "moe_hidden_size", cfg.hidden_size))
    if family in SIGMOID_FAMILIES:
        scoring = getattr(router, "moe_router_activation_func", "sigmoid")
    elif family == "gpt_oss":
        scoring = "gpt_oss"
    else:
        scoring = "softmax"
    layer_ids = sorted({int(b.split("layers.")[1].split(".")[0]) for b in blocks if "layers." in b})
    dense = [i for i in range(cfg.num_hidden_layers) if i not in layer_ids]
    return TinyInfo(
        family=family,
        moe_blocks=blocks,
        router_attr=router_attr,
        experts_attr=experts_attr,
        num_experts=num_experts,
        top_k=top_k,
        vocab_size=int(cfg.vocab_size),
        hidden_size=int(cfg.hidden_size),
        expert_hidden_size=expert_hidden,
        scoring=scoring,
        latent=latent,
        num_layers=int(cfg.num_hidden_layers),
        dense_layers=dense,
        config=model.config,
    )


def info_for(model, family: str) -> TinyInfo:
    """Re-derive ``TinyInfo`` for an existing (e.g. reloaded or pruned) model."""
    return _make_info(family, model)


def build_tiny(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """Build a tiny random ``family`` model in eval mode -> ``(model, TinyInfo)``."""
    if family not in ALL_FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {ALL_FAMILIES}")
    if family == "kimi_k3":
        register_kimi()
    cfg = tiny_config(family, **overrides)
    cls = model_class(family)
    torch.manual_seed(int(seed))
    model = cls(cfg)
    init_weights_(model, seed=seed, family=family)
    model = model.to(dtype)
    for c in {id(model.config): model.config, id(text_config(model)): text_config(model)}.values():
        try:
            c.dtype = dtype
        except Exception:  # pragma: no cover - config without dtype setter
            pass
    model.eval()
    return model, _make_info(family, model)


def sample_input_ids(
    vocab: int = VOCAB, batch: int = 2, seq: int = 16, seed: int = 0
) -> torch.LongTensor:
    """Deterministic random token ids in ``[3, vocab)`` (avoids pad/bos/eos)."""
    gen = torch.Generator().manual_seed(int(seed))
    return torch.randint(3, int(vocab), (int(batch), int(seq)), generator=gen)


# ---------------------------------------------------------------------------
def _attention_in_model_dtype(
    module, query, key, value, attention_mask, scaling, dropout: float = 0.0, **kwargs
):
    """Eager attention with the softmax in the query dtype (upstream: float32)."""
    n_rep = module.num_key_value_groups
    if n_rep > 1:
        key = key.repeat_interleave(n_rep, dim=1)
        value = value.repeat_interleave(n_rep, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, value).transpose(1, 2).contiguous()
    return out, probs


class _GateFunctional:
    """``torch.nn.functional`` for Kimi's modeling module, except that ``linear`` on
    float32 inputs (only the router gate casts to float32) multiplies in float64 and
    rounds the result to float32."""

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)

    @staticmethod
    def linear(x, weight, bias=None):
        if x.dtype != torch.float32:
            return torch.nn.functional.linear(x, weight, bias)
        out = torch.nn.functional.linear(
            x.double(), weight.double(), None if bias is None else bias.double()
        )
        return out.to(torch.float32)


@contextlib.contextmanager
def batch_invariant_numerics():
    """Make float64 Qwen3-MoE and Kimi K3 / Kimi Linear compute every token the same
    way whatever else is in its batch, for tests that compare padded with unpadded
    batches (or one process with several ranks at batch size > 1) to 1e-9.

    Two float32 steps of the upstream models depend on the batch shape:

    - eager attention (which llm-compressor forces during calibration) takes the
      softmax in float32 in both models: a row padded to a longer length sums its
      (exactly zero) extra terms in another order and the real tokens' hidden states
      move by ~1e-7 relative, enough to flip a near-tied routing decision of a tiny
      random model. Here the softmax stays in the model dtype.
    - Kimi's router gate computes its logits with a float32 matrix product, whose
      rounding depends on the number of rows: gate weights move by ~1e-8 relative.
      Here that product runs in float64 and is rounded to float32.

    With both, padded and unpadded batches agree to ~1e-16. Patched at module level,
    so the sequential pipeline's tracer picks it up as well.
    """
    from llmcompressor.modeling.kimi_k3 import modeling_kimi_linear
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    saved = [
        (modeling_qwen3_moe, "eager_attention_forward", _attention_in_model_dtype),
        (modeling_kimi_linear, "eager_attention_forward", _attention_in_model_dtype),
        (modeling_kimi_linear, "F", _GateFunctional()),
    ]
    originals = [(module, name, getattr(module, name)) for module, name, _ in saved]
    for module, name, value in saved:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in originals:
            setattr(module, name, value)


def capture_block_io(model, arch, ids) -> dict:
    """``layer name -> (inputs [N, H], outputs [N, H])`` of every MoE block of ``arch`` on one
    forward of ``model`` over ``ids`` (plain forward hooks)."""
    io = {}

    def hook(name):
        def fn(module, args, out):
            x, y = args[0], out[0] if isinstance(out, tuple) else out
            io[name] = (x.detach().reshape(-1, x.shape[-1]), y.detach().reshape(-1, x.shape[-1]))

        return fn

    hooks = [layer.block.register_forward_hook(hook(layer.name)) for layer in arch.layers]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    return io
