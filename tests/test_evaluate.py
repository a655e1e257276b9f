"""``reap_modifier.evaluation`` (the main job's metrics): NLL / perplexity, top-1 agreement and KL against a reference model,
greedy generation and the longest repeated-substring run -- against brute-force references on tiny
random models (a two-layer toy LM and a tiny random Kimi-K3-architecture model)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from eval_helpers import evaluate_model

from reap_modifier.evaluation import (
    WindowMetrics,
    evaluate_models,
    greedy_generate,
    longest_repeat_run,
    paired_difference,
    repetition_stats,
    token_metrics,
)


class ToyLM(torch.nn.Module):
    """A causal toy LM: logits at position t depend on tokens <= t (embedding + causal mean)."""

    def __init__(self, vocab: int = 50, dim: int = 16, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(vocab, dim, generator=g))
        self.out = torch.nn.Parameter(torch.randn(dim, vocab, generator=g) * 0.5)
        self.calls = 0

    def forward(self, input_ids):
        self.calls += 1
        h = self.emb[input_ids]  # [B, T, D]
        csum = h.cumsum(1) / torch.arange(1, h.shape[1] + 1).view(1, -1, 1)
        logits = torch.tanh(csum) @ self.out

        class Out:
            pass

        o = Out()
        o.logits = logits
        return o


def brute_force(model, ref, ids):
    """Per-position loops in float64."""
    with torch.no_grad():
        lg = model(input_ids=ids).logits.double()
        rl = ref(input_ids=ids).logits.double() if ref is not None else None
    nll = agree = kl = 0.0
    n = 0
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1] - 1):
            lp = torch.log_softmax(lg[b, t], -1)
            nll -= float(lp[ids[b, t + 1]])
            if rl is not None:
                rp = torch.log_softmax(rl[b, t], -1)
                agree += float(lp.argmax() == rp.argmax())
                kl += float((rp.exp() * (rp - lp)).sum())
            n += 1
    return nll / n, agree / n, kl / n, n


def windows(vocab=50, n=5, T=12, seed=1):
    return torch.randint(0, vocab, (n, T), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- token metrics


def test_metrics_match_brute_force_and_chunking_does_not_matter():
    a, b = ToyLM(seed=0), ToyLM(seed=1)
    w = windows()
    nll, agree, kl, n = brute_force(b, a, w)
    for chunk in (1, 2, 8):
        r = evaluate_models({"ref": a, "m": b}, w, "ref", chunk=chunk)
        assert r["m"]["tokens"] == n == 5 * 11 and r["m"]["windows"] == 5
        assert r["m"]["nll"] == pytest.approx(nll, rel=1e-5)
        assert r["m"]["ppl"] == pytest.approx(math.exp(nll), rel=1e-5)
        assert r["m"]["top1_agreement"] == pytest.approx(agree)
        assert r["m"]["kl"] == pytest.approx(kl, rel=1e-4, abs=1e-7)
        # the reference against itself
        assert r["ref"]["top1_agreement"] == 1.0
        assert r["ref"]["kl"] == pytest.approx(0.0, abs=1e-6)
        # per-window NLL averages to the total (equal-length windows)
        assert sum(r["m"]["nll_per_window"]) / 5 == pytest.approx(nll, rel=1e-6)


def test_reference_runs_once_per_chunk_and_without_reference_no_agreement():
    a, b, c = ToyLM(seed=0), ToyLM(seed=1), ToyLM(seed=2)
    w = windows(n=6)
    done = []
    r = evaluate_models({"b": b, "ref": a, "c": c}, w, "ref", chunk=4, progress=done.append)
    assert a.calls == b.calls == c.calls == 2  # two chunks, each model once per chunk
    assert sum(done) == 6 * 3
    assert list(r) == ["b", "ref", "c"]  # caller's order kept
    r2 = evaluate_models({"b": b}, w)
    assert "kl" not in r2["b"] and "top1_agreement" not in r2["b"]
    assert r2["b"]["nll"] == pytest.approx(r["b"]["nll"])
    single = evaluate_model(b, w, reference_model=a)
    assert (
        single["kl"] == pytest.approx(r["b"]["kl"])
        and single["top1_agreement"] == r["b"]["top1_agreement"]
    )


def test_kl_is_direction_unpruned_to_pruned():
    """KL(ref || model) = sum p_ref (log p_ref - log p_model), not the reverse."""
    ids = torch.tensor([[0, 1]])
    ref = torch.tensor([[[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]]])
    mod = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]])
    m = token_metrics(mod, ids, ref)
    p, q = F.softmax(ref[0, 0], -1), F.softmax(mod[0, 0], -1)
    assert float(m["kl"][0]) == pytest.approx(float((p * (p / q).log()).sum()), rel=1e-6)
    assert float(m["kl"][0]) != pytest.approx(float((q * (q / p).log()).sum()), rel=1e-3)
    assert float(m["agree"][0]) == 0.0  # argmax 0 vs 1
    assert float(m["nll"][0]) == pytest.approx(-float(torch.log_softmax(mod[0, 0], -1)[1]))
    with pytest.raises(ValueError):
        token_metrics(mod, torch.tensor([[0, 1, 2]]))


def test_identical_models_agree_fully():
    a = ToyLM(seed=3)
    r = evaluate_models({"x": a, "y": a}, windows(), "x")
    assert r["y"]["top1_agreement"] == 1.0 and r["y"]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert r["x"]["nll"] == r["y"]["nll"]


def test_bad_inputs():
    a = ToyLM()
    with pytest.raises(KeyError):
        evaluate_models({"a": a}, windows(), "nope")
    with pytest.raises(ValueError):
        evaluate_models({"a": a}, torch.zeros(3, 1, dtype=torch.long))


def test_window_metrics_summary_and_paired_difference():
    wm = WindowMetrics()
    wm.add({"nll": torch.tensor([2.0, 4.0]), "n": torch.tensor([2.0, 2.0])})
    s = wm.summary()
    assert s["nll"] == 1.5 and s["tokens"] == 4 and s["nll_per_window"] == [1.0, 2.0]
    d = paired_difference([1.0, 2.0, 3.0], [1.5, 2.5, 3.0])
    assert d["mean"] == pytest.approx(1 / 3) and d["n"] == 3
    assert d["se"] == pytest.approx(math.sqrt(((1 / 6) ** 2 * 2 + (1 / 3) ** 2) / 2 / 3))
    assert math.isnan(paired_difference([1.0], [2.0])["se"])
    with pytest.raises(ValueError):
        paired_difference([1.0], [1.0, 2.0])


# ----------------------------------------------------------------------------- generation


def test_greedy_generate_matches_step_by_step_argmax():
    m = ToyLM(seed=4)
    prompts = windows(n=3, T=5, seed=9)
    got = greedy_generate(m, prompts, 7)
    assert got.shape == (3, 7)
    x = prompts.clone()
    for _ in range(7):
        nxt = m(input_ids=x).logits[:, -1].argmax(-1)
        x = torch.cat([x, nxt[:, None]], 1)
    assert torch.equal(got, x[:, 5:])
    ticks = []
    greedy_generate(m, prompts, 3, progress=ticks.append)
    assert ticks == [1, 1, 1]
    with pytest.raises(ValueError):
        greedy_generate(m, torch.zeros(3, dtype=torch.long), 2)


def test_repeat_run_on_a_model_locked_in_a_loop():
    class Loop(torch.nn.Module):
        """Always predicts token 7: the collapsed-model case."""

        def forward(self, input_ids):
            logits = torch.zeros(*input_ids.shape, 10)
            logits[..., 7] = 1.0
            return logits

    gen = greedy_generate(Loop(), torch.tensor([[1, 2, 3]]), 40)
    assert gen.tolist() == [[7] * 40]
    assert longest_repeat_run(gen[0].tolist()) == (40, [7])


# ----------------------------------------------------------------------------- repeat runs


def brute_repeat_run(seq) -> int:
    n, best = len(seq), (1 if len(seq) else 0)
    for i in range(n):
        for p in range(1, n - i + 1):
            k = 1
            while i + (k + 1) * p <= n and seq[i + k * p : i + (k + 1) * p] == seq[i : i + p]:
                k += 1
            best = max(best, k)
    return best


@pytest.mark.parametrize(
    "seq,count,unit",
    [
        ("", 0, ""),
        ("a", 1, "a"),
        ("abc", 1, "a"),
        ("ab```c", 3, "`"),
        ("abcabcab", 2, "abc"),
        ("xyzxyzxyzxyz", 4, "xyz"),
        ("aaaa", 4, "a"),
        ("abab aaa", 3, "a"),  # 3 x "a" beats 2 x "ab"
        ("的的的的的好", 5, "的"),
    ],
)
def test_longest_repeat_run_examples(seq, count, unit):
    assert longest_repeat_run(seq) == (count, unit)


def test_longest_repeat_run_matches_brute_force_on_random_sequences():
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        n = int(torch.randint(0, 30, (1,), generator=g))
        alphabet = int(torch.randint(1, 4, (1,), generator=g))
        seq = torch.randint(0, alphabet, (n,), generator=g).tolist()
        count, unit = longest_repeat_run(seq)
        assert count == brute_repeat_run(seq), seq
        if n:  # the unit really repeats that often back to back somewhere
            assert any(seq[i : i + count * len(unit)] == unit * count for i in range(n))


def test_repetition_stats_tokens_and_characters():
    s = repetition_stats([5, 6, 5, 6, 5, 6, 9], "no no no no!")
    assert s["repeat_run_tokens"] == 3 and s["repeat_unit_tokens"] == [5, 6]
    assert s["repeat_run_chars"] == 3 and s["repeat_unit_chars"] == "no "  # "no!" is not a 4th copy


# ----------------------------------------------------------------------------- a real MoE


def test_on_a_tiny_random_kimi_k3_with_experts_masked():
    """A Kimi-K3-architecture model against itself with half the experts masked out of routing:
    finite metrics, the masked model disagrees somewhere, and the reference agrees with itself."""
    pytest.importorskip("llmcompressor")
    from tiny_models import build_tiny

    model, info = build_tiny("kimi_k3", seed=0, dtype=torch.float32)
    model.eval()
    masked, _ = build_tiny("kimi_k3", seed=0, dtype=torch.float32)
    masked.eval()
    for prefix in info.moe_blocks:
        gate = masked.get_submodule(prefix).gate
        with torch.no_grad():
            gate.e_score_correction_bias[: info.num_experts // 2] = float("-inf")
    w = torch.randint(3, 100, (3, 10), generator=torch.Generator().manual_seed(2))
    r = evaluate_models({"full": model, "masked": masked}, w, "full", chunk=2)
    for k in ("nll", "kl", "top1_agreement"):
        assert math.isfinite(r["masked"][k])
    assert r["full"]["kl"] == pytest.approx(0.0, abs=1e-6) and r["full"]["top1_agreement"] == 1.0
    assert r["masked"]["kl"] > 1e-6
    nll, agree, kl, _ = brute_force(masked, model, w)
    assert r["masked"]["nll"] == pytest.approx(nll, rel=1e-4)
    assert r["masked"]["kl"] == pytest.approx(kl, rel=1e-3, abs=1e-6)
    assert r["masked"]["top1_agreement"] == pytest.approx(agree)
    gen = greedy_generate(masked, w[:, :4], 5)
    assert gen.shape == (3, 5)


def test_zero_routed_experts_equals_zeroed_down_projections():
    """The hook ablation = the same model with every routed expert's down projection zeroed."""
    pytest.importorskip("llmcompressor")
    from tiny_models import build_tiny

    from reap_modifier.evaluation import zero_routed_experts

    model, info = build_tiny("kimi_k3", seed=0, dtype=torch.float32)
    ref, _ = build_tiny("kimi_k3", seed=0, dtype=torch.float32)
    with torch.no_grad():
        for prefix in info.moe_blocks:
            for e in ref.get_submodule(prefix).experts:
                e.w2.weight.zero_()
    x = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = model(input_ids=x).logits
        handles = zero_routed_experts(model.eval())
        got = model(input_ids=x).logits
        want = ref.eval()(input_ids=x).logits
    assert len(handles) == len(info.moe_blocks) * info.num_experts
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, before)
    for h in handles:
        h.remove()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=x).logits, before)
