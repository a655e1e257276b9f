"""The post-cut step on ``REAPPruningModifier``: held-out validation keeps a fitted
component only where it lowers KL, compensation saves bit-exact experts and reloads equal.

Oracles: the router rows after a dropped fit are the source's kept rows, compared
tensor by tensor; the held-out KL the record reports is recomputed here from the
model's logits on the held-out batches (every 8th calibration batch); saved expert
tensors hash equal to the source's kept experts; every saved tensor equals the in-memory
model's, and the tensors that differ from the source are found by comparing bytes
(:mod:`checkpoint_oracle`); the reloaded checkpoint's logits equal the in-memory model's;
the block-error selection's errors are the masked-routing oracle's
(:mod:`generic_oracle`) on the rows the selection was given.
"""

from __future__ import annotations

import json

import pytest
import torch
from bias_oracle import BiasOracle
from checkpoint_oracle import differs_from_source, saved_equals_memory
from conftest import calibration_samples, fresh_process_logits, make_dataset
from generic_oracle import masked_block_errors
from mxfp4_fixtures import (
    build_mxfp4_checkpoint,
    kept_experts_are_source_bytes,
    load_tensors,
    tree_sha256,
)
from pydantic import ValidationError
from tiny_models import reload_class, sample_input_ids

from reap_modifier import REAPPruningModifier
from reap_modifier.checkpoint.verify import verify_checkpoint
from reap_modifier.checkpoint.verify_manifest import post_cut_lines

SAMPLES = calibration_samples(128, n=16, seq=32, seed=9)


def _oneshot(model, modifier, tokenizer, **kwargs):
    from llmcompressor import oneshot

    oneshot(
        model=model,
        recipe=[modifier],
        processor=tokenizer,
        dataset=make_dataset(SAMPLES),
        num_calibration_samples=len(SAMPLES),
        shuffle_calibration_samples=False,
        **kwargs,
    )
    return modifier


def _held_out_kl(reference_logits, model, held):
    total, count = 0.0, 0
    with torch.no_grad():
        for ref, ids in zip(reference_logits, held, strict=True):
            now = model(input_ids=ids, use_cache=False).logits.float().log_softmax(-1)
            ref = ref.float().log_softmax(-1)
            total += (ref.exp() * (ref - now)).sum().item()
            count += ids.numel()
    return total / count


def test_a_fit_that_does_not_help_is_dropped_and_reported(tmp_path, tokenizer, monkeypatch):
    """A router fit that makes the model worse end to end (here: rows that reverse every
    logit) is put back, and the record, the log and the manifest say so."""
    from dataclasses import replace

    from reap_modifier.post_cut.components import COMPONENT

    def reversed_rows(layer, x, y, settings):
        return {f"{layer.router_attr}.weight": -3.0 * layer.router.weight.detach().clone()}, {
            "fake": True
        }

    monkeypatch.setitem(COMPONENT, "router", replace(COMPONENT["router"], fit=reversed_rows))
    fixture = build_mxfp4_checkpoint("kimi_k3", tmp_path / "src", grouped=True)
    source = reload_class("kimi_k3").from_pretrained(fixture.path)
    model = reload_class("kimi_k3").from_pretrained(fixture.path)
    manifest = tmp_path / "m.json"
    modifier = REAPPruningModifier(
        sparsity=0.5, calibrate_router=True, router_fit_tokens=4096, manifest_path=str(manifest)
    )
    _oneshot(model, modifier, tokenizer)
    record = modifier.router_fit
    (router,) = record["components"]
    assert router["name"] == "router" and router["kept"] is False
    assert router["kl_after"] > router["kl_before"] == record["validation"]["kl_cut"]
    assert record["validation"]["batches"] == 2  # batches 7 and 15 of 16
    assert record["validation"]["kl_final"] == record["validation"]["kl_cut"]
    assert modifier._fitted_tensors == {}
    for layer, kept in modifier.plan.kept.items():
        now = model.get_submodule(f"{layer}.gate.weight".rsplit(".", 1)[0]).weight
        was = source.get_submodule(f"{layer}.gate").weight[kept]
        assert torch.equal(now, was), layer
    assert json.loads(manifest.read_text())["router_fit"]["components"][0]["kept"] is False
    # each stage's wall time, disjoint parts of the whole step's
    seconds = json.loads(manifest.read_text())["router_fit"]["seconds"]
    assert seconds == record["seconds"]
    stages = {"gather", "reference", "cut_check", "router", "router_check"}
    assert set(seconds) == stages | {"total"}
    assert 0 < sum(seconds[s] for s in stages) <= seconds["total"] + 1e-3


def test_compensation_kept_experts_bit_exact_and_reload_equal(tmp_path, tokenizer):
    fixture = build_mxfp4_checkpoint("kimi_k3", tmp_path / "src", grouped=True)
    src, dst = fixture.path, tmp_path / "dst"
    before = tree_sha256(src)
    unpruned = reload_class("kimi_k3").from_pretrained(src).eval()
    model = reload_class("kimi_k3").from_pretrained(src)
    modifier = REAPPruningModifier(
        sparsity=0.5,
        calibrate_router=True,
        compensate=True,
        router_fit_tokens=4096,
        router_fit_steps=40,
        compensation_steps=40,
    )
    _oneshot(model, modifier, tokenizer, output_dir=str(dst))
    plan, record = modifier.plan, modifier.router_fit
    assert tree_sha256(src) == before, "the source checkpoint changed"
    assert [c["name"] for c in record["components"]] == ["router", "dense"]

    # the recorded held-out KL is the model's: recomputed on batches 7 and 15
    held = [SAMPLES[i].unsqueeze(0) for i in (7, 15)]
    with torch.no_grad():
        reference = [unpruned(input_ids=ids, use_cache=False).logits for ids in held]
    final = record["validation"]["kl_final"]
    # (the modifier computes through its packed-expert overlay, this forward through the
    # loaded model's own dequantization: equal to 1%, while other held-out batches differ
    # several-fold)
    assert _held_out_kl(reference, model, held) == pytest.approx(final, rel=1e-2)
    kept = [c for c in record["components"] if c["kept"]]
    assert final < record["validation"]["kl_cut"] and kept

    # routed experts: the source bytes; every saved tensor: the in-memory model's
    experts = kept_experts_are_source_bytes(src, dst, plan.kept)
    assert experts == len(plan.kept) * 8 * 3 * 2
    assert saved_equals_memory(model, dst) > 40  # every tensor but the decompressed experts
    differs = differs_from_source(src, dst, plan.kept)
    if any(c["name"] == "dense" for c in kept):
        assert any(".shared_experts." in n for n in differs)
    assert differs and not any(".experts." in n for n in differs)
    report = verify_checkpoint(dst, source=src)
    assert report.ok, report.summary()
    assert sorted(report.info["differs_from_source"]) == differs
    lines = report.info["post_cut_fit"]
    assert [line.split(":")[0] for line in lines] == ["router", "dense"]
    for line, c in zip(lines, record["components"], strict=True):
        assert ("kept;" in line) == c["kept"] and f"{c['kl_after']:.5g}" in line

    ids = sample_input_ids(128, batch=1, seq=12, seed=2)
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
    reloaded = fresh_process_logits("kimi_k3", dst, ids, tmp_path / "reloaded.pt")
    torch.testing.assert_close(reloaded, expected, rtol=0, atol=0)


def test_compensation_options_need_compensate():
    with pytest.raises(ValidationError, match="only apply with `compensate: true`"):
        REAPPruningModifier(sparsity=0.5, calibrate_router=True, compensation_steps=3)
    with pytest.raises(ValidationError, match="validate_fit only apply with"):
        REAPPruningModifier(sparsity=0.5, validate_fit=False)


def test_compensation_needs_a_shared_expert(tmp_path, tokenizer):
    from conftest import save_and_reload
    from tiny_models import build_tiny

    model, _ = build_tiny("qwen3_moe", seed=3)
    model = save_and_reload(model, "qwen3_moe", tmp_path / "src")
    modifier = REAPPruningModifier(sparsity=0.5, compensate=True)
    with pytest.raises(ValueError, match="no shared expert or latent projection"):
        _oneshot(model, modifier, tokenizer)


def test_spilled_capture_gives_the_same_fit(tmp_path, tokenizer, monkeypatch):
    """``fit_spill_dir``: the captured rows go to disk and come back the same, so the fit is
    the in-memory fit, tensor for tensor; no stage holds more than one layer's rows at a
    time (every layer's rows read back are released before the next is read); the spill
    files are gone afterwards, and after a run that fails."""
    import weakref

    from reap_modifier.post_cut.rows import RowStore

    alive, most = [], [0]
    read = RowStore.rows

    def tracked(self, name):
        x, y = read(self, name)
        if self.dir is not None:
            alive[:] = [r for r in alive if r() is not None]
            alive.append(weakref.ref(x))
            most[0] = max(most[0], len(alive))
        return x, y

    monkeypatch.setattr(RowStore, "rows", tracked)
    fixture = build_mxfp4_checkpoint("kimi_k3", tmp_path / "src", grouped=True)
    fitted = []
    for spill in (None, tmp_path / "spill"):
        model = reload_class("kimi_k3").from_pretrained(fixture.path)
        modifier = REAPPruningModifier(
            sparsity=0.5,
            calibrate_router=True,
            compensate=True,
            compensation_steps=2,
            router_fit_steps=10,
            validate_fit=False,
            **({"fit_spill_dir": str(spill)} if spill else {}),
        )
        _oneshot(model, modifier, tokenizer)
        fitted.append(modifier._fitted_tensors)
    assert fitted[0].keys() == fitted[1].keys() and fitted[0]
    for layer, named in fitted[0].items():
        for name, tensor in named.items():
            assert torch.equal(tensor, fitted[1][layer][name]), (layer, name)
    assert most[0] == 1, f"{most[0]} layers' rows were alive at once"
    assert not any(p.is_file() for p in (tmp_path / "spill").rglob("*"))

    # a fit that fails mid-way leaves no spilled rows behind either
    from dataclasses import replace

    from reap_modifier.post_cut.components import COMPONENT

    def failing(layer, x, y, settings):
        raise RuntimeError("fit failed")

    monkeypatch.setitem(COMPONENT, "router", replace(COMPONENT["router"], fit=failing))
    model = reload_class("kimi_k3").from_pretrained(fixture.path)
    modifier = REAPPruningModifier(
        sparsity=0.5, calibrate_router=True, validate_fit=False, fit_spill_dir=str(tmp_path / "s2")
    )
    with pytest.raises(RuntimeError, match="fit failed"):
        _oneshot(model, modifier, tokenizer)
    assert not any(p.is_file() for p in (tmp_path / "s2").rglob("*"))


def _selection_with_oracle(monkeypatch):
    """Wrap the block-error selection: on the rows and the unpruned block it is given,
    the masked-routing oracle's error of the search's own set (the same search without
    the baseline) and of the baseline; ``{layer: (search set, search error, baseline
    error)}``."""
    from reap_modifier.post_cut import block_selection

    real, seen = block_selection.select_by_block_error, {}

    def spy(layer, inputs, targets, keep, *, baseline=None, **kwargs):
        search, _ = real(layer, inputs, targets, keep, **kwargs)
        groups = torch.zeros(inputs.shape[0], dtype=torch.long)
        (search_error,) = masked_block_errors(
            layer.block, "kimi_k3", inputs, targets, search, groups
        )
        (base_error,) = masked_block_errors(
            layer.block, "kimi_k3", inputs, targets, baseline, groups
        )
        seen[layer.name] = (search, search_error, base_error)
        return real(layer, inputs, targets, keep, baseline=baseline, **kwargs)

    monkeypatch.setattr(block_selection, "select_by_block_error", spy)
    return seen


def test_block_error_selection_rechooses_the_kept_experts(tmp_path, tokenizer, monkeypatch):
    """``selection: block_error``: the same keep count per layer, experts chosen by the block's
    re-routed output error; each layer keeps REAP's cut exactly when the masked-routing
    oracle finds the search's set no better, and the record's errors are the oracle's. Then
    the selection is scored end to end against REAP's cut on the held-out batches: here it
    wins layer by layer but loses end to end, so REAP's cut is applied, and the record, the
    plan and the manifest say so. The two KLs are recomputed with the masked-routing oracle."""
    from oracles import masked_routing

    fixture = build_mxfp4_checkpoint("kimi_k3", tmp_path / "src", grouped=True)
    source = reload_class("kimi_k3").from_pretrained(fixture.path).eval()
    reap = _oneshot(
        reload_class("kimi_k3").from_pretrained(fixture.path),
        REAPPruningModifier(sparsity=0.5),
        tokenizer,
    )
    manifest = tmp_path / "m.json"
    model = reload_class("kimi_k3").from_pretrained(fixture.path)
    modifier = REAPPruningModifier(
        sparsity=0.5,
        selection="block_error",
        selection_candidates=None,
        manifest_path=str(manifest),
    )
    oracle = _selection_with_oracle(monkeypatch)
    # the selection evaluates cached expert outputs, the oracle the bf16 block's own forward
    tol = 3e-3
    _oneshot(model, modifier, tokenizer, output_dir=str(tmp_path / "dst"))
    selection = modifier.router_fit["selection"]
    assert selection["method"] == "block_error" and set(selection["layers"]) == set(reap.plan.kept)
    searched = {n: rec["kept"] for n, rec in selection["layers"].items()}
    assert {k: len(v) for k, v in searched.items()} == dict.fromkeys(reap.plan.kept, 8)
    differs = sum(len(set(searched[n]) - set(reap.plan.kept[n])) for n in searched)
    assert selection["differs_from_ranking"] == differs > 0
    assert selection["objective"] == "pooled" and selection["groups"] is None
    # a layer keeps REAP's cut exactly when the oracle finds the search's set no better
    assert sorted(oracle) == sorted(searched)
    for name, rec in selection["layers"].items():
        search, search_error, base_error = oracle[name]
        assert rec["search_objective"] == pytest.approx(search_error, rel=tol)
        assert rec["baseline_objective"] == pytest.approx(base_error, rel=tol)
        if abs(search_error - base_error) > 4 * tol * base_error:  # (no near-tie to decide)
            assert rec["kept_baseline"] == (base_error < search_error), name
        assert rec["kept_baseline"] == (name in selection["layers_keeping_ranking_cut"])
        assert searched[name] == (reap.plan.kept[name] if rec["kept_baseline"] else search)
        assert rec["objective"] == pytest.approx(min(search_error, base_error), rel=tol)

    # end to end, on the held-out batches 7 and 15: the masked-routing oracle's KL of each plan
    held = [SAMPLES[i].unsqueeze(0) for i in (7, 15)]

    def kl_of(kept: dict[str, list[int]]) -> float:
        dropped = {n: sorted(set(range(16)) - set(k)) for n, k in kept.items()}
        with torch.no_grad(), masked_routing(source, "kimi_k3", dropped):
            return _held_out_kl(reference, source, held)

    with torch.no_grad():
        reference = [source(input_ids=ids, use_cache=False).logits for ids in held]
    e2e = selection["end_to_end"]
    assert e2e["checked"] is True
    assert e2e["kl_ranking_cut"] == pytest.approx(kl_of(reap.plan.kept), rel=1e-2)
    assert e2e["kl_selection"] == pytest.approx(kl_of(searched), rel=1e-2)
    assert e2e["change"] == pytest.approx(e2e["kl_selection"] - e2e["kl_ranking_cut"], abs=1e-9)
    assert e2e["change"] > -e2e["se"], "the fixture was chosen for a selection that loses"
    assert e2e["applied"] == "reap"
    assert modifier.plan.kept == reap.plan.kept and modifier.plan.saliency == "reap"
    (line,) = post_cut_lines({"router_fit": modifier.router_fit})
    assert line.startswith(f"selection: block_error (pooled error); {differs} kept experts")
    assert "REAP's cut applied" in line or "reap's cut applied" in line, line
    assert json.loads(manifest.read_text())["saliency"] == "reap"
    assert model.config.text_config.num_experts == 8
    # what was kept is what was saved: the reloaded checkpoint computes the in-memory model
    ids = sample_input_ids(128, batch=1, seq=12, seed=2)
    with torch.no_grad():
        memory = model(input_ids=ids, use_cache=False).logits
    reloaded = fresh_process_logits("kimi_k3", tmp_path / "dst", ids, tmp_path / "reloaded.pt")
    torch.testing.assert_close(reloaded, memory, rtol=0, atol=1e-5)


def test_selection_options_need_block_error():
    with pytest.raises(ValidationError, match="only apply with `selection: block_error`"):
        REAPPruningModifier(sparsity=0.5, selection_drops=2)


def test_bias_fit_on_the_modifier_saves_what_it_fitted(tmp_path, tokenizer):
    """``calibrate_bias``: the score-correction bias is fitted after the router; what the
    record says was fitted is what the saved checkpoint holds, and nothing else differs."""
    fixture = build_mxfp4_checkpoint("kimi_k3", tmp_path / "src", grouped=True)
    dst = tmp_path / "dst"
    model = reload_class("kimi_k3").from_pretrained(fixture.path)
    modifier = REAPPruningModifier(
        sparsity=0.5,
        calibrate_router=True,
        calibrate_bias=True,
        validate_fit=False,
        router_fit_tokens=4096,
        router_fit_steps=20,
    )
    _oneshot(model, modifier, tokenizer, output_dir=str(dst))
    record = modifier.router_fit
    assert [c["name"] for c in record["components"]] == ["router", "bias"]
    plan = modifier.plan
    # every saved tensor is the in-memory model's; what differs from the source is the
    # routers' rows and biases, and reap verify names exactly those
    assert saved_equals_memory(model, dst) > 0
    differs = differs_from_source(fixture.path, dst, plan.kept)
    want = []
    for layer, recs in record["component_layers"].items():
        assert recs["router"]["fitted"] == ["gate.weight"]
        want += [f"{layer}.{rel}" for rel in recs["router"]["fitted"] + recs["bias"]["fitted"]]
    assert differs == sorted(want)
    report = verify_checkpoint(dst, source=fixture.path)
    assert report.ok, report.summary()
    assert sorted(report.info["differs_from_source"]) == differs
    ids = sample_input_ids(128, batch=1, seq=12, seed=2)
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
    reloaded = fresh_process_logits("kimi_k3", dst, ids, tmp_path / "reloaded.pt")
    torch.testing.assert_close(reloaded, expected, rtol=0, atol=0)


def test_bias_fit_on_the_modifier_against_the_float64_oracle(tmp_path, tokenizer, monkeypatch):
    """On the rows and the pruned block each layer's bias fit is given (a float32 K3, so
    the float64 oracle of :mod:`bias_oracle` applies to rounding): the losses the record
    reports are the oracle's for the cut's and the returned bias, the record names the
    bias exactly when it moved, and a returned move lowers the oracle's held-out loss."""
    from conftest import save_and_reload
    from tiny_models import build_tiny

    from reap_modifier.post_cut import components

    real, seen = components.fit_bias, {}  # the bias component's fit calls it by this name

    def spy(layer, x, y, **kwargs):
        cut = layer.router.e_score_correction_bias.detach().clone()
        oracle = BiasOracle("kimi_k3", layer.block, x, y)
        bias, record = real(layer, x, y, **kwargs)
        held = torch.zeros(x.shape[0], dtype=torch.bool)
        held[7::8] = True
        seen[layer.name] = (
            torch.equal(bias, cut),
            record,
            oracle.losses(torch.stack([cut, bias]), held).tolist(),
            oracle.losses(torch.stack([cut, bias]), ~held).tolist(),
        )
        return bias, record

    monkeypatch.setattr(components, "fit_bias", spy)
    model, _ = build_tiny("kimi_k3", seed=21, grouped=True)
    model = save_and_reload(model, "kimi_k3", tmp_path / "src")
    modifier = REAPPruningModifier(
        sparsity=0.5,
        calibrate_bias=True,
        validate_fit=False,
        router_fit_tokens=4096,
    )
    _oneshot(model, modifier, tokenizer)
    assert sorted(seen) == sorted(modifier.plan.kept)
    moved = 0
    for unmoved, record, (cut_held, held), (cut_fit, fit) in seen.values():
        assert record.holdout_before == pytest.approx(cut_held, rel=1e-5)
        assert record.holdout_after == pytest.approx(held, rel=1e-5)
        assert record.loss_before == pytest.approx(cut_fit, rel=1e-5)
        assert record.loss_after == pytest.approx(fit, rel=1e-5)
        assert unmoved == (record.fitted == [])
        if not unmoved:
            assert held < cut_held
            moved += 1
    assert moved


def test_block_error_selection_refuses_a_router_it_does_not_model_before_calibration(
    tmp_path, tokenizer
):
    from conftest import save_and_reload
    from tiny_models import build_tiny

    model, _ = build_tiny("mixtral", seed=3)
    model = save_and_reload(model, "mixtral", tmp_path / "src")
    modifier = REAPPruningModifier(sparsity=0.5, selection="block_error")
    with pytest.raises(ValueError, match="selection: block_error cannot choose for .*saliency"):
        _oneshot(model, modifier, tokenizer)
    assert modifier.plan is None  # nothing was calibrated or cut


def test_a_dropped_component_keeps_the_earlier_kept_fit_in_what_is_saved(
    tmp_path, tokenizer, monkeypatch
):
    """Router fit kept, then a dense fit that hurts dropped: the dense fit also changes the
    router rows, and dropping it must leave the router fit's rows, in memory and in the
    checkpoint written by the compressed-source save. Oracle: the reloaded checkpoint's
    logits (a fresh process) equal the in-memory model's; the saved router rows equal the
    in-memory ones and differ from the cut's."""
    from dataclasses import replace

    from reap_modifier.post_cut.components import COMPONENT

    real = COMPONENT["dense"].fit

    def hurting_dense(layer, x, y, settings):
        tensors, record = real(layer, x, y, settings)
        return {
            k: (-5.0 * v if ".shared_experts." in f".{k}" else v) for k, v in tensors.items()
        }, record

    monkeypatch.setitem(COMPONENT, "dense", replace(COMPONENT["dense"], fit=hurting_dense))
    fixture = build_mxfp4_checkpoint("kimi_k3", tmp_path / "src", grouped=True)
    src, dst = fixture.path, tmp_path / "dst"
    source = reload_class("kimi_k3").from_pretrained(src)
    model = reload_class("kimi_k3").from_pretrained(src)
    modifier = REAPPruningModifier(
        sparsity=0.5,
        calibrate_router=True,
        compensate=True,
        router_fit_tokens=4096,
        router_fit_steps=40,
        compensation_steps=5,
    )
    _oneshot(model, modifier, tokenizer, output_dir=str(dst))
    router, dense = modifier.router_fit["components"]
    assert router["name"] == "router" and router["kept"] is True
    assert dense["name"] == "dense" and dense["kept"] is False
    assert "gate.weight" in dense["tensors"]  # the dense fit moved the router rows too

    saved = load_tensors(dst)
    for layer, kept in modifier.plan.kept.items():
        now = model.get_submodule(f"{layer}.gate").weight.detach()
        cut = source.get_submodule(f"{layer}.gate").weight.detach()[kept]
        assert not torch.equal(now, cut), layer  # the router fit's rows, not the cut's
        assert torch.equal(
            saved[f"{layer}.gate.weight"], now.to(saved[f"{layer}.gate.weight"].dtype)
        )
    ids = sample_input_ids(128, batch=1, seq=12, seed=2)
    with torch.no_grad():
        memory = model(input_ids=ids, use_cache=False).logits
    reloaded = fresh_process_logits("kimi_k3", dst, ids, tmp_path / "reloaded.pt")
    torch.testing.assert_close(reloaded, memory, rtol=0, atol=1e-5)


def test_fits_are_judged_as_saved_rounded_to_the_checkpoint_dtype(tmp_path, tokenizer):
    """A model computed in float32 from a bf16 checkpoint: each fitted tensor is rounded to
    bf16 (the dtype the rewrite saves it in) before the held-out check, so the model that was
    judged is the model that is saved, bit for bit."""
    fixture = build_mxfp4_checkpoint("kimi_k3", tmp_path / "src", grouped=True)
    src, dst = fixture.path, tmp_path / "dst"
    model = reload_class("kimi_k3").from_pretrained(src, dtype=torch.float32)
    modifier = REAPPruningModifier(
        sparsity=0.5, calibrate_router=True, router_fit_tokens=4096, router_fit_steps=20
    )
    _oneshot(model, modifier, tokenizer, output_dir=str(dst))
    assert modifier.router_fit["components"][0]["kept"] is True
    saved = load_tensors(dst)
    for layer in modifier.plan.kept:
        now = model.get_submodule(f"{layer}.gate").weight.detach()
        assert now.dtype == torch.float32
        assert saved[f"{layer}.gate.weight"].dtype == torch.bfloat16
        assert torch.equal(now, now.to(torch.bfloat16).float()), layer
        assert torch.equal(saved[f"{layer}.gate.weight"].float(), now), layer


def test_rows_are_stored_as_the_block_computes_them(tmp_path, tokenizer, monkeypatch):
    """A bf16 checkpoint computed in float32: the rows the fits get are the blocks' own
    float32 inputs and outputs (the oracle: plain forward hooks on the unpruned model, one
    calibration sample at a time; unvalidated, so none is held out), not rounded to
    bf16: they are float32 products, which bf16 does not represent (rounding them moves
    every fit's input by up to 2^-8 relative, far beyond this test's tolerance)."""
    from tiny_models import build_tiny, capture_block_io

    from reap_modifier.models import find_moe_architecture
    from reap_modifier.post_cut.rows import RowStore

    built, _ = build_tiny("kimi_k3", seed=3, dtype=torch.bfloat16)
    built.save_pretrained(tmp_path / "src")
    source = reload_class("kimi_k3").from_pretrained(tmp_path / "src", dtype=torch.float32)
    model = reload_class("kimi_k3").from_pretrained(tmp_path / "src", dtype=torch.float32)
    stored: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    put = RowStore.put

    def spy(self, name, x, y):
        stored[name] = (x.clone(), y.clone())
        put(self, name, x, y)

    monkeypatch.setattr(RowStore, "put", spy)
    modifier = REAPPruningModifier(
        sparsity=0.5, calibrate_router=True, router_fit_steps=1, validate_fit=False
    )
    _oneshot(model, modifier, tokenizer)
    arch = find_moe_architecture(source.eval())
    with torch.no_grad():
        per_sample = [capture_block_io(source, arch, s.unsqueeze(0)) for s in SAMPLES]
    assert sorted(stored) == sorted(arch.layer_names)
    for name, (x, y) in stored.items():
        want_x = torch.cat([io[name][0] for io in per_sample])
        want_y = torch.cat([io[name][1] for io in per_sample])
        assert x.dtype == y.dtype == torch.float32 and x.shape == want_x.shape
        # float32 products: (almost) no element is a bf16 value
        share = float((x.to(torch.bfloat16).float() == x).double().mean())
        assert share < 0.01, f"{name}: {share:.0%} of the inputs are bf16 values"
        torch.testing.assert_close(x, want_x, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-6)
