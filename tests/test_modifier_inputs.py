"""Modifier without calibration: ``scores_in``, ``plan_in`` and the weight baselines."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import calibration_samples, make_dataset, save_and_reload
from pydantic import ValidationError
from tiny_models import build_tiny, reload_class

from reap_modifier import REAPPruningModifier
from reap_modifier.scores import ExpertScores
from reap_modifier.scores.keep_count import compute_keep_count
from reap_modifier.scores.plan import PruningPlan, plan_from_scores


def _oneshot(model, modifier, tokenizer, data=True):
    from llmcompressor import oneshot

    kwargs = {}
    if data:
        kwargs = dict(
            dataset=make_dataset(calibration_samples(128, n=6, seed=9)), num_calibration_samples=6
        )
    oneshot(model=model, recipe=[modifier], processor=tokenizer, **kwargs)
    return modifier


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, tokenizer):
    """K3 source checkpoint + the scores and plan of one calibration run."""
    root = tmp_path_factory.mktemp("inputs")
    model, _ = build_tiny("kimi_k3", seed=41)
    src = root / "src"
    model = save_and_reload(model, "kimi_k3", src)
    modifier = _oneshot(
        model, REAPPruningModifier(sparsity=0.5, scores_path=str(root / "s.safetensors")), tokenizer
    )
    modifier.plan.save(root / "plan.json")
    return root, src, modifier.plan


def _fresh(src):
    return reload_class("kimi_k3").from_pretrained(src).eval()


def test_scores_in_reproduces_the_calibrated_cut_without_data(calibrated, tokenizer):
    root, src, plan = calibrated
    model = _fresh(src)
    modifier = REAPPruningModifier(sparsity=0.5, scores_in=str(root / "s.safetensors"))
    assert modifier.requires_calibration_data is False
    _oneshot(model, modifier, tokenizer, data=False)
    assert modifier.plan.kept == plan.kept
    assert model.config.text_config.num_experts == 8


def test_scores_in_cuts_another_tier(calibrated, tokenizer):
    root, src, _ = calibrated
    scores = ExpertScores.load(root / "s.safetensors")
    expected = plan_from_scores(scores, num_experts_to_keep=12)
    model = _fresh(src)
    modifier = _oneshot(
        model,
        REAPPruningModifier(num_experts_to_keep=12, scores_in=str(root / "s.safetensors")),
        tokenizer,
        data=False,
    )
    assert modifier.plan.kept == expected.kept
    assert all(len(v) == 12 for v in modifier.plan.kept.values())


def test_plan_in_applies_the_plan(calibrated, tokenizer, tmp_path):
    root, src, plan = calibrated
    model = _fresh(src)
    manifest = tmp_path / "m.json"
    modifier = _oneshot(
        model,
        REAPPruningModifier(plan_in=str(root / "plan.json"), manifest_path=str(manifest)),
        tokenizer,
        data=False,
    )
    assert modifier.plan.kept == plan.kept
    layer = model.language_model.model.layers[1].block_sparse_moe
    assert len(layer.experts) == 8 and layer.gate.weight.shape[0] == 8
    data = json.loads(manifest.read_text())
    assert "plan" in data["method"]


@pytest.mark.parametrize("method", ["router_l1", "router_signed_sum", "random"])
def test_weight_baselines_rank_by_router_rows(calibrated, tokenizer, method, tmp_path):
    _, src, _ = calibrated
    model = _fresh(src)
    layers = {
        f"language_model.model.layers.{i}.block_sparse_moe": model.language_model.model.layers[
            i
        ].block_sparse_moe
        for i in (1, 2)
    }
    rows = {name: block.gate.weight.detach().double().clone() for name, block in layers.items()}
    modifier = REAPPruningModifier(
        sparsity=0.5, saliency=method, seed=3, scores_path=str(tmp_path / "w.safetensors")
    )
    assert modifier.requires_calibration_data is False
    _oneshot(model, modifier, tokenizer, data=False)
    for name, w in rows.items():
        if method == "router_l1":
            score = w.abs().sum(-1)
        elif method == "router_signed_sum":
            score = w.sum(-1)
        else:
            continue
        expected = sorted(torch.argsort(-score, stable=True)[:8].tolist())
        assert modifier.plan.kept[name] == expected
    saved = ExpertScores.load(tmp_path / "w.safetensors")
    assert saved.metadata["kind"] == "weights" and saved.metadata["method"] == method
    if method == "random":  # seeded: the same cut twice
        again = _oneshot(
            _fresh(src),
            REAPPruningModifier(sparsity=0.5, saliency="random", seed=3),
            tokenizer,
            data=False,
        )
        assert again.plan.kept == modifier.plan.kept


def test_scores_from_another_model_are_refused(calibrated, tokenizer, tmp_path):
    root, _, _ = calibrated
    other, _ = build_tiny("kimi_k3", seed=99)
    other = save_and_reload(other, "kimi_k3", tmp_path / "other")
    with pytest.raises(ValueError, match="model_fingerprint mismatch"):
        _oneshot(
            other,
            REAPPruningModifier(sparsity=0.5, scores_in=str(root / "s.safetensors")),
            tokenizer,
            data=False,
        )
    assert other.config.text_config.num_experts == 16


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"plan_in": "PLAN", "sparsity": 0.5}, "plan_in fixes the kept experts; remove sparsity"),
        ({"scores_in": "nope.safetensors", "sparsity": 0.5}, "does not exist"),
        (
            {"scores_in": "SCORES", "sparsity": 0.5, "saliency": "router_l1"},
            "computed from router weights",
        ),
        (
            {"scores_in": "SCORES", "sparsity": 0.5, "scores_path": "x.safetensors"},
            "nothing is calibrated",
        ),
    ],
)
def test_invalid_input_combinations(calibrated, kwargs, message):
    root, _, _ = calibrated
    subst = {"PLAN": str(root / "plan.json"), "SCORES": str(root / "s.safetensors")}
    kwargs = {k: subst.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(ValidationError, match=message):
        REAPPruningModifier(**kwargs)


def test_plan_from_scores_uses_the_modifier_keep_rule(calibrated):
    root, _, plan = calibrated
    scores = ExpertScores.load(root / "s.safetensors")
    keep = compute_keep_count(16, 4, sparsity=0.5)
    assert (
        PruningPlan.from_saliency(scores.saliency("reap"), keep, criterion="reap").kept == plan.kept
    )
