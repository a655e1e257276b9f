"""``calibrate_router`` on ``REAPPruningModifier``: wiring, bit-exact save, reload, bad input.

Oracles: the saved expert tensors hash equal to the source's kept experts; every saved
tensor equals the in-memory model's, and the tensors whose bytes differ from the source's
kept rows are the routers (``reap verify`` names them and the reason); the reloaded
checkpoint's logits equal the in-memory fitted model's.
"""

from __future__ import annotations

import json

import pytest
import torch
from checkpoint_oracle import differs_from_source, saved_equals_memory
from conftest import calibration_samples, fresh_process_logits, make_dataset, save_and_reload
from mxfp4_fixtures import (
    build_mxfp4_checkpoint,
    kept_experts_are_source_bytes,
    tree_sha256,
)
from pydantic import ValidationError
from tiny_models import build_tiny, reload_class, sample_input_ids

from reap_modifier import REAPPruningModifier
from reap_modifier.checkpoint.verify import verify_checkpoint
from reap_modifier.post_cut import PostCutError


def _oneshot(model, modifier, tokenizer, data=True, **kwargs):
    from llmcompressor import oneshot

    if data:
        kwargs.update(
            dataset=make_dataset(calibration_samples(128, n=8, seq=32, seed=9)),
            num_calibration_samples=8,
        )
    oneshot(model=model, recipe=[modifier], processor=tokenizer, **kwargs)
    return modifier


@pytest.fixture(scope="module")
def k3_source(tmp_path_factory):
    """A grouped K3 (sigmoid router, score-correction bias, groups, routed scaling)."""
    root = tmp_path_factory.mktemp("routerfit")
    model, _ = build_tiny("kimi_k3", seed=21, grouped=True)
    return root, save_and_reload(model, "kimi_k3", root / "src"), root / "src"


def _check_fit(modifier, layers, tokens=200):
    fit = modifier.router_fit
    assert fit["method"] == "adam-layer-local" and fit["steps"] == 40
    assert sorted(fit["layers"]) == sorted(layers)
    for record in fit["layers"].values():
        assert record["holdout_after"] <= record["holdout_before"]
        assert record["loss_after"] < record["loss_before"]
        assert record["tokens"] == tokens
    return fit


@pytest.mark.parametrize("family", ["qwen3_moe", "kimi_k3"])
def test_calibrated_reap_then_router_fit(tmp_path, tokenizer, family):
    model, _ = build_tiny(family, seed=21, **({"grouped": True} if family == "kimi_k3" else {}))
    model = save_and_reload(model, family, tmp_path / "src")
    manifest = tmp_path / "m.json"
    modifier = REAPPruningModifier(
        sparsity=0.5,
        calibrate_router=True,
        validate_fit=False,
        router_fit_tokens=10_000,
        router_fit_steps=40,
        manifest_path=str(manifest),
    )
    _oneshot(model, modifier, tokenizer)
    # every calibration token once: the sequential pipeline's propagation pass (hooks
    # disabled) records nothing
    fit = _check_fit(modifier, modifier.plan.kept, tokens=8 * 32)
    assert json.loads(manifest.read_text())["router_fit"] == fit
    # the in-memory routers hold the fitted rows
    for name, tensors in modifier._fitted_tensors.items():
        block = model.get_submodule(name)
        for rel, tensor in tensors.items():
            assert torch.equal(block.get_submodule(rel.rsplit(".", 1)[0]).weight, tensor)


def test_plan_in_cuts_after_calibration_then_fits(k3_source, tokenizer, tmp_path):
    root, model, src = k3_source
    first = _oneshot(model, REAPPruningModifier(sparsity=0.5), tokenizer)
    first.plan.save(tmp_path / "plan.json")
    fresh = reload_class("kimi_k3").from_pretrained(src).eval()
    modifier = REAPPruningModifier(
        plan_in=str(tmp_path / "plan.json"),
        calibrate_router=True,
        validate_fit=False,
        router_fit_tokens=200,
        router_fit_steps=40,
    )
    assert modifier.requires_calibration_data
    _oneshot(fresh, modifier, tokenizer)
    assert modifier.plan.kept == first.plan.kept
    _check_fit(modifier, first.plan.kept)
    assert fresh.config.text_config.num_experts == 8


def test_scores_in_cut_to_another_tier_then_fit(k3_source, tokenizer, tmp_path):
    """Scores measured once on the unpruned model, cut to a tier (12 of 16 kept, 3 per
    group), then the routers fitted for that tier."""
    from reap_modifier.scores import ExpertScores
    from reap_modifier.scores.plan import plan_from_scores

    _, _, src = k3_source
    scores = tmp_path / "s.safetensors"
    model = reload_class("kimi_k3").from_pretrained(src).eval()
    _oneshot(model, REAPPruningModifier(sparsity=0.5, scores_path=str(scores)), tokenizer)
    fresh = reload_class("kimi_k3").from_pretrained(src).eval()
    modifier = REAPPruningModifier(
        num_experts_to_keep=12,
        scores_in=str(scores),
        calibrate_router=True,
        validate_fit=False,
        router_fit_tokens=200,
        router_fit_steps=40,
    )
    _oneshot(fresh, modifier, tokenizer)
    expected = plan_from_scores(ExpertScores.load(scores), num_experts_to_keep=12)
    assert modifier.plan.kept == expected.kept
    _check_fit(modifier, expected.kept)


def test_mxfp4_experts_bit_exact_router_fitted_and_reload_equal(tmp_path, tokenizer):
    fixture = build_mxfp4_checkpoint("kimi_k3", tmp_path / "src", grouped=True)
    src, dst = fixture.path, tmp_path / "dst"
    before = tree_sha256(src)
    model = reload_class("kimi_k3").from_pretrained(src)
    modifier = REAPPruningModifier(
        sparsity=0.5,
        calibrate_router=True,
        validate_fit=False,
        router_fit_tokens=200,
        router_fit_steps=40,
    )
    _oneshot(model, modifier, tokenizer, output_dir=str(dst))
    plan = modifier.plan
    assert tree_sha256(src) == before, "the source checkpoint changed"
    _check_fit(modifier, plan.kept)

    # every kept expert tensor: the source bytes
    experts = kept_experts_are_source_bytes(src, dst, plan.kept)
    assert experts == len(plan.kept) * 8 * 3 * 2  # layers x kept x w1/w2/w3 x packed+scale

    # every saved tensor is the in-memory model's; only the router rows differ from the
    # source's kept rows, and reap verify names them and says why
    assert saved_equals_memory(model, dst) > experts
    fitted = differs_from_source(src, dst, plan.kept)
    assert fitted == sorted(f"{layer}.gate.weight" for layer in plan.kept)
    report = verify_checkpoint(dst, source=src)
    assert report.ok, report.summary()
    assert sorted(report.info["differs_from_source"]) == fitted
    assert all(
        "router fitted after the cut" in why for why in report.info["differs_from_source"].values()
    )
    manifest = json.loads((dst / "pruning_manifest.json").read_text())
    assert manifest["router_fit"]["layers"].keys() == plan.kept.keys()
    replaced = manifest["checkpoint"]["replaced_tensors"]
    assert sorted(replaced) == sorted(fitted)

    # a tampered router is caught: neither the source's nor the recorded bytes
    name = sorted(fitted)[0]
    replaced[name]["sha256"] = "0" * 64
    (dst / "pruning_manifest.json").write_text(json.dumps(manifest))
    bad = verify_checkpoint(dst, source=src)
    assert not bad.ok and any(name in f for f in bad.failures)

    # reload in a fresh process: logits equal the in-memory fitted model's
    ids = sample_input_ids(128, batch=1, seq=12, seed=2)
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
    reloaded = fresh_process_logits("kimi_k3", dst, ids, tmp_path / "reloaded.pt")
    torch.testing.assert_close(reloaded, expected, rtol=0, atol=0)


# -- bad input: refused before calibration ---------------------------------------------


def test_router_fit_options_need_calibrate_router():
    with pytest.raises(
        ValidationError,
        match="only apply with `calibrate_router`, `calibrate_bias` or `compensate`",
    ):
        REAPPruningModifier(sparsity=0.5, router_fit_steps=10)


def test_no_calibration_data(k3_source, tokenizer, tmp_path):
    root, _, src = k3_source
    plan_file = tmp_path / "plan.json"
    model = reload_class("kimi_k3").from_pretrained(src).eval()
    _oneshot(model, REAPPruningModifier(sparsity=0.5), tokenizer).plan.save(plan_file)
    fresh = reload_class("kimi_k3").from_pretrained(src).eval()
    modifier = REAPPruningModifier(
        plan_in=str(plan_file), calibrate_router=True, validate_fit=False
    )
    with pytest.raises(ValueError, match="oneshot got none: pass a dataset"):
        _oneshot(fresh, modifier, tokenizer, data=False)
    assert fresh.config.text_config.num_experts == 16  # nothing was cut


def test_router_the_adapter_cannot_express(k3_source, tokenizer):
    _, _, src = k3_source
    model = reload_class("kimi_k3").from_pretrained(src).eval()
    gate = model.language_model.model.layers[1].block_sparse_moe.gate
    gate.moe_router_activation_func = "tanh"
    modifier = REAPPruningModifier(sparsity=0.5, calibrate_router=True, validate_fit=False)
    with pytest.raises(
        PostCutError, match=r"layers\.1\.block_sparse_moe: router activation 'tanh'"
    ):
        _oneshot(model, modifier, tokenizer)
    assert model.config.text_config.num_experts == 16


def test_another_modifier_changing_the_routers(k3_source, tokenizer):
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    _, _, src = k3_source
    model = reload_class("kimi_k3").from_pretrained(src).eval()
    quant = QuantizationModifier(targets=["re:.*block_sparse_moe\\.gate$"], scheme="W8A16")
    modifier = REAPPruningModifier(sparsity=0.5, calibrate_router=True, validate_fit=False)
    with pytest.raises(ValueError, match="QuantizationModifier in the recipe also changes them"):
        oneshot(
            model=model,
            recipe=[modifier, quant],
            processor=tokenizer,
            dataset=make_dataset(calibration_samples(128, n=2, seed=9)),
            num_calibration_samples=2,
        )


def test_disk_offloaded_model(tmp_path, tokenizer):
    """compressed-tensors disk offload + sequential pipeline: the fit onloads one layer,
    and the fitted rows are what the offloaded router holds afterwards."""
    from compressed_tensors.offload import load_offloaded_model
    from compressed_tensors.offload.cache.disk import DiskCache

    fixture = build_mxfp4_checkpoint("kimi_k3", tmp_path / "src", grouped=True)
    cls = reload_class("kimi_k3")
    with load_offloaded_model(cls):
        model = cls.from_pretrained(
            fixture.path,
            device_map="auto_offload",
            max_memory={"cpu": 200_000},
            offload_folder=str(tmp_path / "offload"),
        )
    routers = [model.language_model.model.layers[i].block_sparse_moe.gate for i in (1, 2)]
    assert any(isinstance(r._parameters, DiskCache) for r in routers), "routers not offloaded"
    modifier = REAPPruningModifier(
        sparsity=0.5,
        calibrate_router=True,
        validate_fit=False,
        router_fit_tokens=200,
        router_fit_steps=40,
    )
    _oneshot(model, modifier, tokenizer)
    _check_fit(modifier, modifier.plan.kept)
    for name, tensors in modifier._fitted_tensors.items():
        gate = model.get_submodule(f"{name}.gate")
        assert torch.equal(gate.weight.to("cpu"), tensors["gate.weight"])
