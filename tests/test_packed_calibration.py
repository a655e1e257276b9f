"""Calibration on packed MXFP4 experts: the same scores as on the decompressed model,
one MoE layer (or one expert) dense at a time, offload-compatible, the prune and the
bit-exact save keep working, and formats nothing can decompress are refused early."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from conftest import calibration_samples, make_dataset, make_tokenizer
from k3_mxfp4_synth import K3Shape, write_k3_mxfp4
from memory_probe import LiveTensors, shaped_like
from mxfp4_fixtures import build_mxfp4_checkpoint, tensor_sha256
from oracles import masked_routing
from tiny_models import reload_class, sample_input_ids

from reap_modifier import REAPPruningModifier
from reap_modifier.calibration.packed import PackedFormatError, compressed_modules
from reap_modifier.modifier import recipe_keeps_experts_packed

FAMILIES = {"kimi_k3": dict(grouped=True), "qwen3_moe": {}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed")
    return {f: build_mxfp4_checkpoint(f, root / f, **kw) for f, kw in FAMILIES.items()}


@pytest.fixture(scope="module")
def data():
    return make_dataset(calibration_samples(128, n=8, seq=24, seed=5))


def run_reap(model, tokenizer, dataset, *, calibrate_all=False, output_dir=None, **fields):
    from llmcompressor import oneshot

    modifier = REAPPruningModifier(sparsity=0.5, **fields)
    out = oneshot(
        model=model,
        recipe=[modifier],
        processor=tokenizer,
        dataset=dataset,
        num_calibration_samples=len(dataset),
        moe_calibrate_all_experts=calibrate_all,
        output_dir=output_dir,
    )
    return modifier, out


def assert_same_scores(got, ref, rtol=1e-6):
    """Every statistic of every layer within ``rtol`` (relative, no absolute slack)."""
    assert set(got.layers) == set(ref.layers)
    for layer, stats in ref.layers.items():
        assert set(got.layers[layer]) == set(stats), layer
        for name, value in stats.items():
            torch.testing.assert_close(
                got.layers[layer][name], value, rtol=rtol, atol=0, msg=f"{layer} {name}"
            )
    assert got.total_tokens() == ref.total_tokens() > 0


def expert_linears(model):
    return [
        m for n, m in model.named_modules() if ".experts.0." in n and isinstance(m, torch.nn.Linear)
    ]


def still_packed(model) -> bool:
    mods = expert_linears(model)
    return bool(mods) and all(
        "weight_packed" in m._parameters
        and "weight" not in m.__dict__
        and "weight" not in m._parameters
        for m in mods
    )


_DENSE: dict = {}


def dense_reference(family, checkpoints, tokenizer, data, calibrate_all=False):
    key = (family, calibrate_all)
    if key not in _DENSE:
        modifier, out = run_reap(
            str(checkpoints[family].path),
            tokenizer,
            data,
            calibrate_all=calibrate_all,
            dequantize="model",
        )
        # the reference really ran on dense experts
        assert all("weight" in m._parameters for m in expert_linears(out))
        _DENSE[key] = modifier
    return _DENSE[key]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("granularity", ["layer", "expert"])
def test_packed_scores_equal_dense(checkpoints, tokenizer, data, family, granularity):
    ref = dense_reference(family, checkpoints, tokenizer, data)
    modifier, out = run_reap(str(checkpoints[family].path), tokenizer, data, dequantize=granularity)
    assert still_packed(out), "experts were decompressed"
    assert_same_scores(modifier.scores, ref.scores)
    assert modifier.plan.kept == ref.plan.kept


def test_packed_calibrate_all_equals_dense(checkpoints, tokenizer, data):
    ref = dense_reference("kimi_k3", checkpoints, tokenizer, data, calibrate_all=True)
    modifier, out = run_reap(str(checkpoints["kimi_k3"].path), tokenizer, data, calibrate_all=True)
    assert still_packed(out)
    assert_same_scores(modifier.scores, ref.scores)


def test_from_pretrained_model_stays_packed(checkpoints, tokenizer, data):
    path = checkpoints["kimi_k3"].path
    model = reload_class("kimi_k3").from_pretrained(path)
    assert compressed_modules(model)
    modifier, out = run_reap(model, tokenizer, data)
    assert out is model and still_packed(model)
    assert_same_scores(
        modifier.scores, dense_reference("kimi_k3", checkpoints, tokenizer, data).scores
    )


def test_model_cast_to_float32_calibrates_packed(checkpoints, tokenizer, data):
    """A packed model cast to float32 after loading (compressed-tensors dequantizes to bf16
    whatever the model's dtype) computes its experts in float32: the scores equal those of the
    decompressed model cast the same way, and everything stays packed."""
    from transformers.utils.quantization_config import CompressedTensorsConfig

    path, cls = checkpoints["kimi_k3"].path, reload_class("kimi_k3")
    dense = cls.from_pretrained(path, quantization_config=CompressedTensorsConfig(dequantize=True))
    ref, _ = run_reap(dense.to(torch.float32), tokenizer, data, dequantize="model")
    packed = cls.from_pretrained(path).to(torch.float32)
    assert packed.get_input_embeddings().weight.dtype == torch.float32
    modifier, out = run_reap(packed, tokenizer, data)
    assert still_packed(out)
    assert {m.weight_packed.dtype for m in expert_linears(out)} == {torch.uint8}
    assert_same_scores(modifier.scores, ref.scores)
    assert modifier.plan.kept == ref.plan.kept


def test_checkpoint_loads_in_float32(checkpoints):
    """``load_checkpoint_model`` (the main job's and the vLLM check's loader) gives an MXFP4
    checkpoint in float32 with float32 experts: a plain ``from_pretrained(dtype=float32)``
    fails on its first forward (compressed-tensors dequantizes to bf16). Its logits are the
    bf16-loaded model's computed in float32; ``packed`` keeps the bytes."""
    from reap_modifier.models.loading import load_checkpoint_model
    from reap_modifier.serving.reference import load_reference_model

    path = checkpoints["kimi_k3"].path
    ids = sample_input_ids(128, batch=1, seq=12, seed=3)
    model = load_checkpoint_model(path, dtype="float32")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    bf16 = load_checkpoint_model(path, dtype="bfloat16")
    assert {m.weight.dtype for m in expert_linears(bf16)} == {torch.bfloat16}
    with torch.no_grad():
        got = model(input_ids=ids).logits
        want = bf16.to(torch.float32)(input_ids=ids).logits
        torch.testing.assert_close(
            load_reference_model(path, "float32")(input_ids=ids).logits, got, rtol=0, atol=0
        )
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    packed = load_checkpoint_model(path, dtype="float32", packed=True)
    assert still_packed(packed) and packed.get_input_embeddings().weight.dtype == torch.float32


def test_disk_offloaded_packed_model(checkpoints, tokenizer, data, tmp_path):
    """compressed-tensors disk offload + sequential pipeline: experts read packed from the
    offload folder, no dense expert weight written there, same scores."""
    from compressed_tensors.offload import load_offloaded_model
    from compressed_tensors.offload.cache.disk import DiskCache

    cls = reload_class("kimi_k3")
    folder = tmp_path / "offload"
    with load_offloaded_model(cls):
        model = cls.from_pretrained(
            checkpoints["kimi_k3"].path,
            device_map="auto_offload",
            max_memory={"cpu": 200_000},
            offload_folder=str(folder),
        )
    on_disk = [m for m in expert_linears(model) if isinstance(m._parameters, DiskCache)]
    assert on_disk, "nothing was offloaded to disk"
    before = set(os.listdir(folder))
    modifier, _ = run_reap(model, tokenizer, data)
    # the only tensors written to the folder since are the surgery's pruned router rows
    from safetensors import safe_open

    for new in sorted(set(os.listdir(folder)) - before):
        with safe_open(str(folder / new), framework="pt") as f:
            for key in f.keys():
                assert f.get_slice(key).get_shape()[0] == modifier.plan.num_kept, (new, key)
    assert_same_scores(
        modifier.scores, dense_reference("kimi_k3", checkpoints, tokenizer, data).scores
    )


def test_in_memory_prune_from_packed_mode(checkpoints, tokenizer, data):
    """The pruned model left in memory (still packed) computes what the source computes
    with the dropped experts masked out of routing."""
    path = checkpoints["kimi_k3"].path
    modifier, pruned = run_reap(str(path), tokenizer, data)
    plan = modifier.plan
    assert still_packed(pruned) and plan.num_kept == plan.num_experts // 2
    ids = sample_input_ids(128, batch=1, seq=12, seed=2)
    source = reload_class("kimi_k3").from_pretrained(path).eval()
    with torch.no_grad():
        source(input_ids=ids[:, :2], use_cache=False)  # first forward decompresses
        got = pruned.eval()(input_ids=ids, use_cache=False).logits
        dropped = {k: sorted(set(range(plan.num_experts)) - set(v)) for k, v in plan.kept.items()}
        with masked_routing(source, "kimi_k3", dropped):
            expected = source(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_bit_exact_save_from_packed_mode(checkpoints, tokenizer, data, tmp_path):
    """oneshot(..., output_dir) writes through the rewriter from the packed mode: the
    same tensors, byte for byte, as from the decompress-everything mode."""
    path = str(checkpoints["kimi_k3"].path)
    run_reap(path, tokenizer, data, output_dir=str(tmp_path / "packed"))
    run_reap(path, tokenizer, data, output_dir=str(tmp_path / "dense"), dequantize="model")
    packed, dense = tensor_sha256(tmp_path / "packed"), tensor_sha256(tmp_path / "dense")
    assert packed == dense and any(k.endswith("weight_packed") for k in packed)
    config = json.loads((tmp_path / "packed" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "mxfp4-pack-quantized"


def test_calibration_free_prune_never_decompresses(checkpoints, tmp_path):
    """A weight baseline on a REAP-only recipe: loaded packed, pruned packed, written by the
    rewriter; no expert is ever dequantized."""
    from llmcompressor import oneshot

    from reap_modifier.checkpoint.verify import verify_checkpoint

    src = checkpoints["kimi_k3"].path
    modifier = REAPPruningModifier(sparsity=0.5, saliency="router_l1")
    out = oneshot(model=str(src), recipe=[modifier], output_dir=str(tmp_path / "dst"))
    assert still_packed(out) and modifier.packed is None
    assert verify_checkpoint(tmp_path / "dst", source=src).ok


# -- bad input -------------------------------------------------------------------------


def test_checkpoint_format_without_decompressor_is_refused_before_loading(
    checkpoints, tokenizer, data, tmp_path, monkeypatch
):
    src = tmp_path / "marlin"
    shutil.copytree(checkpoints["kimi_k3"].path, src)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["format"] = "marlin-24"
    (src / "config.json").write_text(json.dumps(config))
    from transformers import AutoModelForCausalLM

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_load)
    expected = r"'marlin-24' \(in config group group_0\).*Fallback: calibrate a dense"
    with pytest.raises(PackedFormatError, match=expected):
        run_reap(str(src), tokenizer, data, scores_path=str(tmp_path / "s.safetensors"))
    assert not (tmp_path / "s.safetensors").exists()


def test_module_format_without_decompressor_is_refused_before_calibration(
    checkpoints, tokenizer, data, tmp_path, monkeypatch
):
    from compressed_tensors.config import CompressionFormat

    from reap_modifier import modifier as modifier_module

    model = reload_class("kimi_k3").from_pretrained(checkpoints["kimi_k3"].path)
    name, module = next((n, m) for n, m in compressed_modules(model).items() if ".experts.3." in n)
    module.quantization_scheme = module.quantization_scheme.model_copy(
        update={"format": CompressionFormat.sparse_24_bitmask}
    )
    attached = []
    monkeypatch.setattr(modifier_module.SaliencyObserver, "attach", lambda self: attached.append(1))
    with pytest.raises(PackedFormatError, match=rf"'sparse-24-bitmask' \(in {name}\)"):
        run_reap(model, tokenizer, data, scores_path=str(tmp_path / "s.safetensors"))
    assert not attached and not (tmp_path / "s.safetensors").exists()


def test_recipe_detection():
    other = (
        "quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n"
        "      targets: [Linear]\n      scheme: W8A8\n"
    )
    reap = "reap_stage:\n  reap_modifiers:\n    REAPPruningModifier:\n      sparsity: 0.5\n"
    assert recipe_keeps_experts_packed([REAPPruningModifier(sparsity=0.5)])
    assert recipe_keeps_experts_packed(REAPPruningModifier(sparsity=0.5, dequantize="expert"))
    assert recipe_keeps_experts_packed(reap)
    assert not recipe_keeps_experts_packed([REAPPruningModifier(sparsity=0.5, dequantize="model")])
    assert not recipe_keeps_experts_packed(reap + other)
    assert not recipe_keeps_experts_packed(None)


# -- memory ------------------------------------------------------------------------------

MEM_SHAPE = K3Shape(hidden=256, latent=192, inter=320, experts=64, moe_layers=3, top_k=8)
#: the dense expert weight shapes (w1/w3, w2): no other tensor of the model has them
EXPERT_SHAPES = {(MEM_SHAPE.inter, MEM_SHAPE.latent), (MEM_SHAPE.latent, MEM_SHAPE.inter)}


@pytest.fixture(scope="module")
def synth_k3(tmp_path_factory):
    return write_k3_mxfp4(tmp_path_factory.mktemp("synth") / "k3", MEM_SHAPE, shard_bytes=8 << 20)


def test_probe_sees_a_decompressed_model(synth_k3):
    """Self-check of the measurement: a dense load holds every expert weight at once."""
    from transformers.utils.quantization_config import CompressedTensorsConfig

    probe = LiveTensors(shaped_like(EXPERT_SHAPES))
    with probe:
        model = reload_class("kimi_k3").from_pretrained(
            synth_k3["path"], quantization_config=CompressedTensorsConfig(dequantize=True)
        )
    per_layer = 3 * MEM_SHAPE.experts
    assert probe.live_count == per_layer * MEM_SHAPE.moe_layers
    assert probe.peak_bytes >= synth_k3["dense_expert_bytes"]
    del model


@pytest.mark.parametrize("granularity,limit", [("layer", 3 * MEM_SHAPE.experts + 1), ("expert", 2)])
def test_peak_dense_experts_measured(synth_k3, granularity, limit, monkeypatch):
    """Counted from allocations (every storage of an expert weight's shape, followed until
    freed) over the whole oneshot call, loading included: at most one MoE layer's experts
    (plus one transient) dense at a time, or at most one expert projection; and the freed
    heap memory handed back at every MoE layer switch and at the end (without it glibc
    keeps it and peak RSS grows, see docs/packed-calibration.md)."""
    from reap_modifier.calibration import packed

    assert synth_k3["packed_expert_bytes"] > 10 << 20  # tens of MB packed
    tokenizer = make_tokenizer(MEM_SHAPE.vocab)
    dataset = make_dataset(calibration_samples(MEM_SHAPE.vocab, n=4, seq=32, seed=1))
    trims = []
    monkeypatch.setattr(packed, "return_freed_memory", lambda: trims.append(1))
    probe = LiveTensors(shaped_like(EXPERT_SHAPES))
    with probe:
        modifier, out = run_reap(synth_k3["path"], tokenizer, dataset, dequantize=granularity)
    # the sequential pipeline: each MoE layer entered once (both passes), then detach
    assert modifier.packed.stats.layers_entered == MEM_SHAPE.moe_layers
    assert len(trims) == MEM_SHAPE.moe_layers + 1
    expert_bytes = MEM_SHAPE.latent * MEM_SHAPE.inter * 2
    assert probe.created > 0, "no expert weight was ever dequantized"
    assert probe.peak_count <= limit
    assert probe.peak_bytes <= limit * expert_bytes
    assert probe.peak_bytes <= synth_k3["dense_layer_expert_bytes"] + expert_bytes
    assert probe.live_count == 0 and still_packed(out)
    assert modifier.scores.total_tokens() > 0
