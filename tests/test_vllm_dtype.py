"""The dtype rule of the vLLM check and the vLLM eval backend, on both kinds of CPU (AMX or not)
with hand-written and transformers-written configs; and the refusal before any server starts,
through ``reap verify --vllm`` and ``reap eval --backend vllm`` with the vLLM Python's answer
faked (no vLLM needed).

The expectations are vLLM 0.32's, read from its CPU platform (``CpuPlatform.get_attn_backend_cls``):
an MLA model (``kv_lora_rank`` in its text config, causal) on an x86 CPU with AMX tiles runs the
AMX_MLA attention, bfloat16 only, unless ``--attention-backend CPU_MLA`` is asked for or
``VLLM_MLA_DISABLE=1``; the reference CPU_MLA attention and the non-MLA attention run any dtype.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from reap_modifier.cli import app
from reap_modifier.serving import vllm_check
from reap_modifier.serving.vllm_dtype import DtypeRefused, served_dtype, uses_mla

DEEPSEEK = {"model_type": "deepseek_v3", "kv_lora_rank": 512, "q_lora_rank": 1536}
K3 = {"model_type": "kimi_k3", "text_config": {"model_type": "kimi_linear", "kv_lora_rank": 64}}
QWEN = {"model_type": "qwen3_moe", "head_dim": 128}
NO_ENV: dict = {}

#: (asked, config, AMX CPU, server args, env) -> the dtype served, or None: refused
CASES = [
    ("auto", DEEPSEEK, True, [], NO_ENV, "bfloat16"),
    ("auto", K3, True, [], NO_ENV, "bfloat16"),
    ("bfloat16", DEEPSEEK, True, [], NO_ENV, "bfloat16"),
    ("float32", DEEPSEEK, True, [], NO_ENV, None),
    ("float32", K3, True, [], NO_ENV, None),
    ("float16", DEEPSEEK, True, [], NO_ENV, None),
    ("float32", DEEPSEEK, True, ["--attention-backend=AMX_MLA"], NO_ENV, None),
    ("float32", DEEPSEEK, True, ["--attention-backend=CPU_MLA"], NO_ENV, "float32"),
    ("float32", DEEPSEEK, True, ["--attention-backend", "cpu_mla"], NO_ENV, "float32"),
    ("float32", DEEPSEEK, True, [], {"VLLM_MLA_DISABLE": "1"}, "float32"),
    ("float32", DEEPSEEK, True, [], {"VLLM_MLA_DISABLE": "0"}, None),
    ("float32", {**DEEPSEEK, "is_causal": False}, True, [], NO_ENV, "float32"),
    ("float32", {**DEEPSEEK, "kv_lora_rank": None}, True, [], NO_ENV, "float32"),
    ("float32", QWEN, True, [], NO_ENV, "float32"),
    ("auto", QWEN, True, [], NO_ENV, "auto"),
    # a CPU without AMX (or a GPU): vLLM takes CPU_MLA, any dtype
    ("float32", DEEPSEEK, False, [], NO_ENV, "float32"),
    ("float16", K3, False, [], NO_ENV, "float16"),
    ("auto", DEEPSEEK, False, [], NO_ENV, "auto"),
    ("float32", QWEN, False, [], NO_ENV, "float32"),
]


@pytest.mark.parametrize("asked, config, amx, args, env, want", CASES)
def test_the_served_dtype_on_both_kinds_of_cpu(asked, config, amx, args, env, want):
    if want is None:
        with pytest.raises(DtypeRefused) as exc:
            served_dtype(asked, config, cpu_amx=amx, server_args=args, env=env)
        msg = str(exc.value)
        assert "\n" not in msg
        assert f"--vllm-dtype {asked} cannot be served" in msg
        assert "pass --vllm-dtype bfloat16" in msg and "AMX_MLA" in msg
        assert "--vllm-arg=--attention-backend=CPU_MLA" in msg
        return
    got = served_dtype(asked, config, cpu_amx=amx, server_args=args, env=env)
    assert got.dtype == want
    if asked == "auto" and want == "bfloat16":
        assert got.reason.startswith("dtype bfloat16 for --vllm-dtype auto: ")
        assert "AMX_MLA" in got.reason and "\n" not in got.reason
    else:
        assert got.reason is None


def test_the_refusal_names_the_callers_flags():
    with pytest.raises(DtypeRefused, match=r"^--dtype float32 cannot .* pass --dtype bfloat16 "):
        served_dtype("float32", DEEPSEEK, cpu_amx=True, env=NO_ENV, dtype_flag="--dtype")


def test_mla_as_transformers_and_the_bundled_k3_write_their_configs():
    import json
    from pathlib import Path

    from transformers import DeepseekV3Config, MixtralConfig, Qwen3MoeConfig

    bundled = Path(__file__).resolve().parents[1] / "models" / "tiny-k3-bilingual" / "config.json"
    assert uses_mla(json.loads(bundled.read_text()))
    assert uses_mla(DeepseekV3Config().to_dict())
    assert not uses_mla(Qwen3MoeConfig().to_dict())
    assert not uses_mla(MixtralConfig().to_dict())


# ---------------------------------------------------------------------------
# the refusal through the CLI, before a server starts (vLLM's answer faked: an AMX CPU)


@pytest.fixture
def amx_vllm(monkeypatch, tmp_path):
    """``--vllm-python`` that reports vLLM 0.32.0's CPU platform on an AMX CPU."""
    python = tmp_path / "python"
    python.write_text("")
    fake = vllm_check.VllmInfo(str(python), "0.32.0", cuda=False, cpu_amx=True)
    monkeypatch.setattr(vllm_check, "_probe_python", lambda _: fake)
    return python


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    import torch
    from eval_models import save_tiny

    return save_tiny(
        "deepseek_v3", tmp_path_factory.mktemp("ds") / "src", dtype=torch.bfloat16, kv_lora_rank=32
    )


def test_verify_vllm_refuses_float32_for_mla_on_an_amx_cpu(amx_vllm, deepseek, tmp_path):
    work = tmp_path / "work"
    res = CliRunner().invoke(
        app,
        ["verify", str(deepseek), "-q", "--vllm", "--vllm-python", str(amx_vllm),
         "--vllm-dtype", "float32", "--vllm-work-dir", str(work)],
    )  # fmt: skip
    assert res.exit_code == 2, res.output
    assert "--vllm-dtype float32 cannot be served" in res.output
    assert "pass --vllm-dtype bfloat16" in res.output
    assert not work.exists()  # refused before the reference or a server


def test_eval_vllm_refuses_float32_for_mla_on_an_amx_cpu(amx_vllm, deepseek, tmp_path):
    import shutil

    from eval_models import write_text

    text = write_text(tmp_path / "en.txt")
    candidate = shutil.copytree(deepseek, tmp_path / "candidate")
    work = tmp_path / "work"
    res = CliRunner().invoke(
        app,
        ["eval", str(deepseek), str(candidate), "--text", f"en={text}",
         "--windows", "2", "--window-tokens", "16", "--backend", "vllm",
         "--vllm-python", str(amx_vllm), "--dtype", "float32", "--vllm-work-dir", str(work)],
    )  # fmt: skip
    assert res.exit_code == 2, res.output
    assert "--dtype float32 cannot be served" in res.output
    assert "pass --dtype bfloat16" in res.output
    assert not work.exists()
