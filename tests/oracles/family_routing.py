"""Where each family's MoE routing lives, written by hand from the modeling code
(transformers 5.17 ``models/<family>/modeling_<family>.py`` and llm-compressor's
``modeling/kimi_k3``), for the masked-routing oracle (:mod:`generic_oracle`).

Independent of the product's discovery on purpose: the pruner finds routers and biases
by its own rules, the oracle reads them from this table, and the logits comparison
catches any disagreement. ``ROUTING[family]``:

- ``block``: regex (full match) of the MoE block's module path in the zoo's model;
  modules it matches that have no ``router`` (dense layers) are not MoE blocks;
- ``router``: the router's logits weight ``[E (+ extra_rows), hidden]``, from the block;
- ``biases``: the per-expert vectors added to the scores before the top-k (router bias,
  ``e_score_correction_bias``, ``expert_bias``, ``moe_statics`` ``[1, E]``), from the
  block; a block without one (DeepSeek-V4's hash-routed layers) routes without it;
- ``extra_rows``: router rows after the routed experts' (Inkling: one per shared expert).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

__all__ = ["ROUTING", "Routing", "moe_blocks", "router_and_biases", "spread_biases_"]


@dataclass(frozen=True)
class Routing:
    block: str
    router: str
    biases: tuple[str, ...] = ()
    extra_rows: int = 0


_L = r"model\.layers\.\d+\.mlp"  # model.layers.N.mlp
_LM = r"model\.language_model\.layers\.\d+\.mlp"  # multimodal wrappers
_GATE = "gate.weight"
_GATE_BIAS = ("gate.e_score_correction_bias",)

ROUTING: dict[str, Routing] = {
    # AfmoeMoE: self.router = AfmoeTokenChoiceRouter (.gate Linear), self.expert_bias
    "afmoe": Routing(_L, "router.gate.weight", ("expert_bias",)),
    "axk1": Routing(_L, _GATE, _GATE_BIAS),
    "axk2": Routing(_L, _GATE, _GATE_BIAS),
    "cohere2_moe": Routing(_L, _GATE),
    "deepseek_ocr2": Routing(r"model\.language_model\.layers\.\d+\.mlp", _GATE),
    "deepseek_v2": Routing(_L, _GATE),
    "deepseek_v3": Routing(_L, _GATE, _GATE_BIAS),
    "deepseek_v32": Routing(_L, _GATE, _GATE_BIAS),
    "deepseek_v4": Routing(_L, _GATE, _GATE_BIAS),
    "deepseek_v4+hash": Routing(_L, _GATE, _GATE_BIAS),
    # Gemma4TextDecoderLayer holds router (Gemma4TextRouter.proj) and experts itself;
    # router.per_expert_scale scales the chosen experts' weights only
    "diffusion_gemma": Routing(
        r"model\.(encoder\.language_model|decoder)\.layers\.\d+", "router.proj.weight"
    ),
    "dots1": Routing(_L, _GATE, _GATE_BIAS),
    # Ernie4_5_MoeTopKRouter.moe_statics.e_score_correction_bias: [1, E]
    "ernie4_5_moe": Routing(_L, _GATE, ("gate.moe_statics.e_score_correction_bias",)),
    "ernie4_5_vl_moe": Routing(
        r"model\.language_model\.layers\.\d+\.mlp\.(text|vision)_moe",
        _GATE,
        ("gate.moe_statics.e_score_correction_bias",),
    ),
    "exaone_moe": Routing(_L, _GATE, _GATE_BIAS),
    "flex_olmo": Routing(_L, _GATE),
    "gemma4": Routing(r"model\.language_model\.layers\.\d+", "router.proj.weight"),
    "glm4_moe": Routing(_L, _GATE, _GATE_BIAS),
    "glm4_moe_lite": Routing(_L, _GATE, _GATE_BIAS),
    "glm4v_moe": Routing(_LM, _GATE, _GATE_BIAS),
    "glm5_next": Routing(_LM, _GATE, _GATE_BIAS),
    "glm_moe_dsa": Routing(_L, _GATE, _GATE_BIAS),
    # GptOssTopKRouter: self.weight, self.bias
    "gpt_oss": Routing(_L, "router.weight", ("router.bias",)),
    "granitemoe": Routing(r"model\.layers\.\d+\.block_sparse_moe", "router.weight"),
    "granitemoe_swa": Routing(r"model\.layers\.\d+\.block_sparse_moe", "router.weight"),
    "granitemoehybrid": Routing(r"model\.layers\.\d+\.block_sparse_moe", "router.weight"),
    "granitemoeshared": Routing(r"model\.layers\.\d+\.block_sparse_moe", "router.weight"),
    # HunYuanMoEV1Gate: self.wg Linear
    "hunyuan_v1_moe": Routing(_L, "gate.wg.weight"),
    # HYV3MoE: the bias is a buffer of the block, passed to the gate
    "hy_v3": Routing(_L, _GATE, ("e_score_correction_bias",)),
    "hy_v4": Routing(_L, _GATE, _GATE_BIAS),
    # InklingTopkRouter: one logit per shared expert after the routed ones (the zoo has 1)
    "inkling": Routing(_LM, _GATE, _GATE_BIAS, extra_rows=1),
    "jamba": Routing(r"model\.layers\.\d+\.feed_forward", "router.weight"),
    "kimi_linear": Routing(_L, _GATE, _GATE_BIAS),
    "laguna": Routing(_L, _GATE, _GATE_BIAS),
    # Lfm2MoeSparseMoeBlock: self.expert_bias buffer, passed to the gate
    "lfm2_moe": Routing(r"model\.layers\.\d+\.feed_forward", _GATE, ("expert_bias",)),
    "llama4": Routing(r"language_model\.model\.layers\.\d+\.feed_forward", "router.weight"),
    "mellum": Routing(_L, _GATE),
    "mimo_v2_flash": Routing(_L, _GATE, _GATE_BIAS),
    "minimax": Routing(_L, _GATE),
    # MiniMaxM2SparseMoeBlock: the bias is a buffer of the block, passed to the gate
    "minimax_m2": Routing(_L, _GATE, ("e_score_correction_bias",)),
    "minimax_m3_vl": Routing(_LM, _GATE, _GATE_BIAS),
    "mistral4": Routing(_L, _GATE),
    "mixtral": Routing(_L, _GATE),
    # NemotronHMoE sits in the decoder block's mixer
    "nemotron_h": Routing(r"model\.layers\.\d+\.mixer", _GATE, _GATE_BIAS),
    "olmoe": Routing(_L, _GATE),
    "openai_privacy_filter": Routing(_L, "router.weight", ("router.bias",)),
    "phimoe": Routing(_L, "router.weight"),
    "qwen2_moe": Routing(_L, _GATE),
    "qwen3_5_moe": Routing(_LM, _GATE),
    "qwen3_moe": Routing(_L, _GATE),
    "qwen3_next": Routing(_L, _GATE),
    "qwen3_omni_moe": Routing(_L, _GATE),  # the thinker: its text model is ``model``
    "qwen3_vl_moe": Routing(_LM, _GATE),
    "qwen4_exp": Routing(_LM, _GATE),
    "solar_open": Routing(_L, _GATE, _GATE_BIAS),
    "step3p7": Routing(_LM, _GATE, _GATE_BIAS),
    # llm-compressor's KimiK3: MoE blocks under the text model's block_sparse_moe
    "kimi_k3": Routing(r"language_model\.model\.layers\.\d+\.block_sparse_moe", _GATE, _GATE_BIAS),
}


def _find(module: torch.nn.Module, path: str) -> torch.Tensor | None:
    owner, _, attr = path.rpartition(".")
    try:
        sub = module.get_submodule(owner) if owner else module
    except AttributeError:
        return None
    t = getattr(sub, attr, None)
    return t if isinstance(t, torch.Tensor) else None


def moe_blocks(model: torch.nn.Module, family: str) -> dict[str, torch.nn.Module]:
    """``{module path: block}`` of every MoE block of ``model`` by the table."""
    if family not in ROUTING:
        raise KeyError(f"{family}: no row in tests/oracles/family_routing.py ROUTING; add one")
    spec = ROUTING[family]
    pattern = re.compile(spec.block)
    return {
        name: module
        for name, module in model.named_modules()
        if pattern.fullmatch(name) and _find(module, spec.router) is not None
    }


def router_and_biases(
    block: torch.nn.Module, family: str
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The block's router weight and the per-expert biases it has, by the table."""
    spec = ROUTING[family]
    weight = _find(block, spec.router)
    assert weight is not None, f"{family}: no {spec.router} on {type(block).__name__}"
    biases = [t for t in (_find(block, path) for path in spec.biases) if t is not None]
    return weight, biases


@torch.no_grad()
def spread_biases_(model: torch.nn.Module, family: str, seed: int = 0) -> None:
    """Give every per-expert bias of the table values ~ N(0, 1) (the zoo leaves some at
    zero, others at N(0, 0.1)): large enough that an expert whose logit alone is masked
    is still picked through its bias, so a bias the pruner cuts wrongly, or the oracle
    misses, changes the logits. Families without a row (refused ones) are left as
    they are."""
    if family not in ROUTING:
        return
    gen = torch.Generator().manual_seed(seed)
    for block in moe_blocks(model, family).values():
        for t in router_and_biases(block, family)[1]:
            t.copy_(torch.randn(t.shape, generator=gen) * 0.3)
