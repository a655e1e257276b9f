"""``reap_modifier.evaluation`` end to end with the transformers backend, on tiny checkpoints:
every metric equals an independent float64 recomputation (NLL, its standard error, top-1
agreement, exact KL, paired differences), the repeat check finds a planted loop, the windows are
the main job's, the top-N KL estimate obeys its stated bound, and a reference cache is reused
(the reference is not loaded again)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from eval_models import KEPT, make_eval_tokenizer, prune, save_tiny, write_text

from reap_modifier.evaluation import Settings, evaluate, prepare, topn_kl
from reap_modifier.evaluation.metrics import longest_repeat_run
from reap_modifier.evaluation.report import main_table, write_outputs
from reap_modifier.evaluation.texts import load_records, pick_prompts, sample_windows

SMALL = dict(windows=5, window_tokens=24, prompts=2, prompt_tokens=5, gen_tokens=12, chunk=2)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_ckpts")
    src = save_tiny("qwen3_moe", root / "src")
    pruned = prune(src, root / "pruned", KEPT["qwen3_moe"])
    loop = save_tiny("qwen3_moe", root / "loop")  # every logit 0: greedy always picks token 0
    from safetensors.torch import load_file, save_file

    f = loop / "model.safetensors"
    t = load_file(f)
    t["lm_head.weight"] = torch.zeros_like(t["lm_head.weight"])
    save_file(t, f, metadata={"format": "pt"})
    texts = {
        "en": str(write_text(root / "en.txt", seed=1)),
        "code": str(write_text(root / "code.jsonl", seed=2, kind="jsonl")),
    }
    return {"src": str(src), "pruned": str(pruned), "loop": str(loop), "texts": texts, "root": root}


def _model(path):
    from reap_modifier.models.loading import load_checkpoint_model

    return load_checkpoint_model(path, dtype="float32")


def brute(model, ref, windows):
    """Per window: mean NLL, agreement count, KL sum, in float64, one position at a time."""
    nll, agree, kl = [], 0.0, 0.0
    with torch.no_grad():
        lg = model(input_ids=windows).logits.double()
        rl = ref(input_ids=windows).logits.double()
    for b in range(windows.shape[0]):
        s = 0.0
        for t in range(windows.shape[1] - 1):
            lp = torch.log_softmax(lg[b, t], -1)
            rp = torch.log_softmax(rl[b, t], -1)
            s -= float(lp[windows[b, t + 1]])
            agree += float(lp.argmax() == rp.argmax())
            kl += float((rp.exp() * (rp - lp)).sum())
        nll.append(s / (windows.shape[1] - 1))
    n = windows.shape[0] * (windows.shape[1] - 1)
    return nll, agree / n, kl / n


def _se(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


@pytest.fixture(scope="module")
def run1(ckpts):
    s = Settings(**SMALL, dtype="float32")
    prep = prepare(ckpts["src"], [ckpts["pruned"], ckpts["loop"]], ckpts["texts"], s)
    return prep, evaluate(prep)


def test_every_metric_equals_an_independent_recomputation(ckpts, run1):
    prep, res = run1
    ref = _model(ckpts["src"])
    assert res["kl_method"] == "exact" and res["backend"] == "transformers"
    for cand in (ckpts["pruned"], ckpts["loop"]):
        model = _model(cand)
        for label, w in prep.windows.items():
            got = res["models"][cand][label]
            nll, agree, kl = brute(model, ref, w)
            ref_nll, _, _ = brute(ref, ref, w)
            assert got["nll"] == pytest.approx(sum(nll) / len(nll), rel=1e-5)
            assert got["ppl"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5)
            assert got["nll_se"] == pytest.approx(_se(nll), rel=1e-3)
            assert got["top1"] == pytest.approx(agree)
            assert got["kl"] == pytest.approx(kl, rel=1e-4, abs=1e-7)
            d = [b - a for a, b in zip(ref_nll, nll)]
            assert got["vs_reference"]["mean"] == pytest.approx(sum(d) / len(d), rel=1e-4, abs=1e-7)
            assert got["vs_reference"]["se"] == pytest.approx(_se(d), rel=1e-3)
            assert got["tokens"] == w.shape[0] * (w.shape[1] - 1)
            r = res["models"][ckpts["src"]][label]
            assert r["kl"] is None and r["top1"] == 1.0
            assert r["nll"] == pytest.approx(sum(ref_nll) / len(ref_nll), rel=1e-5)
    # the pruned model is measurably different, the loop model much worse
    assert 0 < res["models"][ckpts["pruned"]]["en"]["kl"] < res["models"][ckpts["loop"]]["en"]["kl"]
    assert res["paired"][0]["a"] == ckpts["pruned"] and res["paired"][0]["b"] == ckpts["loop"]


def test_repeat_check_finds_the_planted_loop(ckpts, run1):
    prep, res = run1
    for label in prep.windows:
        loop = res["models"][ckpts["loop"]][label]
        assert loop["repeat_run_max"] == SMALL["gen_tokens"]  # one token, every step
        assert [g["ids"] for g in res["generations"][ckpts["loop"]][label]] == [
            [0] * SMALL["gen_tokens"]
        ] * SMALL["prompts"]
        model = _model(ckpts["pruned"])
        batch = torch.tensor([p["ids"] for p in prep.prompts[label]])
        x = batch
        with torch.no_grad():
            for _ in range(SMALL["gen_tokens"]):
                x = torch.cat([x, model(input_ids=x).logits[:, -1].argmax(-1, keepdim=True)], 1)
        gens = x[:, batch.shape[1] :].tolist()
        assert [g["ids"] for g in res["generations"][ckpts["pruned"]][label]] == gens
        runs = [longest_repeat_run(g)[0] for g in gens]
        assert res["models"][ckpts["pruned"]][label]["repeat_run_max"] == max(runs)
        assert res["models"][ckpts["pruned"]][label]["repeat_run_mean"] == sum(runs) / len(runs)


def test_windows_are_the_main_jobs(tmp_path):
    """Same records, tokenizer, seed and sizes: the windows (and prompts) the main job draws."""
    from reap_modifier.demo import data as D
    from reap_modifier.demo.inputs import pick_prompts as demo_prompts

    path = write_text(tmp_path / "x.jsonl", paragraphs=40, seed=3, kind="jsonl")
    recs = load_records(path)
    tok = make_eval_tokenizer()
    want = D.eval_windows(recs, tok, 6, seq_len=20, seed=1234)
    assert torch.equal(sample_windows(recs, tok, 6, 20, 1234), want)
    assert not torch.equal(sample_windows(recs, tok, 6, 20, 1235), want)
    assert [p["ids"] for p in pick_prompts(recs, tok, 3, 5, 7)] == [
        p["ids"] for p in demo_prompts(recs, tok, 3, 5, 7)
    ]


def test_text_formats(tmp_path):
    (tmp_path / "a.txt").write_text("t2 t3\n\n\n t4 t5 \n\n")
    assert load_records(tmp_path / "a.txt") == [{"text": "t2 t3"}, {"text": "t4 t5"}]
    (tmp_path / "b.jsonl").write_text('{"body": "t2"}\n\n{"body": "t3", "source": "s"}\n')
    assert load_records(tmp_path / "b.jsonl", "body") == [
        {"text": "t2"},
        {"text": "t3", "source": "s"},
    ]
    (tmp_path / "c.csv").write_text("text,n\nt2 t3,1\nt4,2\n")
    assert [r["text"] for r in load_records(tmp_path / "c.csv")] == ["t2 t3", "t4"]


# ----------------------------------------------------------------------------- top-N KL


def _dists(V=50, M=200, seed=0, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    p = torch.log_softmax(torch.randn(M, V, generator=g, dtype=torch.float64) * spread, -1)
    q = torch.log_softmax(p + torch.randn(M, V, generator=g, dtype=torch.float64) * 0.7, -1)
    return p, q


def test_topn_kl_is_a_lower_bound_with_the_stated_gap():
    p, q = _dists()
    exact = (p.exp() * (p - q)).sum(-1)
    for K in (1, 3, 10, 50):
        pv, pi = p.topk(K, -1)
        # candidate log-probs known at the reference's top-K (transformers with a cached reference)
        est, m = topn_kl(pi, pv, pi, q.gather(-1, pi))
        assert torch.all(est <= exact + 1e-9) and torch.all(est >= 0)
        # the gap is m * KL of the renormalized tails (the stated identity)
        mask = torch.ones_like(p, dtype=torch.bool).scatter(-1, pi, False)
        pt = torch.where(mask, p, -math.inf)
        qt = torch.where(mask, q, -math.inf)
        if K < p.shape[-1]:
            ptn = pt - torch.logsumexp(pt, -1, keepdim=True)
            qtn = qt - torch.logsumexp(qt, -1, keepdim=True)
            tail_kl = torch.where(mask, ptn.exp() * (ptn - qtn), 0.0).sum(-1)
            torch.testing.assert_close(exact - est, m * tail_kl, atol=1e-9, rtol=1e-6)
            torch.testing.assert_close(m, 1 - pv.exp().sum(-1))
        else:
            torch.testing.assert_close(est, exact, atol=1e-9, rtol=1e-9)  # K = V: exact
        # candidate's own top-K (a serving engine): still a lower bound
        qv, qi = q.topk(K, -1)
        est2, m2 = topn_kl(pi, pv, qi, qv)
        assert torch.all(est2 <= exact + 1e-9) and torch.all(m2 >= m - 1e-12)


# ----------------------------------------------------------------------------- cache, report


def test_reference_cache_is_reused_and_reference_not_loaded(ckpts, run1, monkeypatch, tmp_path):
    import reap_modifier.evaluation.run as R

    _, exact = run1
    s = Settings(**SMALL, dtype="float32", reference_cache=str(tmp_path / "cache"))
    loaded = []
    real = R._load_model
    monkeypatch.setattr(R, "_load_model", lambda p, *a: loaded.append(p) or real(p, *a))
    first = evaluate(prepare(ckpts["src"], [ckpts["pruned"]], ckpts["texts"], s))
    assert loaded == [ckpts["src"], ckpts["pruned"]] and not first["reference_from_cache"]
    assert json.loads((tmp_path / "cache" / "reference.json").read_text())["top_n"] == 20
    loaded.clear()
    second = evaluate(prepare(ckpts["src"], [ckpts["pruned"]], ckpts["texts"], s))
    assert loaded == [ckpts["pruned"]] and second["reference_from_cache"]  # reference: 0 loads
    assert second["kl_method"].startswith("top-20 estimate")
    for label in ckpts["texts"]:
        a, b = exact["models"][ckpts["pruned"]][label], second["models"][ckpts["pruned"]][label]
        assert b["nll"] == pytest.approx(a["nll"], rel=1e-6)
        assert b["top1"] == pytest.approx(a["top1"])
        assert 0 < b["kl"] <= a["kl"] + 1e-6  # the estimate is a lower bound
        assert 0 <= b["kl_tail_mass"] < 1
        assert (
            second["generations"][ckpts["src"]][label] == exact["generations"][ckpts["src"]][label]
        )
        r1, r2 = exact["models"][ckpts["src"]][label], second["models"][ckpts["src"]][label]
        assert r2["nll"] == pytest.approx(r1["nll"], rel=1e-6)
    # top-N = the vocabulary: the cached estimate is the exact KL
    full = Settings(**SMALL, dtype="float32", top_n=128, reference_cache=str(tmp_path / "c128"))
    evaluate(prepare(ckpts["src"], [ckpts["pruned"]], ckpts["texts"], full))
    again = evaluate(prepare(ckpts["src"], [ckpts["pruned"]], ckpts["texts"], full))
    assert again["reference_from_cache"]
    for label in ckpts["texts"]:
        a, b = exact["models"][ckpts["pruned"]][label], again["models"][ckpts["pruned"]][label]
        assert b["kl"] == pytest.approx(a["kl"], rel=1e-4) and b["kl_tail_mass"] < 1e-5
    # other windows: the cache does not match, the reference runs again
    loaded.clear()
    s2 = Settings(**{**SMALL, "seed": 99}, dtype="float32", reference_cache=str(tmp_path / "cache"))
    third = evaluate(prepare(ckpts["src"], [ckpts["pruned"]], ckpts["texts"], s2))
    assert loaded == [ckpts["src"], ckpts["pruned"]] and not third["reference_from_cache"]


def test_report_files_and_json_schema(ckpts, run1, tmp_path):
    _, res = run1
    paths = write_outputs(res, tmp_path / "o")
    data = json.loads(paths["json"].read_text())
    assert data["format"] == "reap-eval" and data["version"] == 1
    assert data["backend"] == "transformers" and data["dtype"] == "float32"
    for name in (ckpts["src"], ckpts["pruned"], ckpts["loop"]):
        for label in ("en", "code"):
            m = data["models"][name][label]
            for k in ("nll", "nll_se", "top1", "kl", "repeat_run_max"):
                assert k in m
            assert 0 <= m["top1"] <= 1
    assert len(data["texts"]["en"]["windows_sha256"]) == 64
    assert paths["png"].stat().st_size > 1000
    md = paths["md"].read_text()
    assert main_table(res) in md and "ΔNLL" in md
    assert f"| {ckpts['pruned']} | en | {res['models'][ckpts['pruned']]['en']['nll']:.4f}" in md


# ----------------------------------------------------------------------------- lm-eval


def test_lm_eval_local_task_through_transformers_equals_the_oracle(ckpts, tmp_path):
    pytest.importorskip("lm_eval")
    from eval_models import mc_accuracy, write_local_task

    task_dir, rows = write_local_task(tmp_path / "tasks")
    s = Settings(**SMALL, dtype="float32", lm_eval_tasks=["reap_tiny_mc"],
                 lm_eval_include=str(task_dir))  # fmt: skip
    res = evaluate(prepare(ckpts["src"], [ckpts["pruned"]], ckpts["texts"], s))
    for name in (ckpts["src"], ckpts["pruned"]):
        acc = res["lm_eval"]["results"][name]["reap_tiny_mc"]["acc"]
        assert acc["value"] == pytest.approx(mc_accuracy(_model(name), rows))
        want_se = math.sqrt(acc["value"] * (1 - acc["value"]) / (len(rows) - 1))
        assert acc["stderr"] == pytest.approx(want_se, rel=1e-6)


# ----------------------------------------------------------------------------- cache identity


def _perturbed_router_copy(src: str, dst: Path) -> str:
    """A copy of ``src`` whose routers differ (same config, names, shapes and sizes)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    t = load_file(f)
    for name in [n for n in t if n.endswith("mlp.gate.weight")]:
        t[name] = t[name].flip(0).contiguous()
    save_file(t, f, metadata={"format": "pt"})
    return str(dst)


@pytest.mark.parametrize("other", ["pruned", "router_fitted"])
def test_a_cache_of_another_reference_is_recomputed(ckpts, other, tmp_path, monkeypatch):
    """A cache written with reference A, then an evaluation with reference B: B runs, and
    every number equals a run of B without a cache."""
    import reap_modifier.evaluation.run as R

    a = ckpts["src"] if other == "pruned" else ckpts["pruned"]
    b = ckpts["pruned"] if other == "pruned" else _perturbed_router_copy(a, tmp_path / "fit")
    cache = str(tmp_path / "cache")
    evaluate(prepare(a, [ckpts["loop"]], ckpts["texts"], Settings(**SMALL, reference_cache=cache)))
    loaded, logs = [], []
    real = R._load_model
    monkeypatch.setattr(R, "_load_model", lambda p, *x: loaded.append(p) or real(p, *x))
    s = Settings(**SMALL, reference_cache=cache)
    got = evaluate(prepare(b, [ckpts["loop"]], ckpts["texts"], s), log=logs.append)
    want = evaluate(prepare(b, [ckpts["loop"]], ckpts["texts"], Settings(**SMALL)))
    assert loaded[0] == b and not got["reference_from_cache"] and got["kl_exact"]
    (why,) = [line for line in logs if line.startswith(f"reference cache {cache}")]
    reason = "config.json" if other == "pruned" else "model.safetensors"
    assert "not reused (the " in why and reason in why, why
    for name in (b, ckpts["loop"]):
        for label in ckpts["texts"]:
            g, w = got["models"][name][label], want["models"][name][label]
            for k in ("nll", "nll_se", "top1", "kl", "nll_per_window", "vs_reference"):
                assert g.get(k) == w.get(k), (name, label, k)
    # the cache now holds B: reused for B
    again = evaluate(prepare(b, [ckpts["loop"]], ckpts["texts"], s))
    assert again["reference_from_cache"]


def test_identity_names_what_differs(ckpts, tmp_path):
    import os
    import shutil

    from reap_modifier.evaluation.cache import identity_difference, reference_identity

    d = Path(shutil.copytree(ckpts["pruned"], tmp_path / "p"))
    before = reference_identity(d)
    assert identity_difference(before, reference_identity(d)) is None
    assert "does not record" in identity_difference(None, before)
    st = (d / "model.safetensors").stat()
    os.utime(d / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert identity_difference(before, reference_identity(d)) == (
        "the modification time of the reference's model.safetensors differs"
    )
    (d / "config.json").write_text((d / "config.json").read_text() + " ")
    assert identity_difference(before, reference_identity(d)) == (
        "the reference's config.json differs"
    )
    fp = reference_identity(ckpts["pruned"])["weights"]["model.safetensors"]
    assert fp["bytes"] == (Path(ckpts["pruned"]) / "model.safetensors").stat().st_size
    assert fp["checksum"].startswith("xxh3_128:")  # from the prune manifest
