"""Pruned GGUFs run in llama.cpp (llama-cpp-python): the logits of ``reap prune``'s output
equal transformers' on the hand-pruned model (f32 GGUF, f32 KV cache: within 1e-4), and for
a sigmoid router with a bias, the unpruned GGUF with ``exp_probs_b = -1e30`` on the dropped
experts gives exactly the pruned GGUF's logits in llama.cpp (the masked-routing oracle, no
transformers at all). The K3 test-bed (``k3_testbed``: situ, attention residuals, MXFP4
routed experts) gets the masked-routing oracle with one of its layers made a KDA layer
(``with_kda_layer``): llama.cpp cannot run a K3 without one. Its comparison with transformers
(tolerance: llama.cpp's q8_0 rounding of the MXFP4 experts' inputs) skips while llama.cpp
aborts on the all-MLA GGUF; transformers cannot run a KDA layer on CPU.

Needs ``scripts/llama_cpp_venv.sh`` (a build of minutes, not run by ``scripts/test.sh``) and
the converter: skipped without them unless ``REAP_REQUIRE_LLAMA_CPP=1``."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_oracle import ROOT, bpe_tokenizer, convert, prune_safetensors, require_converter

from reap_modifier.gguf import prepare_gguf_rewrite
from reap_modifier.scores.plan import PruningPlan

PYTHON = Path(os.environ.get("REAP_LLAMA_CPP_PYTHON", ROOT / ".venv-llama-cpp/bin/python"))
PROBE = Path(__file__).parent / "oracles" / "llama_cpp_probe.py"
IDS = [1, 17, 5, 99, 42, 8, 63, 120, 3, 77, 31, 12]
KEPT = {
    "qwen3_moe": {0: [1, 2, 5, 7, 8, 11, 12, 15], 1: [0, 3, 4, 6, 9, 10, 13, 14]},
    "deepseek_v3": {1: [0, 2, 5, 6, 8, 11, 13, 15], 2: [1, 3, 4, 7, 9, 10, 14, 15]},
}
SIZES = {
    "qwen3_moe": dict(num_experts=16, hidden_size=64, moe_intermediate_size=32, head_dim=32),
    # llama.cpp's deepseek2 loader needs a q_lora_rank (the real model has one)
    "deepseek_v3": dict(
        hidden_size=64, moe_intermediate_size=32, intermediate_size=64, q_lora_rank=16
    ),
}


@pytest.fixture(scope="module")
def llama_cpp():
    require_converter()
    ok = PYTHON.is_file() and subprocess.run([PYTHON, "-c", "import llama_cpp"]).returncode == 0
    if not ok:
        why = f"no llama-cpp-python at {PYTHON}: run scripts/llama_cpp_venv.sh"
        if os.environ.get("REAP_REQUIRE_LLAMA_CPP"):
            pytest.fail(why)
        pytest.skip(why)


def run_probe(path: Path, tmp: Path, ids: list[int]) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp / f"{path.stem}.logits.npy"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [PYTHON, PROBE, str(path), json.dumps(ids), str(out)],
        capture_output=True,
        text=True,
        env=env,
    )
    return proc, out


def llama_logits(path: Path, tmp: Path, ids: list[int] = IDS) -> np.ndarray:
    proc, out = run_probe(path, tmp, ids)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return np.load(out)


#: why the K3 test-bed without a KDA layer does not run in llama.cpp: the hybrid memory's
#: ``rs_s_copy`` input is read only by KDA layers, so with none it is never allocated
K3_NO_KDA_ABORT = (
    "llama.cpp aborts on a K3 GGUF without a KDA layer: llama-graph.cpp:1155 "
    "(llm_graph_input_mem_hybrid_k::set_input) GGML_ASSERT(ggml_backend_buffer_is_host("
    "inp_rs->s_copy->buffer)) -> ggml-backend.cpp:205 GGML_ASSERT(buffer) failed, "
    "rs_s_copy never allocated; transformers' K3 KDA needs fla (GPU)"
)


def transformers_logits(model_dir: Path) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].numpy()


def saved_model(family: str, root: Path) -> Path:
    """A tiny model saved with a tokenizer; DeepSeek-V3's config states its sigmoid routing
    (transformers' does not, and llama.cpp's converter needs it)."""
    from tiny_models import build_tiny

    torch.set_num_threads(1)
    model, _ = build_tiny(family, **SIZES[family])
    src = root / family
    model.save_pretrained(src)
    bpe_tokenizer().save_pretrained(src)
    if family == "deepseek_v3":
        cfg = json.loads((src / "config.json").read_text())
        cfg["scoring_func"] = "sigmoid"
        (src / "config.json").write_text(json.dumps(cfg, indent=2))
    return src


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_pruned_gguf_logits_equal_transformers(llama_cpp, tmp_path, family):
    src = saved_model(family, tmp_path)
    pruned = tmp_path / f"{family}-pruned"
    prune_safetensors(src, pruned, KEPT[family])
    gguf_src = convert(src, tmp_path / "src.gguf", "f32")
    ours = tmp_path / "ours.gguf"
    plan = PruningPlan(
        kept={f"model.layers.{L}.mlp": v for L, v in KEPT[family].items()}, num_experts=16
    )
    prepare_gguf_rewrite(gguf_src, plan, ours, progress=False).run()
    got = llama_logits(ours, tmp_path)
    want = transformers_logits(pruned)
    assert got.shape == want.shape
    assert np.abs(got - want).max() < 1e-4, np.abs(got - want).max()
    # and the unpruned model differs by far more: the check can see a wrong cut
    assert np.abs(llama_logits(gguf_src, tmp_path) - want).max() > 1e-2


def masked_copy(src: Path, dst: Path, kept: dict[int, list[int]], num_experts: int) -> Path:
    """A copy of the GGUF ``src`` whose ``exp_probs_b`` is -1e30 on every expert not in
    ``kept`` (layer index -> kept ids): the masked-routing oracle inside llama.cpp."""
    import gguf

    dst.write_bytes(src.read_bytes())
    reader = gguf.GGUFReader(dst, "r+")
    for t in reader.tensors:
        if t.name.endswith("exp_probs_b.bias"):
            layer = int(t.name.split(".")[1])
            t.data[[e for e in range(num_experts) if e not in kept[layer]]] = -1e30
    reader.data.flush()
    del reader
    return dst


def test_masked_routing_oracle_in_llama_cpp(llama_cpp, tmp_path):
    """DeepSeek-V3 (sigmoid + ``exp_probs_b``, 4 groups): the unpruned GGUF with the
    dropped experts' bias at -1e30 routes exactly as the pruned one."""

    src = saved_model("deepseek_v3", tmp_path)
    gguf_src = convert(src, tmp_path / "src.gguf", "f32")
    masked = masked_copy(gguf_src, tmp_path / "masked.gguf", KEPT["deepseek_v3"], 16)
    ours = tmp_path / "ours.gguf"
    plan = PruningPlan(
        kept={f"model.layers.{L}.mlp": v for L, v in KEPT["deepseek_v3"].items()}, num_experts=16
    )
    prepare_gguf_rewrite(gguf_src, plan, ours, progress=False).run()
    diff = np.abs(llama_logits(ours, tmp_path) - llama_logits(masked, tmp_path)).max()
    assert diff == 0.0, diff


def test_reap_verify_llama_cpp(llama_cpp, tmp_path):
    """``reap verify X.gguf --llama-cpp --reference DIR`` passes against the pruned model and
    fails against the unpruned one."""
    from badinput import cli

    src = saved_model("qwen3_moe", tmp_path)
    pruned = tmp_path / "pruned"
    prune_safetensors(src, pruned, KEPT["qwen3_moe"])
    gguf_src = convert(src, tmp_path / "src.gguf", "f32")
    plan = PruningPlan(
        kept={f"model.layers.{L}.mlp": v for L, v in KEPT["qwen3_moe"].items()}, num_experts=16
    )
    ours = prepare_gguf_rewrite(gguf_src, plan, tmp_path / "ours.gguf", progress=False).run()
    py = ["--llama-cpp-python", PYTHON]
    res = cli("verify", ours, "--source", gguf_src, "--llama-cpp", "--reference", pruned, *py, "-q")
    assert res.exit_code == 0, res.output
    assert "llama.cpp check OK" in res.output
    res = cli("verify", ours, "--llama-cpp", "--reference", src, *py, "-q")
    assert res.exit_code == 1 and "llama.cpp check FAILED" in res.output
    res = cli("verify", ours, "--llama-cpp", "-q")
    assert res.exit_code == 2 and "give --reference" in res.output


@pytest.fixture(scope="module")
def k3(llama_cpp, tmp_path_factory):
    """The K3 test-bed pruned by the modifier, its unpruned f32 GGUF (MXFP4 experts) and
    ``reap prune``'s cut of it: (root, plan, source GGUF, pruned GGUF)."""
    from k3_testbed import build_k3_testbed, prune_with_reap

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("k3-llama-cpp")
    build_k3_testbed(root / "src")
    plan = prune_with_reap(root / "src", root / "pruned")
    plan.save(root / "plan.json")
    gguf_src = convert(root / "src", root / "src.gguf", "f32")
    ours = prepare_gguf_rewrite(gguf_src, plan, root / "ours.gguf", progress=False).run()
    return root, plan, gguf_src, ours


def test_k3_pruned_gguf_logits_equal_transformers(k3, tmp_path):
    """The pruned K3 GGUF in llama.cpp against transformers on the modifier's pruned
    checkpoint (experts dequantized): within ``LLAMA_CPP_TOL``, the same top-1 token
    everywhere; the unpruned GGUF is far off. Skips while llama.cpp aborts on the test-bed
    (no KDA layer: ``K3_NO_KDA_ABORT``), and only on that abort."""
    from k3_testbed import IDS as K3_IDS
    from k3_testbed import LLAMA_CPP_TOL, reference_logits

    root, _, gguf_src, ours = k3
    proc, out = run_probe(ours, tmp_path, K3_IDS)
    if proc.returncode != 0 and "GGML_ASSERT(buffer) failed" in proc.stderr:
        pytest.skip(K3_NO_KDA_ABORT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = np.load(out)
    want = reference_logits(root / "pruned", K3_IDS)
    assert got.shape == want.shape
    assert np.abs(got - want).max() < LLAMA_CPP_TOL, np.abs(got - want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(llama_logits(gguf_src, tmp_path, K3_IDS) - want).max() > 5 * LLAMA_CPP_TOL


def k3_kda_gguf(k3, tmp: Path) -> tuple[Path, Path]:
    """The test-bed with layer ``KDA_LAYER`` made a KDA layer (random weights), converted
    (f32, MXFP4 experts), and ``reap prune`` of that GGUF with the modifier's plan:
    (source GGUF, pruned GGUF)."""
    from badinput import cli
    from k3_testbed import with_kda_layer

    root = k3[0]
    kda = with_kda_layer(root / "src", tmp / "kda")
    gguf_src = convert(kda, tmp / "kda-src.gguf", "f32")
    ours = tmp / "kda-ours.gguf"
    res = cli("prune", gguf_src, "--plan", root / "plan.json", "-o", ours, "--no-provenance", "-q")
    assert res.exit_code == 0, res.output
    return gguf_src, ours


def k3_masked_routing_diffs(k3, tmp: Path) -> tuple[float, float]:
    """On the KDA test-bed in llama.cpp: max |logits(pruned GGUF) - logits(unpruned GGUF with
    the dropped experts' ``exp_probs_b`` at -1e30)| and max |logits(pruned) -
    logits(unpruned, unmasked)|."""
    from k3_testbed import IDS as K3_IDS

    plan = k3[1]
    gguf_src, ours = k3_kda_gguf(k3, tmp)
    kept = {int(k.split(".")[3]): v for k, v in plan.kept.items()}
    masked = masked_copy(gguf_src, tmp / "kda-masked.gguf", kept, plan.num_experts)
    got = llama_logits(ours, tmp, K3_IDS)
    masked_diff = np.abs(got - llama_logits(masked, tmp, K3_IDS)).max()
    unmasked_diff = np.abs(got - llama_logits(gguf_src, tmp, K3_IDS)).max()
    return float(masked_diff), float(unmasked_diff)


def test_k3_masked_routing_oracle_in_llama_cpp(k3, tmp_path):
    """K3 (sigmoid + ``exp_probs_b``, latent MoE, MXFP4, one KDA layer): the unpruned GGUF
    with the dropped experts' bias at -1e30 gives exactly the pruned GGUF's logits, and the
    unmasked one does not."""
    masked_diff, unmasked_diff = k3_masked_routing_diffs(k3, tmp_path)
    assert masked_diff == 0.0, masked_diff
    assert unmasked_diff > 1e-2, unmasked_diff
