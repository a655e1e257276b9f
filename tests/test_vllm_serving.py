"""Pruned checkpoints load and serve in vLLM (vLLM 0.32.0, CPU build, in its own venv).

The checkpoints are made here (reap-modifier's venv: ``reap prune``'s rewriter and the
modifier's ``oneshot(output_dir=...)``); vLLM runs in the Python of ``.venv-vllm``
(``scripts/vllm_venv.sh``; ``$REAP_VLLM_PYTHON`` overrides).  Without it these tests skip,
unless ``REAP_REQUIRE_VLLM=1`` (``scripts/test.sh`` sets it, so CI fails instead).

- bf16 checkpoints of every family vLLM's CPU backend runs: vLLM's OpenAI server, started
  and stopped by pid, answers greedy completions equal to transformers' on the same
  checkpoint (float32 compute on both sides, so rounding near-ties of random tiny models
  cannot flip a token), and the log-probabilities of identical sequences agree to 1e-3;
  the unpruned model's tokens differ (the comparison can tell the models apart).
- DeepSeek-V3 (MLA) in the dtypes vLLM's CPU MLA attention runs on any CPU: bfloat16 (the
  only one of its AMX attention, which it takes on an AMX CPU), and float32 with its reference
  MLA attention asked for (``--attention-backend CPU_MLA``); the rule itself is tested on
  both kinds of CPU in ``test_vllm_dtype.py``.
- MXFP4 checkpoints (Kimi K3, the bundled trained model pruned by ``reap prune`` and by the
  modifier; Qwen3-MoE): vLLM's weight
  loader accepts them and every tensor lands in vLLM's parameters, experts in their slot;
  a pruned checkpoint whose config still states the old count is rejected.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from reap_modifier.checkpoint import inspect_checkpoint, rewrite_checkpoint  # noqa: E402
from reap_modifier.scores.plan import PruningPlan  # noqa: E402
from reap_modifier.serving.reference import (  # noqa: E402
    greedy_reference,
    load_reference_model,
    sequence_logprobs,
)
from reap_modifier.serving.server import live_group_members  # noqa: E402
from reap_modifier.serving.vllm_check import check_with_vllm  # noqa: E402
from reap_modifier.serving.vllm_load_probe import place_tensors  # noqa: E402

BUNDLED = ROOT / "models" / "tiny-k3-bilingual"

#: what vLLM 0.32's CPU backend needs of a tiny model: attention head size in {32, 64, ...}
#: (CPU_ATTN), MLA latent 512 + rope 64 (the CPU MLA decode kernel), MoE intermediate a
#: multiple of 32 (GPT-OSS's SwiGLU-OAI experts are not padded); DeepSeek-V3 carries the
#: router keys its real config.json has (vLLM creates e_score_correction_bias only for
#: topk_method=noaux_tc and defaults scoring_func to softmax)
VLLM_CPU_OVERRIDES = {
    "qwen3_moe": dict(head_dim=32),
    "mixtral": dict(head_dim=32),
    "olmoe": dict(hidden_size=64),
    "glm4_moe": dict(head_dim=32),
    "gpt_oss": dict(head_dim=32, intermediate_size=32),
    "deepseek_v3": dict(
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
        num_nextn_predict_layers=0, topk_method="noaux_tc", scoring_func="sigmoid",
    ),
}  # fmt: skip

#: kept ids per MoE layer (not a prefix, different per layer, so renumbering matters);
#: grouped routers keep the same count in every group
KEPT = {
    "qwen3_moe": [[1, 2, 5, 7], [0, 3, 4, 6]],
    "mixtral": [[0, 2, 3, 6], [1, 4, 5, 7]],
    "olmoe": [[2, 3, 5, 6], [0, 1, 4, 7]],
    "gpt_oss": [[0, 3, 5, 6], [1, 2, 4, 7]],
    "deepseek_v3": [
        [1, 3, 4, 6, 9, 10, 13, 15],
        [0, 2, 5, 7, 8, 11, 12, 14],
    ],  # n_group=4: 2 per group
    "glm4_moe": [
        [0, 2, 5, 7, 8, 11, 13, 14],
        [1, 3, 4, 6, 9, 10, 12, 15],
    ],  # n_group=2: 4 per group
}


def _wait_for_background_install() -> None:
    """``scripts/test.sh`` installs vLLM's venv in the background while the rest of the
    suite runs and names a status file that holds the installer's exit code when done."""
    status = os.environ.get("REAP_VLLM_INSTALL_STATUS")
    if not status:
        return
    status = Path(status)
    while not status.exists():  # however loaded the machine: pytest-timeout bounds a hang
        time.sleep(2)
    rc = status.read_text().strip()
    if rc != "0":
        log = status.with_suffix(".log")
        tail = log.read_text()[-3000:] if log.exists() else ""
        pytest.fail(f"scripts/vllm_venv.sh failed (exit {rc}); {log}:\n{tail}")


@pytest.fixture(scope="module")
def vllm_python() -> str:
    _wait_for_background_install()
    py = os.environ.get("REAP_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(py).exists():
        msg = f"no vLLM Python at {py}: run `bash scripts/vllm_venv.sh`"
        if os.environ.get("REAP_REQUIRE_VLLM") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return py


def _build_bf16(family: str, path: Path) -> tuple[Path, list[str], int]:
    """A tiny bf16 checkpoint; its MoE blocks as named on disk (Mixtral: ``block_sparse_moe``)."""
    from tiny_models import build_tiny

    model, info = build_tiny(family, seed=0, dtype=torch.bfloat16, **VLLM_CPU_OVERRIDES[family])
    model.save_pretrained(path)
    return path, sorted(inspect_checkpoint(path).blocks, key=_layer_index), info.num_experts


def _layer_index(block: str) -> int:
    return int(block.split("layers.")[1].split(".")[0])


def _prune(
    src: Path, blocks: list[str], kept: list[list[int]], num_experts: int, dst: Path
) -> Path:
    plan = PruningPlan(kept={b: k for b, k in zip(blocks, kept)}, num_experts=num_experts)
    return rewrite_checkpoint(src, plan, dst, progress=False)


def _assert_served_and_matching(report, tmp_path):
    assert report.mode == "serve"
    assert report.ok, "\n".join(report.failures)
    assert report.loaded and report.served and report.tokens_match
    assert report.vllm_tokens == report.reference_tokens
    assert report.max_logprob_diff is not None and report.max_logprob_diff < 1e-3
    assert (
        report.server_pid and live_group_members(report.server_pid) == []
    )  # the server's group is gone


def _assert_tells_models_apart(src: Path, report):
    full = greedy_reference(
        load_reference_model(src, "float32"), report.prompts, len(report.vllm_tokens[0])
    )
    assert full.tokens != report.vllm_tokens


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "glm4_moe", "gpt_oss"])
def test_reap_prune_output_serves_with_transformers_tokens(family, vllm_python, tmp_path):
    src, blocks, n = _build_bf16(family, tmp_path / "src")
    dst = _prune(src, blocks, KEPT[family], n, tmp_path / "pruned")
    report = check_with_vllm(
        dst, vllm_python=vllm_python, dtype="float32", work_dir=tmp_path / "vllm"
    )
    _assert_served_and_matching(report, tmp_path)
    _assert_tells_models_apart(src, report)


def cpu_has_amx() -> bool:
    """The oracle for the dtype vLLM's CPU backend accepts for MLA: the CPU's own flags."""
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


@pytest.mark.parametrize(
    "dtype, server_args",
    [("auto", []), ("float32", ["--attention-backend=CPU_MLA"])],
    ids=["auto-bf16", "float32-cpu-mla"],
)
def test_reap_prune_deepseek_v3_serves_the_pruned_model(dtype, server_args, vllm_python, tmp_path):
    """DeepSeek-V3 (MLA) on vLLM's CPU backend, in a dtype each attention backend runs: ``auto``
    (the bf16 checkpoint's; on an AMX CPU the check asks for bfloat16 explicitly, the only dtype
    of vLLM's AMX MLA attention), and float32 with vLLM's reference MLA attention asked for.

    vLLM's CPU MLA path differs from transformers by ~1e-2 nats per token in float32 on the
    *unpruned* checkpoint too (the difference is in the rotary part: with the rope rows of
    q_proj / kv_a_proj_with_mqa zeroed the two agree to 1e-4), enough to flip near-tie greedy
    tokens and grouped-sigmoid routing of a random tiny model.  So the oracle here is relative:
    on transformers' greedy sequences, vLLM's log-probabilities are those of the pruned model,
    many times closer to it than to the unpruned one (both computed in the served dtype)."""
    import statistics

    src, blocks, n = _build_bf16("deepseek_v3", tmp_path / "src")
    dst = _prune(src, blocks, KEPT["deepseek_v3"], n, tmp_path / "pruned")
    report = check_with_vllm(
        dst, vllm_python=vllm_python, dtype=dtype, server_args=server_args,
        work_dir=tmp_path / "vllm",
    )  # fmt: skip
    want = "bfloat16" if dtype == "auto" and cpu_has_amx() else dtype
    assert report.dtype == want
    assert report.loaded and report.served and report.vllm_logprobs, "\n".join(report.failures)
    assert report.server_pid and live_group_members(report.server_pid) == []
    full = sequence_logprobs(
        load_reference_model(src, want), report.prompts, report.reference_tokens
    )
    flat = lambda rows: [x for r in rows for x in r]  # noqa: E731
    vllm_lp = flat(report.vllm_logprobs)
    to_pruned = statistics.median(
        abs(a - b) for a, b in zip(vllm_lp, flat(report.reference_logprobs))
    )
    to_full = statistics.median(abs(a - b) for a, b in zip(vllm_lp, flat(full)))
    assert to_pruned < 0.05 and to_pruned * 5 < to_full, (to_pruned, to_full)


def test_reap_verify_vllm_cli_on_mixtral(vllm_python, tmp_path):
    from typer.testing import CliRunner

    from reap_modifier.cli import app

    src, blocks, n = _build_bf16("mixtral", tmp_path / "src")
    dst = _prune(src, blocks, KEPT["mixtral"], n, tmp_path / "pruned")
    work = tmp_path / "vllm"
    res = CliRunner().invoke(
        app,
        ["verify", str(dst), "--source", str(src), "-q", "--vllm", "--vllm-python", vllm_python,
         "--vllm-dtype", "float32", "--vllm-work-dir", str(work)],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "vLLM served:" in res.output and "vLLM tokens match:" in res.output
    assert "vLLM check OK (serve mode: tokens match)" in res.output
    saved = json.loads((work / "vllm_check.json").read_text())
    assert (
        saved["ok"] and saved["tokens_match"] and saved["vllm_tokens"] == saved["reference_tokens"]
    )


def test_modifier_output_serves_with_transformers_tokens(vllm_python, tokenizer, tmp_path):
    """GLM-4-MoE (grouped sigmoid router with a score-correction bias, one shared expert)
    pruned by REAP calibration, then its routers fitted and its shared experts compensated
    after the cut (``calibrate_router`` + ``compensate``), through
    ``oneshot(output_dir=...)``: the reloaded checkpoint's logits equal the in-memory
    model's, and vLLM serves it with transformers' tokens."""
    from conftest import calibration_samples, make_dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    from reap_modifier import REAPPruningModifier

    src, _, _ = _build_bf16("glm4_moe", tmp_path / "src")
    model = AutoModelForCausalLM.from_pretrained(src)
    modifier = REAPPruningModifier(
        num_experts_to_keep=8,
        calibrate_router=True,
        compensate=True,
        validate_fit=False,  # every component kept: the served model has all of them
        router_fit_tokens=512,
        router_fit_steps=20,
        compensation_steps=20,
    )
    dst = tmp_path / "pruned"
    oneshot(model=model, recipe=[modifier], processor=tokenizer,
            dataset=make_dataset(calibration_samples(128, n=6, seed=3)),
            num_calibration_samples=6, output_dir=str(dst))  # fmt: skip
    assert json.loads((dst / "config.json").read_text())["n_routed_experts"] == 8
    names = {n for layer in modifier._fitted_tensors.values() for n in layer}
    assert any(n.startswith("shared_experts.") for n in names), names
    ids = torch.tensor([[5, 17, 99, 3, 42, 8, 77, 1]])
    reloaded = AutoModelForCausalLM.from_pretrained(dst).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(input_ids=ids).logits, model.eval()(input_ids=ids).logits, rtol=0, atol=0
        )
    report = check_with_vllm(
        dst, vllm_python=vllm_python, dtype="float32", work_dir=tmp_path / "vllm"
    )
    _assert_served_and_matching(report, tmp_path)
    _assert_tells_models_apart(src, report)


@pytest.fixture(scope="module")
def k3_pruned(tmp_path_factory):
    root = tmp_path_factory.mktemp("k3")
    tc = json.loads((BUNDLED / "config.json").read_text())["text_config"]
    layers = range(tc["first_k_dense_replace"], tc["num_hidden_layers"])
    E = tc["num_experts"]
    blocks = [f"language_model.model.layers.{i}.block_sparse_moe" for i in layers]
    kept = [sorted(random.Random(i).sample(range(E), E // 2)) for i in layers]
    return _prune(BUNDLED, blocks, kept, E, root / "k3-half"), kept


def test_pruned_k3_mxfp4_passes_vllm_weight_loading(k3_pruned, vllm_python, tmp_path):
    dst, _ = k3_pruned
    report = check_with_vllm(dst, vllm_python=vllm_python, work_dir=tmp_path / "vllm")
    assert report.mode == "load"  # no MXFP4 MoE kernel for K3 on this CPU
    assert report.ok, "\n".join(report.failures)
    assert report.loaded and report.served is None and report.tokens_match is None
    probe = report.probe
    assert (
        probe["architecture"] == "KimiK3ForConditionalGeneration"
        and probe["quantization"] == "mxfp4"
    )
    n_tensors = sum(1 for _ in _tensor_names(dst))
    assert probe["checkpoint_tensors"] == n_tensors and probe["stage"] == "done"
    assert any("loaded every parameter" in line for line in report.proved)


def test_modifier_k3_mxfp4_output_passes_vllm_weight_loading(vllm_python, tmp_path):
    """The bundled K3 pruned by the modifier (data-free router_l1 cut, 64 -> 32):
    ``oneshot(output_dir=...)`` writes it through the bit-exact compressed save."""
    from llmcompressor import oneshot

    from reap_modifier import REAPPruningModifier

    dst = tmp_path / "k3-modifier"
    modifier = REAPPruningModifier(saliency="router_l1", num_experts_to_keep=32, divisible_by=8)
    oneshot(model=str(BUNDLED), recipe=[modifier], output_dir=str(dst))
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["text_config"]["num_experts"] == 32
    assert cfg["quantization_config"]["format"] == "mxfp4-pack-quantized"
    report = check_with_vllm(dst, vllm_python=vllm_python, work_dir=tmp_path / "vllm")
    assert report.mode == "load" and report.ok, "\n".join(report.failures)
    assert report.probe["checkpoint_tensors"] == sum(1 for _ in _tensor_names(dst))


def test_pruned_k3_with_stale_expert_count_is_rejected(k3_pruned, vllm_python, tmp_path):
    dst, _ = k3_pruned
    bad = tmp_path / "stale"
    shutil.copytree(dst, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["text_config"]["num_experts"] = 64
    (bad / "config.json").write_text(json.dumps(cfg))
    report = check_with_vllm(bad, vllm_python=vllm_python, work_dir=tmp_path / "vllm")
    assert not report.ok and report.loaded is False
    assert "vLLM rejected the checkpoint during load" in report.failures[0]


def test_pruned_qwen3_mxfp4_passes_vllm_weight_loading(vllm_python, tmp_path):
    from mxfp4_fixtures import build_mxfp4_checkpoint

    fx = build_mxfp4_checkpoint("qwen3_moe", tmp_path / "src", head_dim=32)
    dst = _prune(fx.path, fx.moe_blocks, KEPT["qwen3_moe"], fx.num_experts, tmp_path / "pruned")
    report = check_with_vllm(dst, vllm_python=vllm_python, work_dir=tmp_path / "vllm")
    assert report.mode == "load"
    assert report.ok, "\n".join(report.failures)
    assert report.probe["architecture"] == "Qwen3MoeForCausalLM"
    assert report.probe["quantization"] == "compressed-tensors"
    assert report.probe["checkpoint_tensors"] == sum(1 for _ in _tensor_names(dst))


def _tensor_names(path: Path):
    from safetensors import safe_open

    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            yield from fh.keys()


# ---------------------------------------------------------------------------
# no vLLM needed


def test_placement_oracle_finds_misplaced_and_missing_tensors(tmp_path):
    """The load probe's placement check (run here on hand-made parameters)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    w = {e: torch.randn(4, 6, generator=g).to(torch.bfloat16) for e in range(3)}
    other = torch.randn(5, 6, generator=g).to(torch.bfloat16)
    save_file(
        {f"m.layers.0.mlp.experts.{e}.w1.weight": w[e] for e in range(3)}
        | {"m.other.weight": other},
        str(tmp_path / "model.safetensors"),
    )
    fused = torch.zeros(
        3, 8, 6, dtype=torch.float32
    )  # [experts, 2*rows, cols], float32 like vLLM's params
    fused[0, :4], fused[1, :4], fused[2, 4:] = (
        w[0].float(),
        w[2].float(),
        w[1].float(),
    )  # 1 and 2 swapped
    res = place_tensors(tmp_path, {"m.layers.0.mlp.experts.w13_weight": fused})
    assert res["placed"] == 1  # expert 0 in slot 0
    assert len(res["misplaced"]) == 2 and "expected expert slot 1" in " ".join(res["misplaced"])
    assert res["missing"] == ["m.other.weight"]
    fused[1, :4], fused[2, :4] = w[1].float(), w[2].float()
    res = place_tensors(
        tmp_path, {"m.layers.0.mlp.experts.w13_weight": fused, "m.other.weight": other.float()}
    )
    assert res["placed"] == 4 and not res["misplaced"] and not res["missing"]


def test_verify_vllm_without_vllm_is_a_usage_error(tmp_path):
    from typer.testing import CliRunner

    from reap_modifier.cli import app

    src, _, _ = _build_bf16("qwen3_moe", tmp_path / "src")
    res = CliRunner().invoke(
        app, ["verify", str(src), "-q", "--vllm", "--vllm-python", str(tmp_path / "no-python")]
    )
    assert res.exit_code == 2
    assert "no Python with vLLM" in res.output and "scripts/vllm_venv.sh" in res.output
