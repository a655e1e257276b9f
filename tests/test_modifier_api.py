"""The recipe API: YAML recipes, upstream compatibility, validation and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import calibration_samples, make_dataset, save_and_reload
from pydantic import ValidationError
from tiny_models import build_tiny

from reap_modifier import REAPPruningModifier
from reap_modifier.models import NoMoEError
from reap_modifier.scores import ExpertScores
from reap_modifier.scores.plan import PlanError

RECIPES = Path(__file__).parent.parent / "recipes"


def _oneshot(model, recipe, tokenizer, vocab=128, **kwargs):
    from llmcompressor import oneshot

    return oneshot(
        model=model,
        recipe=recipe,
        processor=tokenizer,
        dataset=make_dataset(calibration_samples(vocab, n=4, seed=2)),
        num_calibration_samples=4,
        **kwargs,
    )


@pytest.fixture
def k3(tmp_path):
    model, info = build_tiny("kimi_k3", seed=21)
    return save_and_reload(model, "kimi_k3", tmp_path / "k3-src"), info


def test_registered_with_llmcompressor_factory():
    from llmcompressor.modifiers.factory import ModifierFactory
    from llmcompressor.recipe import Recipe

    assert ModifierFactory._registered_registry["REAPPruningModifier"] is REAPPruningModifier
    recipe = Recipe.create_instance(str(RECIPES / "reap_keep_448.yaml"))
    (modifier,) = recipe.modifiers
    assert isinstance(modifier, REAPPruningModifier)
    assert (modifier.num_experts_to_keep, modifier.divisible_by) == (448, 8)


def test_yaml_recipe_runs_through_oneshot(k3, tokenizer, tmp_path, monkeypatch):
    model, info = k3
    monkeypatch.chdir(tmp_path)
    _oneshot(model, str(RECIPES / "reap_50.yaml"), tokenizer, output_dir=str(tmp_path / "dst"))
    cfg = model.config.text_config
    assert cfg.num_experts == 8
    scores = ExpertScores.load(tmp_path / "out/reap/scores.safetensors")
    assert scores.num_experts == info.num_experts and scores.total_tokens() == 4 * 12
    manifest = json.loads((tmp_path / "out/reap/pruning_manifest.json").read_text())
    report = json.loads((tmp_path / "out/reap/report.json").read_text())
    assert manifest["num_experts_before"] == 16 and manifest["num_experts_after"] == 8
    assert {k: v["kept_original_ids"] for k, v in manifest["layers"].items()} == report
    for layer, entry in manifest["layers"].items():
        assert entry["old_to_new"] == {str(old): new for new, old in enumerate(report[layer])}
        assert 0.0 < entry["retained_saliency_mass"] <= 1.0
    saved = json.loads((tmp_path / "dst/config.json").read_text())
    assert saved["text_config"]["num_experts"] == 8


def test_upstream_recipe_gives_upstream_report_shape(tmp_path, tokenizer, monkeypatch):
    """The same recipe text through upstream's modifier and ours: same JSON shape."""
    from llmcompressor.modifiers.pruning.reap import REAPPruningModifier as Upstream

    monkeypatch.chdir(tmp_path)
    text = (RECIPES / "upstream_compat.yaml").read_text()
    reports = {}
    for label, cls in (("ours", None), ("upstream", Upstream)):
        model, info = build_tiny("qwen3_moe", seed=22)
        model = save_and_reload(model, "qwen3_moe", tmp_path / f"src-{label}")
        if cls is None:
            recipe = text
        else:
            recipe = [
                cls(sparsity=0.25, ignore=["lm_head"], report_path="out/reap/retained_experts.json")
            ]
        _oneshot(model, recipe, tokenizer)
        reports[label] = json.loads(Path("out/reap/retained_experts.json").read_text())
    ours, upstream = reports["ours"], reports["upstream"]
    assert set(ours) == set(upstream)
    for layer in ours:
        assert (
            len(ours[layer])
            == len(upstream[layer])
            == info.num_experts - round(0.25 * info.num_experts)
        )
        assert all(isinstance(i, int) for i in ours[layer])
        assert ours[layer] == sorted(ours[layer])


# -- bad input: a clear message, raised before calibration, nothing written -----------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sparsity": 0.0}, "sparsity must be in (0, 1)"),
        ({"sparsity": 1.0}, "sparsity must be in (0, 1)"),
        ({"sparsity": 1.5}, "sparsity must be in (0, 1)"),
        ({"sparsity": 0.5, "num_experts_to_keep": 4}, "exactly one of"),
        ({}, "exactly one of"),
        ({"num_experts_to_keep": 0}, "num_experts_to_keep must be >= 1"),
        ({"sparsity": 0.5, "divisible_by": 0}, "divisible_by must be >= 1"),
        ({"sparsity": 0.5, "report_path": "r.txt"}, "report_path must end with .json"),
        ({"sparsity": 0.5, "scores_path": "s.pt"}, "scores_path must end with .safetensors"),
        ({"sparsity": 0.5, "saliency": "magic"}, "saliency"),
    ],
)
def test_invalid_fields_are_rejected_at_construction(kwargs, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        REAPPruningModifier(**kwargs)


def _outputs(tmp_path):
    return {
        "scores_path": str(tmp_path / "o/s.safetensors"),
        "manifest_path": str(tmp_path / "o/m.json"),
        "report_path": str(tmp_path / "o/r.json"),
    }


def _assert_nothing_written(tmp_path):
    assert not (tmp_path / "o").exists()
    dst = tmp_path / "dst"
    assert not any(dst.glob("*.safetensors")) if dst.exists() else True


@pytest.mark.parametrize(
    "family, overrides, kwargs, error, message",
    [
        ("kimi_k3", {}, {"num_experts_to_keep": 3}, PlanError, "fewer than top_k=4"),
        ("kimi_k3", {}, {"sparsity": 0.9}, PlanError, "fewer than top_k=4"),
        (
            "kimi_k3",
            {"num_expert_group": 4, "topk_group": 2},
            {"num_experts_to_keep": 4},
            PlanError,
            "only 2 experts are reachable",
        ),
        (
            "kimi_k3",
            {},
            {"num_experts_to_keep": 6, "divisible_by": 8},
            PlanError,
            "rounds down to 0",
        ),
        (
            "kimi_k3",
            {},
            {"sparsity": 0.5, "ignore": [r"layers\.1\."]},
            ValueError,
            "leave 1 MoE layers unpruned",
        ),
    ],
)
def test_bad_plans_fail_before_calibration(
    tmp_path, tokenizer, family, overrides, kwargs, error, message
):
    model, _ = build_tiny(family, seed=23, **overrides)
    model = save_and_reload(model, family, tmp_path / "src")
    modifier = REAPPruningModifier(**kwargs, **_outputs(tmp_path))
    with pytest.raises(error, match=message):
        _oneshot(model, [modifier], tokenizer, output_dir=str(tmp_path / "dst"))
    _assert_nothing_written(tmp_path)
    assert model.config.text_config.num_experts == 16  # untouched


def test_model_without_moe_names_its_class(tmp_path, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
        )
    )
    model.save_pretrained(tmp_path / "llama")
    model = LlamaForCausalLM.from_pretrained(tmp_path / "llama")
    with pytest.raises(NoMoEError, match="LlamaForCausalLM has no MoE layer"):
        _oneshot(model, [REAPPruningModifier(sparsity=0.5, **_outputs(tmp_path))], tokenizer)
    _assert_nothing_written(tmp_path)


def test_keep_count_truncates_the_drop_as_upstream():
    from reap_modifier.scores.keep_count import compute_keep_count

    # upstream drops int(100 * 0.29) = int(28.999999999999996) = 28
    assert compute_keep_count(100, 8, sparsity=0.29).keep == 72
    # 0.5 * 9 = 4.5 -> drop 4
    assert compute_keep_count(9, 2, sparsity=0.5).keep == 5
