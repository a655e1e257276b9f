"""The modifier's compressed save: a REAP-only oneshot on an MXFP4 checkpoint writes
its output from the source bytes (format unchanged, kept experts bit-identical)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import calibration_samples, make_dataset
from mxfp4_fixtures import (
    build_mxfp4_checkpoint,
    kept_experts_are_source_bytes,
    tensor_sha256,
    tree_sha256,
)
from oracles import masked_routing
from tiny_models import reload_class, sample_input_ids

from reap_modifier import REAPPruningModifier
from reap_modifier.checkpoint.compressed_save import compressed_source, route_save_through_rewriter
from reap_modifier.checkpoint.verify import verify_checkpoint


@pytest.fixture(scope="module")
def k3_mxfp4(tmp_path_factory):
    root = tmp_path_factory.mktemp("csave")
    return build_mxfp4_checkpoint("kimi_k3", root / "src"), root


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_oneshot_path_is_bit_exact_for_other_families(tmp_path, tokenizer, family):
    fixture = build_mxfp4_checkpoint(family, tmp_path / "src", max_shard_size="200KB")
    before = tree_sha256(fixture.path)
    plan = _run_oneshot(str(fixture.path), tmp_path / "dst", tokenizer)
    assert tree_sha256(fixture.path) == before
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert config[fixture.count_key] == plan.num_kept
    _check_bit_exact(fixture.path, tmp_path / "dst", plan.kept)
    assert verify_checkpoint(tmp_path / "dst", source=fixture.path).ok


def _run_oneshot(model, dst, tokenizer):
    from llmcompressor import oneshot

    modifier = REAPPruningModifier(sparsity=0.5)
    oneshot(
        model=model,
        recipe=[modifier],
        processor=tokenizer,
        dataset=make_dataset(calibration_samples(128, n=6, seed=3)),
        num_calibration_samples=6,
        output_dir=str(dst),
    )
    return modifier.plan


def _check_bit_exact(src: Path, dst: Path, kept: dict[str, list[int]]):
    assert kept_experts_are_source_bytes(src, dst, kept) > 0
    assert any(n.endswith("weight_packed") for n in tensor_sha256(dst))


@pytest.mark.parametrize("load", ["oneshot_path", "from_pretrained"])
def test_reap_only_oneshot_writes_bit_exact_mxfp4(k3_mxfp4, tokenizer, load):
    fixture, root = k3_mxfp4
    src, dst = fixture.path, root / f"dst-{load}"
    before = tree_sha256(src)
    model = str(src) if load == "oneshot_path" else reload_class("kimi_k3").from_pretrained(src)
    plan = _run_oneshot(model, dst, tokenizer)
    assert tree_sha256(src) == before, "the source checkpoint changed"
    config = json.loads((dst / "config.json").read_text())
    qc = config.get("quantization_config") or config["text_config"]["quantization_config"]
    assert qc["format"] == "mxfp4-pack-quantized"
    assert config["text_config"]["num_experts"] == plan.num_kept
    _check_bit_exact(src, dst, plan.kept)
    report = verify_checkpoint(dst, source=src)
    assert report.ok, report

    # fresh process: reloads with the pruned count; logits equal masked routing of the source
    ids = sample_input_ids(128, batch=1, seq=12, seed=2)
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(Path(__file__).parent / "helpers")!r}); import paths
        from tiny_models import reload_class
        m = reload_class("kimi_k3").from_pretrained({str(dst)!r}).eval()
        with torch.no_grad():
            torch.save(m(input_ids=torch.tensor({ids.tolist()}), use_cache=False).logits, {str(root / (load + ".pt"))!r})
        print(m.config.text_config.num_experts)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(plan.num_kept)
    source = reload_class("kimi_k3").from_pretrained(src).eval()
    with torch.no_grad():  # the first forward decompresses (before routers are patched)
        source(input_ids=ids[:, :2], use_cache=False)
    dropped = {k: sorted(set(range(plan.num_experts)) - set(v)) for k, v in plan.kept.items()}
    with torch.no_grad(), masked_routing(source, "kimi_k3", dropped):
        expected = source(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(torch.load(root / f"{load}.pt"), expected, rtol=1e-5, atol=1e-5)


def test_other_modifiers_keep_the_regular_save(k3_mxfp4):
    fixture, _ = k3_mxfp4
    model = reload_class("kimi_k3").from_pretrained(fixture.path)
    assert compressed_source(model) == fixture.path
    original = model.save_pretrained
    routed = route_save_through_rewriter(
        model, plan=None, source=fixture.path, other_modifiers=["GPTQModifier"]
    )
    assert routed is False and model.save_pretrained == original


def test_plain_checkpoints_are_not_compressed_sources(tmp_path):
    from tiny_models import build_tiny

    model, _ = build_tiny("qwen3_moe")
    model.save_pretrained(tmp_path)
    model = reload_class("qwen3_moe").from_pretrained(tmp_path)
    assert compressed_source(model) is None
