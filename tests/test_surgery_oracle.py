"""Oracle 2: a pruned model's logits equal the unpruned model's with the dropped
experts masked out of routing — in memory, and after ``oneshot(output_dir=...)`` /
``save_pretrained(save_compressed=True)`` and a reload in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import calibration_samples, make_dataset, save_and_reload
from oracles import masked_routing
from tiny_models import ALL_FAMILIES, FAMILIES, build_tiny, reload_class, sample_input_ids

from reap_modifier import REAPPruningModifier
from reap_modifier.models import find_moe_architecture, text_config
from reap_modifier.scores.keep_count import compute_keep_count
from reap_modifier.scores.plan import PruningPlan
from reap_modifier.surgery import apply_plan

HERE = Path(__file__).parent


def _random_plan(arch, seed: int) -> PruningPlan:
    keep = compute_keep_count(
        arch.num_experts,
        arch.top_k,
        sparsity=0.5,
        n_group=arch.n_group if arch.group_limited else None,
        topk_group=arch.topk_group if arch.group_limited else None,
    )
    gen = torch.Generator().manual_seed(seed)
    saliency = {
        layer.name: torch.rand(arch.num_experts, generator=gen, dtype=torch.float64)
        for layer in arch.layers
    }
    return PruningPlan.from_saliency(
        saliency,
        keep,
        criterion="random-test",
        n_group=arch.n_group if arch.group_limited else None,
    )


def _dropped(plan: PruningPlan) -> dict[str, list[int]]:
    return {
        layer: sorted(set(range(plan.num_experts)) - set(kept)) for layer, kept in plan.kept.items()
    }


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_in_memory_surgery_equals_masked_routing(family):
    model, info = build_tiny(family, seed=7, dtype=torch.float32)
    ids = sample_input_ids(info.vocab_size, batch=2, seq=16, seed=3)
    arch = find_moe_architecture(model)
    plan = _random_plan(arch, seed=11)
    with torch.no_grad():
        unpruned = model(input_ids=ids, use_cache=False).logits
        with masked_routing(model, family, _dropped(plan)):
            masked = model(input_ids=ids, use_cache=False).logits
        apply_plan(model, arch, plan)
        pruned = model(input_ids=ids, use_cache=False).logits
    assert not torch.equal(unpruned, masked), "masking changed nothing: the test is vacuous"
    torch.testing.assert_close(pruned, masked, rtol=1e-5, atol=1e-6)
    cfg = text_config(model.config)
    assert getattr(cfg, arch.count_keys[0]) == plan.num_kept
    for layer in arch.layers:
        assert layer.router.weight.shape[0] == plan.num_kept
        bias = getattr(layer.router, "e_score_correction_bias", None)
        if bias is not None:
            assert bias.shape[0] == plan.num_kept


def test_kimi_bias_stays_a_parameter_and_deepseek_bias_a_buffer():
    for family, expect_param in (("kimi_k3", True), ("deepseek_v3", False)):
        model, _ = build_tiny(family, seed=1)
        arch = find_moe_architecture(model)
        original = {l.name: l.router.e_score_correction_bias.detach().clone() for l in arch.layers}
        plan = _random_plan(arch, seed=2)
        apply_plan(model, arch, plan)
        for layer in arch.layers:
            router = layer.router
            is_param = "e_score_correction_bias" in dict(router.named_parameters(recurse=False))
            is_buffer = "e_score_correction_bias" in dict(router.named_buffers(recurse=False))
            assert (is_param, is_buffer) == (expect_param, not expect_param), family
            kept = plan.kept[layer.name]
            assert torch.equal(router.e_score_correction_bias.detach(), original[layer.name][kept])


# -- oneshot + save + fresh-process reload --------------------------------------------

RELOAD_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, {tests!r}); import paths
    from tiny_models import reload_class
    jobs = json.loads(open(sys.argv[1]).read())
    out = {{}}
    for key, job in jobs.items():
        cls = reload_class(job["family"])
        model = cls.from_pretrained(job["path"], dtype=torch.float32).eval()
        ids = torch.tensor(job["ids"])
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
        torch.save(logits, job["logits"])
        cfg = getattr(model.config, "text_config", None) or model.config
        out[key] = {{k: getattr(cfg, k) for k in ("num_experts", "num_local_experts", "n_routed_experts") if isinstance(getattr(cfg, k, None), int)}}
    print(json.dumps(out))
    """
)


# transformers' own (different) `kimi_linear` config, which oneshot reads back through
# AutoConfig, needs the KDA/full-attention layout spelled out
ONESHOT_OVERRIDES = {
    "kimi_linear": {"linear_attn_config": {"kda_layers": [], "full_attn_layers": [1, 2, 3]}}
}


@pytest.fixture(scope="module")
def pruned_checkpoints(tmp_path_factory, tokenizer):
    """Run oneshot REAP for every family, save twice, reload all in one fresh process."""
    from llmcompressor import oneshot

    root = tmp_path_factory.mktemp("oneshot")
    results, jobs = {}, {}
    for family in ALL_FAMILIES:
        model, info = build_tiny(
            family, seed=13, dtype=torch.float32, **ONESHOT_OVERRIDES.get(family, {})
        )
        src = root / f"{family}-src"
        model = save_and_reload(model, family, src)
        ids = sample_input_ids(info.vocab_size, batch=2, seq=16, seed=5)
        modifier = REAPPruningModifier(
            sparsity=0.5, report_path=str(root / f"{family}-report.json")
        )
        dst = root / f"{family}-oneshot"
        oneshot(
            model=model,
            recipe=[modifier],
            processor=tokenizer,
            dataset=make_dataset(calibration_samples(info.vocab_size, n=6, seed=1)),
            num_calibration_samples=6,
            output_dir=str(dst),
        )
        resaved = root / f"{family}-resaved"
        model.save_pretrained(str(resaved), save_compressed=True)
        # the oracle: the source model with the dropped experts masked out of routing
        source = reload_class(family).from_pretrained(src, dtype=torch.float32).eval()
        with torch.no_grad(), masked_routing(source, family, _dropped(modifier.plan)):
            expected = source(input_ids=ids, use_cache=False).logits
        results[family] = {
            "plan": modifier.plan,
            "expected": expected,
            "report": root / f"{family}-report.json",
        }
        for kind, path in (("oneshot", dst), ("resaved", resaved)):
            jobs[f"{family}:{kind}"] = {
                "family": family,
                "path": str(path),
                "ids": ids.tolist(),
                "logits": str(root / f"{family}-{kind}.pt"),
            }
    jobs_file = root / "jobs.json"
    jobs_file.write_text(json.dumps(jobs))
    script = root / "reload.py"
    script.write_text(RELOAD_SCRIPT.format(tests=str(HERE / "helpers")))
    proc = subprocess.run(
        [sys.executable, str(script), str(jobs_file)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    for key, job in jobs.items():
        family, kind = key.split(":")
        results[family][kind] = torch.load(job["logits"])
        results[family][f"{kind}_counts"] = counts[key]
    return results


@pytest.mark.parametrize("kind", ["oneshot", "resaved"])
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_saved_checkpoint_reloads_and_equals_masked_routing(pruned_checkpoints, family, kind):
    result = pruned_checkpoints[family]
    plan = result["plan"]
    counts = result[f"{kind}_counts"]
    assert counts and set(counts.values()) == {plan.num_kept}, counts
    torch.testing.assert_close(result[kind], result["expected"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_upstream_report_shape(pruned_checkpoints, family):
    result = pruned_checkpoints[family]
    report = json.loads(Path(result["report"]).read_text())
    assert report == result["plan"].kept
    assert all(isinstance(v, list) and v == sorted(v) for v in report.values())
