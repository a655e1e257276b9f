"""Property tests (hypothesis): wholeness decides by knowledge, not by sizes.

Tiny models of several families are built with every size that can equal the expert
count E set to E in random combinations (hidden, intermediate / MoE intermediate, head
dim, attention latents, Kimi K3's expert latent, vocabulary, expert groups), plus a
custom ``nn.Module`` MoE whose forward takes hidden states (llm-compressor's own REAP
test style: 8 experts, hidden 8). Each is pruned by the modifier's lifecycle
(calibration on a few batches, the cut, the wholeness check, finalize) and must equal
the unpruned model with the dropped experts masked out of routing.

The oracle here is independent of the product: it finds MoE blocks and router weights
by module structure and masks router logits with a torch-function mode.
"""

from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

os.environ.setdefault(
    "HYPOTHESIS_STORAGE_DIRECTORY", str(Path(tempfile.gettempdir()) / "reap-modifier-hypothesis")
)

from family_zoo import build_family  # noqa: E402
from generic_oracle import mask_block  # noqa: E402
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = int(os.environ.get("REAP_PROPERTY_EXAMPLES", "0"))
SETTINGS = settings(
    max_examples=EXAMPLES or 3,
    deadline=None,
    database=None,
    derandomize=not EXAMPLES,
    suppress_health_check=[HealthCheck.too_slow],
)

# ---------------------------------------------------------------------------
# the oracle: masked routing, found by structure


def _moe_blocks(model: nn.Module):
    """``(name, block, router)`` of every module holding ``experts`` beside a router."""
    for name, module in model.named_modules():
        router = getattr(module, "gate", None) or getattr(module, "router", None)
        if isinstance(getattr(module, "experts", None), nn.Module) and isinstance(
            router, nn.Module
        ):
            yield name, module, router


def _router_weight(router: nn.Module) -> torch.Tensor:
    if isinstance(getattr(router, "weight", None), torch.Tensor):
        return router.weight
    (linear,) = [m for m in router.modules() if isinstance(m, nn.Linear)]
    return linear.weight


def masked_logits(model: nn.Module, dropped: dict[str, list[int]], call):
    """``call(model)`` with each block's ``dropped`` experts masked out of routing: their
    logits and per-expert routing biases at ``-inf``."""
    saved, modes = [], []
    try:
        for name, block, router in _moe_blocks(model):
            weight = _router_weight(router)
            mask = torch.zeros(weight.shape[0])
            mask[dropped[name]] = float("-inf")
            biases = [
                getattr(router, "bias", None),
                getattr(router, "e_score_correction_bias", None),
            ]
            biases.append(getattr(block, "e_score_correction_bias", None))
            for bias in biases:
                if isinstance(bias, torch.Tensor) and bias.shape == mask.shape:
                    saved.append((bias, bias.detach().clone()))
                    with torch.no_grad():
                        bias.add_(mask.to(bias.dtype))
            modes.append((block, mask_block(block, weight, mask)))
        with torch.no_grad():
            out = call(model)
        assert modes and all(mode.hits for _, mode in modes), "a router weight was never used"
        return out
    finally:
        for block, _ in modes:
            block.__dict__.pop("forward", None)
        with torch.no_grad():
            for bias, old in saved:
                bias.copy_(old)


# ---------------------------------------------------------------------------
# the product: the modifier's lifecycle


def prune(model: nn.Module, batches: list, call) -> dict[str, list[int]]:
    """Calibrate on ``batches`` (each run by ``call(model, batch)``), cut at sparsity 0.5,
    check wholeness and finalize: the modifier's lifecycle without a dataset."""
    from llmcompressor.core import Event, EventType, State, reset_session

    from reap_modifier import REAPPruningModifier

    reset_session()
    modifier = REAPPruningModifier(sparsity=0.5)
    state = State(model=model)
    modifier.initialize(state)
    modifier.update_event(state, Event(type_=EventType.CALIBRATION_START))
    with torch.no_grad():
        for batch in batches:
            call(model, batch)
    modifier.update_event(state, Event(type_=EventType.CALIBRATION_END))
    modifier.finalize(state)
    reset_session()
    return modifier.plan.kept


def _dropped(kept: dict[str, list[int]], count: int) -> dict[str, list[int]]:
    return {name: sorted(set(range(count)) - set(ids)) for name, ids in kept.items()}


def _check_family(family: str, count: int, sizes: dict, seed: int) -> None:
    if family == "olmoe":  # its q_norm spans all heads: hidden = 4 heads x head_dim
        sizes["head_dim"] = sizes.get("hidden_size", 32) // 4
    model, vocab = build_family(family, seed=seed, **sizes)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    batches = [torch.randint(3, vocab, (2, 6), generator=gen) for _ in range(2)]
    test_ids = torch.randint(3, vocab, (2, 7), generator=gen)

    def run(m, ids):
        return m(input_ids=ids, use_cache=False).logits

    kept = prune(model, batches, run)
    assert {len(ids) for ids in kept.values()} == {count // 2}
    expected = masked_logits(reference, _dropped(kept, count), lambda m: run(m, test_ids))
    with torch.no_grad():
        got = run(model, test_ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _collisions(names: tuple[str, ...]):
    return st.sets(st.sampled_from(names), min_size=1)


# ---------------------------------------------------------------------------
# families

QWEN = ("hidden_size", "intermediate_size", "moe_intermediate_size", "head_dim", "vocab_size")


@SETTINGS
@given(collide=_collisions(QWEN), seed=st.integers(0, 3))
@example(collide=set(QWEN), seed=0)
def test_qwen3_moe_sizes_equal_to_the_expert_count(collide, seed):
    _check_family("qwen3_moe", 8, dict.fromkeys(collide, 8), seed)


MIXTRAL = ("hidden_size", "intermediate_size", "head_dim", "vocab_size")  # OLMoE: no head_dim


@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
@SETTINGS
@given(collide=_collisions(MIXTRAL), seed=st.integers(0, 3))
@example(collide=set(MIXTRAL), seed=0)
def test_mixtral_style_sizes_equal_to_the_expert_count(family, collide, seed):
    _check_family(family, 8, dict.fromkeys(collide, 8), seed)


DEEPSEEK = (
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "kv_lora_rank",
    "q_lora_rank",
    "v_head_dim",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "vocab_size",
)


@SETTINGS
@given(collide=_collisions(DEEPSEEK), groups=st.sampled_from([1, 2]), seed=st.integers(0, 3))
@example(collide=set(DEEPSEEK), groups=2, seed=0)
def test_deepseek_v3_sizes_and_groups_equal_to_the_expert_count(collide, groups, seed):
    """Latents, head dims and the group count beside the expert count (group size 4 =
    the keep count at sparsity 0.5 when grouped)."""
    sizes = dict.fromkeys(collide, 8)
    sizes.update(n_group=groups, topk_group=1)
    _check_family("deepseek_v3", 8, sizes, seed)


KIMI = (
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "routed_expert_hidden_size",
    "kv_lora_rank",
    "vocab_size",
)


@SETTINGS
@given(collide=_collisions(KIMI), seed=st.integers(0, 3))
@example(collide=set(KIMI), seed=0)
def test_kimi_k3_latent_and_sizes_equal_to_the_expert_count(collide, seed):
    _check_family("kimi_k3", 16, dict.fromkeys(collide, 16), seed)


GPT_OSS = ("hidden_size", "intermediate_size", "head_dim", "vocab_size")


@SETTINGS
@given(collide=_collisions(GPT_OSS), seed=st.integers(0, 3))
@example(collide=set(GPT_OSS), seed=0)
def test_gpt_oss_sizes_equal_to_the_expert_count(collide, seed):
    _check_family("gpt_oss", 8, dict.fromkeys(collide, 8), seed)


# ---------------------------------------------------------------------------
# a custom nn.Module MoE whose forward takes hidden states


def _custom_moe(hidden: int, intermediate: int, experts: int, layers: int, seed: int):
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D
    from transformers import PretrainedConfig

    class Config(PretrainedConfig):
        model_type = "custom_moe_test"

    config = Config()
    config.num_experts, config.num_experts_per_tok = experts, 2
    config.hidden_size, config.intermediate_size = hidden, intermediate
    config.hidden_act, config.use_bias, config.dtype = "silu", False, torch.float32
    config.num_hidden_layers = layers

    class Experts(LinearExperts2D):
        is_concatenated, is_transposed, has_bias, has_gate = False, False, False, True

        @staticmethod
        def _apply_gate(gate_up: torch.Tensor) -> torch.Tensor:
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate) * up

    class Router(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_experts, self.top_k = experts, 2
            self.weight = nn.Parameter(torch.randn(experts, hidden))

        def forward(self, x):
            probs = F.linear(x, self.weight).softmax(dim=-1, dtype=torch.float32)
            weights, ids = probs.topk(self.top_k, dim=-1)
            return (weights / weights.sum(-1, keepdim=True)).to(x.dtype), ids

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.experts, self.num_experts = Router(), Experts(config), experts

        def forward(self, hidden_states):
            flat = hidden_states.reshape(-1, hidden_states.shape[-1])
            weights, ids = self.gate(flat)
            return self.experts(flat, ids, weights).view_as(hidden_states)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = config
            self.layers = nn.ModuleList(Block() for _ in range(layers))

        def forward(self, hidden_states):
            for layer in self.layers:
                hidden_states = hidden_states + layer(hidden_states)
            return hidden_states

    torch.manual_seed(seed)
    model = Model().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


@SETTINGS
@given(intermediate=st.sampled_from([8, 16]), layers=st.integers(1, 3), seed=st.integers(0, 3))
@example(intermediate=8, layers=2, seed=0)
def test_custom_module_moe_with_a_hidden_states_forward(intermediate, layers, seed):
    """llm-compressor's own test style: ``forward(hidden_states)``, 8 experts, hidden 8."""
    model = _custom_moe(8, intermediate, 8, layers, seed)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    batches = [torch.randn(2, 6, 8, generator=gen) for _ in range(3)]
    x = torch.randn(2, 5, 8, generator=gen)
    kept = prune(model, batches, lambda m, b: m(b))
    assert model.config.num_experts == 4 and {len(v) for v in kept.values()} == {4}
    for layer in model.layers:
        assert layer.gate.weight.shape == (4, 8) and layer.num_experts == 4
    expected = masked_logits(reference, _dropped(kept, 8), lambda m: m(x))
    with torch.no_grad():
        got = model(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
