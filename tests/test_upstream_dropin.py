"""Drop-in behaviour against llm-compressor's own ``REAPPruningModifier``, run in the
same test: ``propagate_pruned`` keeps upstream's experts, the default keeps upstream's
with ``propagate_error=False``, a sparsity that drops nothing is refused by both at
initialize, and both take lifecycle events without ``modules``."""

from __future__ import annotations

import pytest
from conftest import calibration_samples, make_dataset, save_and_reload
from llmcompressor.core import Event, EventType, State
from llmcompressor.modifiers.pruning.reap.base import REAPPruningModifier as UpstreamREAP
from tiny_models import build_tiny
from typer.testing import CliRunner

from reap_modifier import REAPPruningModifier
from reap_modifier.cli import app
from reap_modifier.scores import ExpertScores
from reap_modifier.scores.plan import PlanError, plan_from_scores


def _model(seed, tmp_path, tag):
    model, _ = build_tiny("qwen3_moe", seed=seed, num_hidden_layers=4, num_experts=16)
    return save_and_reload(model, "qwen3_moe", tmp_path / f"{tag}{seed}")


def _oneshot(model, modifier, tokenizer, seed, **kwargs):
    from llmcompressor import oneshot

    data = make_dataset(calibration_samples(128, n=16, seq=32, seed=seed))
    oneshot(
        model=model,
        recipe=[modifier],
        processor=tokenizer,
        dataset=data,
        num_calibration_samples=16,
        **kwargs,
    )
    return modifier


def _upstream_kept(seed, tmp_path, tokenizer, **kwargs):
    up = _oneshot(
        _model(seed, tmp_path, "up"), UpstreamREAP(sparsity=0.5), tokenizer, seed, **kwargs
    )
    return up._retained_experts


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_propagate_pruned_keeps_upstreams_experts(seed, tmp_path, tokenizer):
    theirs = _upstream_kept(seed, tmp_path, tokenizer)
    scores_path = tmp_path / "p.safetensors"
    model = _model(seed, tmp_path, "ours")
    ours = _oneshot(
        model,
        REAPPruningModifier(sparsity=0.5, propagate_pruned=True, scores_path=str(scores_path)),
        tokenizer,
        seed,
    )
    assert ours.plan.kept == theirs
    assert model.config.num_experts == 8
    assert ours.plan.params["propagate_pruned"] is True
    record = ExpertScores.load(scores_path).metadata["propagate_pruned"]
    assert record == {"keep": 8, "saliency": "reap", "epochs": 4}
    # the default observes every layer on the unpruned model: the first layer agrees,
    # later ones need not
    default = _oneshot(
        _model(seed, tmp_path, "dflt"), REAPPruningModifier(sparsity=0.5), tokenizer, seed
    )
    first = "model.layers.0.mlp"
    assert default.plan.kept[first] == theirs[first]
    if seed == 0:  # the seed the difference was first seen with
        assert default.plan.kept["model.layers.1.mlp"] != theirs["model.layers.1.mlp"]


def test_default_keeps_upstreams_experts_without_error_propagation(tmp_path, tokenizer):
    theirs = _upstream_kept(0, tmp_path, tokenizer, propagate_error=False)
    for propagate in (False, True):
        ours = _oneshot(
            _model(0, tmp_path, f"o{propagate}"),
            REAPPruningModifier(sparsity=0.5, propagate_pruned=propagate),
            tokenizer,
            0,
            propagate_error=False,
        )
        assert ours.plan.kept == theirs


def test_propagate_pruned_with_the_basic_pipeline_is_the_default_cut(tmp_path, tokenizer):
    kept = {}
    for propagate in (False, True):
        path = tmp_path / f"s{propagate}.safetensors"
        mod = REAPPruningModifier(sparsity=0.5, propagate_pruned=propagate, scores_path=str(path))
        _oneshot(_model(1, tmp_path, f"b{propagate}"), mod, tokenizer, 1, pipeline="basic")
        kept[propagate] = mod.plan.kept
        # one epoch for the whole model: nothing was observed after a cut
        assert ExpertScores.load(path).metadata["propagate_pruned"] is None
    assert kept[True] == kept[False]


def test_propagated_scores_are_cut_only_at_their_own_count(tmp_path, tokenizer):
    path = tmp_path / "p.safetensors"
    mod = _oneshot(
        _model(0, tmp_path, "p"),
        REAPPruningModifier(sparsity=0.5, propagate_pruned=True, scores_path=str(path)),
        tokenizer,
        0,
    )
    scores = ExpertScores.load(path)
    assert plan_from_scores(scores, num_experts_to_keep=8).kept == mod.plan.kept
    with pytest.raises(PlanError, match="calibrated with propagate_pruned.*cut to 8 experts"):
        plan_from_scores(scores, num_experts_to_keep=12)
    with pytest.raises(PlanError, match="only for that cut"):
        plan_from_scores(scores, sparsity=0.5, saliency="frequency")
    result = CliRunner().invoke(
        app, ["cut", str(path), "--keep", "4", "-o", str(tmp_path / "x.json")]
    )
    assert result.exit_code == 2 and "propagate_pruned" in result.output
    assert not (tmp_path / "x.json").exists()
    # scores_in: refused at initialize, before the model changes
    model = _model(0, tmp_path, "in")
    with pytest.raises(PlanError, match=f"scores_in {path}: .*propagate_pruned"):
        _oneshot(model, REAPPruningModifier(sparsity=0.25, scores_in=str(path)), tokenizer, 0)
    assert model.config.num_experts == 16
    same = _oneshot(
        _model(0, tmp_path, "in2"),
        REAPPruningModifier(sparsity=0.5, scores_in=str(path)),
        tokenizer,
        0,
    )
    assert same.plan.kept == mod.plan.kept


def test_propagate_pruned_needs_calibration(tmp_path):
    with pytest.raises(ValueError, match="nothing is calibrated; remove propagate_pruned"):
        REAPPruningModifier(sparsity=0.5, saliency="router_l1", propagate_pruned=True)


def test_a_sparsity_that_drops_nothing_is_refused_at_initialize(tmp_path, tokenizer, monkeypatch):
    with pytest.raises(ValueError, match="0 experts to drop"):
        _oneshot(_model(0, tmp_path, "u"), UpstreamREAP(sparsity=0.05), tokenizer, 0)
    model = _model(0, tmp_path, "o")
    calls = []
    monkeypatch.setattr(
        REAPPruningModifier, "on_calibration_start", lambda *a, **k: calls.append(1)
    )
    mod = REAPPruningModifier(sparsity=0.05)  # int(16 x 0.05) = 0
    with pytest.raises(PlanError, match=r"drops int\(16 x 0.05\) = 0 of 16 experts"):
        _oneshot(model, mod, tokenizer, 0)
    assert calls == [] and model.config.num_experts == 16


@pytest.mark.parametrize("propagate", [False, True])
def test_lifecycle_events_without_modules(tmp_path, propagate):
    """Driven as upstream's own tests drive a modifier: no ``modules`` argument."""
    events = [
        EventType.CALIBRATION_START,
        EventType.SEQUENTIAL_EPOCH_END,
        EventType.CALIBRATION_END,
    ]
    for cls, kwargs in (
        (UpstreamREAP, {}),
        (REAPPruningModifier, {"propagate_pruned": propagate}),
    ):
        model = _model(0, tmp_path, cls.__module__.split(".")[0] + str(propagate))
        from llmcompressor.modeling.moe.linearize import linearize_moe

        linearize_moe(model)
        state = State(model=model)
        modifier = cls(sparsity=0.5, **kwargs)
        modifier.initialize(state)
        for i, event in enumerate(events):
            if i == 1:  # one calibration forward between start and the epoch end
                model(input_ids=calibration_samples(128, n=1, seq=16)[0].unsqueeze(0))
            modifier.update_event(state, Event(type_=event))
        modifier.finalize(state)
        assert model.config.num_experts == 8, cls
