"""``reap eval --backend vllm`` (vLLM 0.32 CPU build in its own venv, ``.venv-vllm``) against the
transformers backend on the same tiny bf16 checkpoints (Qwen3-MoE unpruned and pruned, OLMoE
pruned; one tokenizer), float32 compute on both sides.

Stated tolerances: NLL within 1e-4 nats per token (absolute; per window too); top-1 agreement
within one position of all predicted positions (a float32 near-tie may flip one argmax); the
KL estimate lies in its bound ``0 <= KL_est <= KL_exact`` and equals the same top-N estimator
computed from transformers' logits within 1e-4. Throughput figures are positive; a second run
with the reference cache serves the reference zero times; the lm-eval local task gives the same
accuracy through vLLM (local-completions) and transformers.

Server starts are shared: one vLLM run (3 servers), one transformers run, one cached run
(1 server). Without vLLM these tests skip, unless ``REAP_REQUIRE_VLLM=1`` (then they fail).

An MLA model (DeepSeek-V3, unpruned and pruned) runs in bfloat16, the dtype every vLLM CPU
attention for MLA computes in (2 servers): the default ``--dtype`` becomes bfloat16 on an AMX CPU,
said in one note before the servers start; the NLL equals the transformers backend's in bfloat16
within 0.03 nats per token (measured: 0.001-0.011; vLLM's bf16 batches vary from run to run), and
the pruned model's top-1 agreement with the unpruned one (under 0.5: the comparison tells the two
apart) within 5 of 92 positions of it (measured: 0-2; bf16 near-ties flip argmaxes).
"""

from __future__ import annotations

import json

import pytest
import torch
from eval_models import KEPT, prune, save_tiny, write_local_task, write_text
from test_vllm_serving import KEPT as SERVING_KEPT
from test_vllm_serving import (
    VLLM_CPU_OVERRIDES,
    cpu_has_amx,
    vllm_python,  # noqa: F401 - the fixture (install wait, REQUIRE)
)
from typer.testing import CliRunner

from reap_modifier.cli import app

TOP_N = 8
COMMON = ["--windows", "4", "--window-tokens", "24", "--prompts", "2", "--prompt-tokens", "5",
          "--gen-tokens", "8", "--dtype", "float32", "--top-n", str(TOP_N)]  # fmt: skip


def _run(*args) -> dict:
    r = CliRunner().invoke(app, ["eval", *map(str, args)])
    assert r.exit_code == 0, r.output
    return r


@pytest.fixture(scope="module")
def runs(tmp_path_factory, vllm_python):  # noqa: F811
    root = tmp_path_factory.mktemp("eval_vllm")
    bf16 = torch.bfloat16
    qsrc = save_tiny("qwen3_moe", root / "qwen", dtype=bf16, vllm=True)
    qpr = prune(qsrc, root / "qwen-pruned", KEPT["qwen3_moe"])
    osrc = save_tiny("olmoe", root / "olmoe", dtype=bf16, vllm=True, seed=1)
    opr = prune(osrc, root / "olmoe-pruned", KEPT["olmoe"])
    en = write_text(root / "en.txt", seed=4)
    task_dir, rows = write_local_task(root / "tasks")
    lm = ["--lm-eval", "reap_tiny_mc", "--lm-eval-include", task_dir]
    base = [*COMMON, "--text", f"en={en}", *lm]
    cache = root / "cache"
    vllm = ["--backend", "vllm", "--vllm-python", vllm_python, "--reference-cache", cache]
    _run(qsrc, qpr, opr, *base, *vllm, "-o", root / "o-vllm")
    _run(qsrc, qpr, opr, *base, "-o", root / "o-tf")
    _run(qsrc, opr, *base, *vllm, "-o", root / "o-cached")
    load = lambda d: json.loads((root / d / "eval.json").read_text())  # noqa: E731
    return {
        "vllm": load("o-vllm"),
        "tf": load("o-tf"),
        "cached": load("o-cached"),
        "root": root,
        "models": [str(qsrc), str(qpr), str(opr)],
    }


def test_nll_and_top1_equal_the_transformers_backend(runs):
    v, t = runs["vllm"], runs["tf"]
    assert v["backend"] == "vllm" and t["backend"] == "transformers"
    for name in runs["models"]:
        a, b = v["models"][name]["en"], t["models"][name]["en"]
        assert a["tokens"] == b["tokens"] == 4 * 23
        assert a["nll"] == pytest.approx(b["nll"], abs=1e-4), name
        for x, y in zip(a["nll_per_window"], b["nll_per_window"]):
            assert x == pytest.approx(y, abs=1e-4)
        assert abs(a["top1"] - b["top1"]) * a["tokens"] <= 1, (name, a["top1"], b["top1"])
        assert [g["ids"] for g in v["generations"][name]["en"]] == [
            g["ids"] for g in t["generations"][name]["en"]
        ]
    assert v["texts"]["en"]["windows_sha256"] == t["texts"]["en"]["windows_sha256"]


def test_kl_estimate_lies_within_its_bound_and_equals_the_estimator_on_transformers_logits(runs):
    from reap_modifier.evaluation import Settings, prepare, topn_kl
    from reap_modifier.models.loading import load_checkpoint_model

    v, t = runs["vllm"], runs["tf"]
    ref_path = runs["models"][0]
    s = Settings(windows=4, window_tokens=24, seed=1234, prompts=0)
    w = prepare(ref_path, runs["models"][1:], {"en": v["texts"]["en"]["path"]}, s).windows["en"]
    with torch.no_grad():
        ref = load_checkpoint_model(ref_path, dtype="float32")(input_ids=w).logits[:, :-1]
        rlp = torch.log_softmax(ref.float(), -1).flatten(0, 1)
    for name in runs["models"][1:]:
        est, exact = v["models"][name]["en"]["kl"], t["models"][name]["en"]["kl"]
        assert 0 <= est <= exact + 1e-5, (name, est, exact)
        assert 0 < v["models"][name]["en"]["kl_tail_mass"] < 1
        with torch.no_grad():
            cl = load_checkpoint_model(name, dtype="float32")(input_ids=w).logits[:, :-1]
        clp = torch.log_softmax(cl.float(), -1).flatten(0, 1)
        rv, ri = rlp.topk(TOP_N, -1)
        cv, ci = clp.topk(TOP_N, -1)
        want, _ = topn_kl(ri, rv, ci, cv)
        assert est == pytest.approx(float(want.mean()), abs=1e-4)


def test_throughput_is_positive_for_every_served_model(runs):
    for name in runs["models"]:
        tp = runs["vllm"]["throughput"][name]
        assert tp["prompt_tokens_per_s"] > 0 and tp["generated_tokens_per_s"] > 0
        assert tp["prompt_tokens"] == 4 * 24 and tp["generated_tokens"] == 2 * 8
    assert runs["tf"]["throughput"] == {}


def test_second_run_serves_the_reference_zero_times(runs):
    c, v = runs["cached"], runs["vllm"]
    ref, opr = runs["models"][0], runs["models"][2]
    assert c["reference_from_cache"] and not v["reference_from_cache"]
    logs = sorted(p.name for p in (runs["root"] / "o-cached" / "vllm").glob("vllm-server-*.log"))
    assert logs == ["vllm-server-0.log"]  # one server: the candidate
    assert f"model='{opr}'" in (runs["root"] / "o-cached" / "vllm" / logs[0]).read_text()
    assert list(c["throughput"]) == [opr]
    assert c["models"][opr]["en"]["nll"] == pytest.approx(v["models"][opr]["en"]["nll"], abs=1e-6)
    assert c["models"][opr]["en"]["kl"] == pytest.approx(v["models"][opr]["en"]["kl"], abs=1e-6)
    assert c["models"][ref]["en"]["nll"] == v["models"][ref]["en"]["nll"]
    assert c["lm_eval"]["results"][ref] == v["lm_eval"]["results"][ref]  # from the cache


def test_lm_eval_local_task_same_accuracy_through_vllm_and_transformers(runs):
    for name in runs["models"]:
        a = runs["vllm"]["lm_eval"]["results"][name]["reap_tiny_mc"]["acc"]
        b = runs["tf"]["lm_eval"]["results"][name]["reap_tiny_mc"]["acc"]
        assert a["value"] == b["value"] and a["stderr"] == pytest.approx(b["stderr"])


def test_mla_model_served_in_bfloat16_scores_as_the_transformers_backend(
    tmp_path,
    vllm_python,  # noqa: F811
):
    bf16 = torch.bfloat16
    src = save_tiny("deepseek_v3", tmp_path / "ds", dtype=bf16, **VLLM_CPU_OVERRIDES["deepseek_v3"])
    pruned = prune(src, tmp_path / "ds-pruned", SERVING_KEPT["deepseek_v3"])
    en = write_text(tmp_path / "en.txt", seed=4)
    args = [src, pruned, "--text", f"en={en}", *COMMON[: COMMON.index("--dtype")], "--top-n", TOP_N]
    vllm = ["--backend", "vllm", "--vllm-python", vllm_python]
    res = _run(*args, *vllm, "-o", tmp_path / "v")
    _run(*args, "--dtype", "bfloat16", "-o", tmp_path / "t")
    v, t = (json.loads((tmp_path / d / "eval.json").read_text()) for d in ("v", "t"))
    amx = cpu_has_amx()
    assert v["dtype"] == ("bfloat16" if amx else "auto") and t["dtype"] == "bfloat16"
    assert ("note: dtype bfloat16 for --dtype auto: " in res.output) == amx
    a, b = v["models"], t["models"]
    for name in (str(src), str(pruned)):
        assert abs(a[name]["en"]["nll"] - b[name]["en"]["nll"]) < 0.03, name
    x, y = a[str(pruned)]["en"], b[str(pruned)]["en"]
    assert abs(x["top1"] - y["top1"]) * x["tokens"] <= 5 and y["top1"] < 0.5, (x["top1"], y["top1"])
