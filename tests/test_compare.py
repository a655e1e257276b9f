"""Tiers (retained mass, marginal cost, knee) and ranking comparison with known answers."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from scores_synth import accumulate, big_scores, from_saliency, routing

from reap_modifier.analysis.compare import Ranking, compare_rankings, kept_mask
from reap_modifier.analysis.reports import write_compare_report, write_tiers_report
from reap_modifier.analysis.tiers import detect_knee, mass_curve, retained_mass_at, tiers_report
from reap_modifier.scores import ExpertScores, ScoresError
from reap_modifier.scores.plan import plan_from_scores, retained_mass, select_experts


def _t(values):
    return torch.tensor(values, dtype=torch.float64)


# -- tiers ------------------------------------------------------------------------------


def test_mass_curve_and_marginal_cost_known_answers():
    sal = {"a": _t([1.0, 4.0, 2.0, 3.0]), "b": _t([0.0, 0.0, 5.0, 5.0])}
    curve = mass_curve(sal)
    # layer a: shares .4 .3 .2 .1 ; layer b: .5 .5 0 0
    np.testing.assert_allclose(curve.layer_mass[0], [0, 0.4, 0.7, 0.9, 1.0])
    np.testing.assert_allclose(curve.layer_mass[1], [0, 0.5, 1.0, 1.0, 1.0])
    np.testing.assert_allclose(curve.mass, [0, 0.45, 0.85, 0.95, 1.0])
    np.testing.assert_allclose(curve.marginal_cost[1:], [0.45, 0.4, 0.1, 0.05])
    assert math.isnan(curve.marginal_cost[0])
    # agrees with the plan's retained_mass at every keep
    for k in range(1, 5):
        for layer, s in sal.items():
            ids = select_experts(s, k)
            assert retained_mass(s, ids) == pytest.approx(
                curve.layer_mass[list(sal).index(layer), k]
            )
    # all-zero layer: everything retained (the plan's convention)
    z = mass_curve({"z": _t([0, 0, 0])})
    np.testing.assert_allclose(z.layer_mass[0], [0, 1, 1, 1])


def test_grouped_retained_mass():
    sal = {"a": _t([8, 7, 1, 1, 0.5, 0.5, 0.5, 0.5])}  # total 19
    assert retained_mass_at(sal, 4)[0] == pytest.approx(17 / 19)
    assert retained_mass_at(sal, 4, n_group=2)[0] == pytest.approx(16 / 19)  # 8, 7 | 0.5, 0.5


def test_tiers_report_known_answers(tmp_path):
    # 8 experts with shares 8/36 ... 1/36 in every layer
    sal = {f"m.layers.{i}.mlp": _t([1, 2, 3, 4, 5, 6, 7, 8]) for i in range(3)}
    r = tiers_report(sal, [6, 4], sparsities=[0.75], saliency="reap")
    assert [t["keep"] for t in r["tiers"]] == [6, 4, 2]
    masses = [t["retained_mass_mean"] for t in r["tiers"]]
    assert masses == pytest.approx([33 / 36, 26 / 36, 15 / 36])
    b = r["between_tiers"]
    assert [(x["from_keep"], x["to_keep"]) for x in b] == [(8, 6), (6, 4), (4, 2)]
    assert [x["cost_per_expert"] for x in b] == pytest.approx([1.5 / 36, 3.5 / 36, 5.5 / 36])
    assert b[0]["cost_per_expert_vs_uniform"] == pytest.approx(1.5 / 36 * 8)
    assert r["curve"]["marginal_cost"][1:] == pytest.approx(
        [8 / 36, 7 / 36, 6 / 36, 5 / 36, 4 / 36, 3 / 36, 2 / 36, 1 / 36]
    )
    paths = write_tiers_report(r, tmp_path)
    assert paths["png"].stat().st_size > 1000
    data = json.loads(paths["json"].read_text(), parse_constant=lambda c: pytest.fail(c))
    assert data["tiers"][0]["keep"] == 6
    assert "Is there a knee?" in paths["markdown"].read_text()


def test_knee_test_cliff_vs_smooth():
    cliff = {f"l.layers.{i}.m": _t([1.0] * 600 + [10.0] * 296) for i in range(2)}
    r = tiers_report(cliff, [672, 448, 224])
    assert r["knee"]["knee"] and r["knee"]["keep"] == 296
    assert r["knee"]["window"] == 14 and r["knee"]["max_jump"] == pytest.approx(10.0)
    assert r["knee"]["layers_with_knee"] == 2
    assert r["answer"].startswith("Yes: a knee at keep 296")
    # a smooth (linear) curve: J at keep k is (mean of ranks k-13..k) / (mean of k+1..k+14)
    lin = {"l.layers.0.m": _t(list(range(1, 897)))}
    r = tiers_report(lin, [672, 448, 384, 224])
    assert not r["knee"]["knee"] and r["knee"]["keep"] is None
    k = r["knee"]["at_keep"]
    # ranks: rank r has value 897 - r
    after = np.mean([897 - q for q in range(k - 13, k + 1)])
    before = np.mean([897 - q for q in range(k + 1, k + 15)])
    assert r["knee"]["max_jump"] == pytest.approx(after / before)
    assert k == 672  # relative jumps are largest where the pruned values are smallest
    assert r["answer"].startswith("No knee between keep 672 and 224")
    # never-routed cluster: zero cost before, a knee with infinite jump at its edge
    dead = {"l.layers.0.m": _t([0.0] * 100 + [1.0] * 796)}
    r = tiers_report(dead, [896 - 50, 700])
    assert r["knee_whole_curve"]["knee"] and r["knee_whole_curve"]["keep"] == 796
    assert math.isinf(r["knee_whole_curve"]["max_jump"])


def test_knee_seed_like_profile_has_no_knee():
    # the seed's tier masses (83.4, 62.5, 50.4, 37.0 % at 672, 448, 336, 224) come from a
    # gently rising marginal cost; a lognormal saliency reproduces that shape
    g = torch.Generator().manual_seed(0)
    sal = {
        f"l.layers.{i}.m": torch.exp(0.7 * torch.randn(896, generator=g, dtype=torch.float64))
        for i in range(8)
    }
    r = tiers_report(sal, [672, 448, 384, 224])
    assert not r["knee"]["knee"] and r["knee"]["max_jump"] < 1.3
    costs = [b["cost_per_expert"] for b in r["between_tiers"]]
    assert costs == sorted(costs)  # monotone, as the seed says, yet no knee


def test_detect_knee_narrow_range_and_negative_saliency():
    curve = mass_curve({"a": _t([1, 2, 3, 4])})
    out = detect_knee(curve, (3, 3), window=2)
    assert out["knee"] is False and out["max_jump"] is None
    with pytest.raises(ScoresError, match="negative values"):
        mass_curve({"a": _t([1.0, -2.0])})
    with pytest.raises(ScoresError, match="outside"):
        tiers_report({"a": _t([1, 2, 3])}, [5])


# -- compare ------------------------------------------------------------------------------

L0, L1 = "m.layers.0.mlp", "m.layers.1.mlp"


def _three():
    """A, B, C over 2 layers x 8 experts, keep 4, with hand-known flips.

    A: layer0 keeps {0,1,2,3}, layer1 keeps {4,5,6,7}
    B: layer0 swaps 3 -> 4 (1 flip), layer1 unchanged
    C: layer0 keeps {0,1,6,7} vs B (2 flips), layer1 keeps {0,5,6,7} vs B (1 flip)
    """
    en = {L0: [40, 40, 40, 40, 40, 40, 20, 20], L1: [10, 10, 10, 10, 40, 40, 40, 40]}
    zh = {L0: [10, 10, 10, 10, 10, 10, 60, 30], L1: [30, 5, 5, 5, 5, 5, 5, 5]}
    a = from_saliency(
        {L0: [8, 7, 6, 5, 4, 3, 2, 1], L1: [1, 2, 3, 4, 5, 6, 7, 8]},
        counts={"en": en},
        tokens={"en": 100},
    )
    b = from_saliency(
        {L0: [8, 7, 6, 4, 5, 3, 2, 1], L1: [1, 2, 3, 4, 5, 6, 7, 8]},
        counts={"en": {k: [2 * x for x in v] for k, v in en.items()}},
        tokens={"en": 200},
    )
    c = from_saliency(
        {L0: [8, 7, 2, 3, 3.5, 1, 6, 5], L1: [9, 2, 3, 4, 5, 6, 7, 8]},
        counts={"en": {k: [2 * x for x in v] for k, v in en.items()}, "zh": zh},
        tokens={"en": 200, "zh": 50},
    )
    return a, b, c


def test_compare_known_answers(tmp_path):
    a, b, c = _three()
    rankings = [Ranking("A", a), Ranking("B", b), Ranking("C", c)]
    res = compare_rankings(rankings, 4)
    assert res["keep"] == 4 and res["num_layers"] == 2
    assert [r["corpus"] for r in res["rankings"]] == ["en", "en", "en+zh"]
    pairs = {(p["earlier"], p["later"]): p for p in res["pairs"]}
    ab, bc, ac = pairs["A", "B"], pairs["B", "C"], pairs["A", "C"]
    assert ab["flips"] == 1 and list(ab["flips_per_layer"]) == [1, 0]
    assert bc["flips"] == 3 and list(bc["flips_per_layer"]) == [2, 1]
    assert ac["flips"] == 3
    assert ab["pct_of_kept_slots"] == pytest.approx(100 / 8)
    assert bc["pct_of_kept_slots"] == pytest.approx(300 / 8)
    assert bc["changed_status"] == 6 and bc["pct_of_all_slots"] == pytest.approx(600 / 16)
    assert bc["x_first_pair"] == pytest.approx(3.0)
    assert ab["change"] == "more of the same corpus" and bc["change"] == "+zh"
    assert bc["tokens_added"] == {"zh": 50} and ab["tokens_added"] == {"en": 100}
    assert list(bc["promoted"][L0]) == [6, 7] and list(bc["promoted"][L1]) == [0]
    assert list(bc["demoted"][L0]) == [2, 4] and list(bc["demoted"][L1]) == [4]
    # masses: A own layer0 = 26/36, layer1 = 26/36
    assert ab["mass"]["own_earlier"] == pytest.approx(26 / 36)
    # B's saliency under A's plan: layer0 keeps {0,1,2,3} -> 8+7+6+4 = 25 of 36
    assert ab["mass"]["later_saliency_under_earlier_plan"] == pytest.approx((25 / 36 + 26 / 36) / 2)
    # C own: layer0 {0,1,6,7} = 26 of 35.5; layer1 {0,5,6,7} = 30 of 44
    assert bc["mass"]["own_later"] == pytest.approx((26 / 35.5 + 30 / 44) / 2)
    # C's saliency under B's plan: layer0 {0,1,2,4} = 20.5/35.5 ; layer1 {4,5,6,7} = 26/44
    assert bc["mass"]["later_saliency_under_earlier_plan"] == pytest.approx(
        (20.5 / 35.5 + 26 / 44) / 2
    )
    # routing rates from C (the file with most tokens per source): en = 2*en/200, zh = zh/50
    r = bc["routing"][0]
    assert (r["a"], r["b"]) == ("en", "zh")
    # promoted {L0: 6, 7; L1: 0}: zh/en = (1.2/0.2=6, 0.6/0.2=3), (0.6/0.1=6) -> all >= 1.5
    assert r["promoted_frac_more_by_b"] == 1.0 and r["promoted_frac_more_by_a"] == 0.0
    # all 16: ratios layer0 = [.5]*6 + [6, 3]; layer1 = [6, 1, 1, 1, .25 x4]
    assert r["all_frac_more_by_b"] == pytest.approx(3 / 16)
    assert r["all_frac_more_by_a"] == pytest.approx(10 / 16)
    assert r["promoted_median_log2_ratio"] == pytest.approx(math.log2(6))
    # support: B's counts of promoted vs layer median (layer0 median 80 -> 40/80 = .5 twice;
    # layer1 median 50 -> 20/50 = .4)
    sup = bc["support"]["earlier_count"]["promoted"]
    assert sup["n"] == 3 and sup["median_ratio_to_layer_median"] == pytest.approx(0.5)
    assert sup["frac_below_layer_median"] == 1.0 and sup[
        "frac_below_half_layer_median"
    ] == pytest.approx(1 / 3)
    assert bc["support"]["rate@en"]["promoted"]["median_ratio_to_layer_median"] == pytest.approx(
        0.5
    )
    # report files: every number in strict JSON, both plots
    paths = write_compare_report(res, tmp_path, rankings)
    data = json.loads(paths["json"].read_text(), parse_constant=lambda c: pytest.fail(c))
    assert data["pairs"][2]["flips"] == 3 and data["pairs"][2]["promoted"][L0] == [6, 7]
    assert paths["flips_png"].exists() and paths["routing_png"].exists()
    md = paths["markdown"].read_text()
    assert "| B -> C: +zh | +50 zh | 3 | 37.50% | 37.50% | 3.00x |" in md


def test_compare_per_source_files_and_corpus_labels():
    a, b, c = _three()
    en_only = from_saliency(
        {L0: [1] * 8, L1: [1] * 8},
        counts={"en": {L0: [4, 4, 4, 4, 4, 4, 2, 2], L1: [1, 1, 1, 1, 4, 4, 4, 4]}},
        tokens={"en": 10},
    )
    zh_only = from_saliency(
        {L0: [1] * 8, L1: [1] * 8},
        counts={"zh": {L0: [1, 1, 1, 1, 1, 1, 6, 3], L1: [3, 1, 1, 1, 1, 1, 1, 1]}},
        tokens={"zh": 5},
    )
    res = compare_rankings(
        [Ranking("A", a), Ranking("B", b, corpus="en-1"), Ranking("C", c, corpus="en-1+zh")],
        4,
        per_source={"en": en_only, "zh": zh_only},
    )
    bc = res["pairs"][2]
    assert bc["change"] == "+zh"
    assert res["routing_sources"]["en"].startswith("per-source file")
    r = bc["routing"][0]
    # promoted: L0 6 -> (6/5)/(2/10) = 6, L0 7 -> (3/5)/(2/10) = 3, L1 0 -> (3/5)/(1/10) = 6
    assert r["promoted_frac_more_by_b"] == 1.0


def test_kept_mask_matches_select_experts():
    s = big_scores(5, 48, seed=1)
    sal = np.stack([v.numpy() for v in s.saliency("reap").values()])
    sal[0, :6] = sal[0, 0]  # ties
    mask = kept_mask(sal, 20)
    for i in range(5):
        assert np.nonzero(mask[i])[0].tolist() == select_experts(torch.from_numpy(sal[i]), 20)
    gmask = kept_mask(sal, 20, n_group=4)
    for i in range(5):
        assert np.nonzero(gmask[i])[0].tolist() == select_experts(torch.from_numpy(sal[i]), 20, 4)


def test_compare_mismatched_files():
    a, b, _ = _three()
    other = from_saliency({L0: [1.0] * 6, L1: [1.0] * 6})
    with pytest.raises(ScoresError, match="cannot compare A and B: different expert counts"):
        compare_rankings([Ranking("A", a), Ranking("B", other)], 4)
    missing = from_saliency({L0: [1.0] * 8})
    with pytest.raises(ScoresError, match=r"missing from B: \['m\.layers\.1\.mlp'\]"):
        compare_rankings([Ranking("A", a), Ranking("B", missing)], 4)
    with pytest.raises(ScoresError, match="at least two"):
        compare_rankings([Ranking("A", a)], 4)
    cls = from_saliency({L0: [1.0] * 8, L1: [1.0] * 8}, metadata={"model_class": "Other"})
    with pytest.raises(ScoresError, match="model_class"):
        compare_rankings([Ranking("A", a), Ranking("B", cls)], 4)
    fa = from_saliency({L0: [1.0] * 8, L1: [1.0] * 8}, metadata={"model_fingerprint": "a" * 64})
    fb = from_saliency({L0: [1.0] * 8, L1: [1.0] * 8}, metadata={"model_fingerprint": "b" * 64})
    with pytest.raises(ScoresError, match="router weight fingerprints differ"):
        compare_rankings([Ranking("A", fa), Ranking("B", fb)], 4)


def test_compare_with_baseline_and_signed_sum():
    a, _, _ = _three()
    signed = ExpertScores(
        layers={
            L0: {"router_signed_sum": _t([-1, 2, -3, 4, 5, -6, 7, 8])},
            L1: {"router_signed_sum": _t([1, 2, 3, 4, 5, 6, 7, 8])},
        },
        metadata={
            "kind": "weights",
            "method": "router_signed_sum",
            "num_experts": 8,
            "top_k": 2,
            "model_class": "SynthMoeForCausalLM",
        },
    ).validate()
    res = compare_rankings([Ranking("A", a), Ranking("S", signed)], 4)
    p = res["pairs"][0]
    assert res["rankings"][1]["saliency"] == "router_signed_sum"
    assert res["pairs"][0]["change"] == "reap (en) vs router_signed_sum (none (weights))"
    assert list(p["promoted"][L0]) == [4, 6, 7] and p["flips"] == 3
    assert p["mass"]["own_later"] is None  # no mass fraction for a signed criterion
    assert p["mass"]["earlier_saliency_under_later_plan"] == pytest.approx(
        ((5 + 4 + 2 + 1) / 36 + 26 / 36) / 2
    )  # S keeps {3, 4, 6, 7} in layer 0


def test_seed_shape_noise_floor_vs_new_language():
    """Simulated routing (the seed's experiment in miniature): adding more English barely
    moves the ranking (the noise floor); adding Chinese, which prefers experts English
    under-uses, moves it several times more, and the promoted experts are zh-heavy with
    English support below the layer median."""
    E = 32
    layers = [f"m.layers.{i}.mlp" for i in range(4)]
    bias = torch.linspace(0.1, 0, E)
    zh_bias = bias.clone()
    zh_bias[20:28] += 0.5
    en1 = routing(4000, E, 4, seed=11, bias=bias)
    en2 = routing(4000, E, 4, seed=12, bias=bias)
    zh = routing(3000, E, 4, seed=13, bias=zh_bias)
    a = accumulate(None, [("en", *en1)], layers=layers, num_experts=E)
    b = a.merge(accumulate(None, [("en", *en2)], layers=layers, num_experts=E))
    c = b.merge(accumulate(None, [("zh", *zh)], layers=layers, num_experts=E))
    res = compare_rankings(
        [Ranking("A", a), Ranking("B", b), Ranking("C", c)], 16, saliency="frequency"
    )
    ab, bc = res["pairs"][0], res["pairs"][2]
    assert 0 < ab["flips"] and bc["flips"] > 3 * ab["flips"]
    assert bc["x_first_pair"] == pytest.approx(bc["flips"] / ab["flips"])
    r = bc["routing"][0]
    assert (r["a"], r["b"]) == ("en", "zh")
    assert r["promoted_frac_more_by_b"] >= 0.7 > r["all_frac_more_by_b"]
    assert bc["support"]["rate@en"]["promoted"]["median_ratio_to_layer_median"] < 1.0
    # the comparison's selection is the plan reap cut writes
    plan = plan_from_scores(c, num_experts_to_keep=16, saliency="frequency")
    mask = kept_mask(np.stack([v.numpy() for v in c.saliency("frequency").values()]), 16)
    for i, layer in enumerate(layers):
        assert np.nonzero(mask[i])[0].tolist() == plan.kept[layer]
