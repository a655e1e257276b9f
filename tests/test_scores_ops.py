"""Scores file operations: merge exactness, validation errors, saliency names, the
keep-count rule, cutting a scores file into a plan (and how fast)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from scores_synth import LAYERS, accumulate, big_scores, from_saliency, routing

from reap_modifier.scores import (
    SCORES_FORMAT,
    SCORES_VERSION,
    ExpertScores,
    ScoresError,
    saliency_from_stats,
)
from reap_modifier.scores.keep_count import PlanError, compute_keep_count, sparsity_to_keep
from reap_modifier.scores.plan import PruningPlan, plan_from_scores, select_experts

# -- merge ------------------------------------------------------------------------------


def _en_zh():
    en = routing(96, 8, 2, seed=1)
    en2 = routing(64, 8, 2, seed=2)
    zh = routing(80, 8, 2, seed=3, prefer=[5, 6])
    return en, en2, zh


def test_merge_equals_joint_calibration_exactly(tmp_path):
    en, en2, zh = _en_zh()
    joint = accumulate(None, [("en", *en), ("en", *en2), ("zh", *zh)])
    s_en = accumulate(None, [("en", *en), ("en", *en2)])
    s_zh = accumulate(None, [("zh", *zh)])
    merged = s_en.merge(s_zh)
    assert merged.metadata["tokens"] == joint.metadata["tokens"] == {"en": 160, "zh": 80}
    for layer in LAYERS:
        assert set(merged.layers[layer]) == set(joint.layers[layer])
        for stat, t in joint.layers[layer].items():
            assert torch.equal(merged.layers[layer][stat], t), (layer, stat)
    # order does not matter, and save/load keeps every bit
    other = s_zh.merge(s_en)
    for layer in LAYERS:
        for stat, t in merged.layers[layer].items():
            assert torch.equal(other.layers[layer][stat], t)
    merged.save(tmp_path / "m.scores")
    back = ExpertScores.load(tmp_path / "m.scores")
    for layer in LAYERS:
        for stat, t in merged.layers[layer].items():
            assert torch.equal(back.layers[layer][stat], t)
    assert back.metadata["tokens"] == {"en": 160, "zh": 80}
    # three-way: merge(A, en2-part) reproduces a file calibrated on both English parts
    a = accumulate(None, [("en", *en)])
    b_part = accumulate(None, [("en", *en2)])
    for layer in LAYERS:
        for stat, t in s_en.layers[layer].items():
            assert torch.equal(a.merge(b_part).layers[layer][stat], t)
    assert merged.saliency("reap")[LAYERS[0]].shape == (8,)


def test_merge_non_dyadic_is_float_rounding_only():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8, (500, 2), generator=g)
    w = torch.rand(500, 2, generator=g, dtype=torch.float64)
    n = torch.rand(500, 2, generator=g, dtype=torch.float64)
    joint = accumulate(
        None, [("en", ids[:300], w[:300], n[:300]), ("zh", ids[300:], w[300:], n[300:])]
    )
    merged = accumulate(None, [("en", ids[:300], w[:300], n[:300])]).merge(
        accumulate(None, [("zh", ids[300:], w[300:], n[300:])])
    )
    for layer in LAYERS:
        for stat, t in joint.layers[layer].items():
            torch.testing.assert_close(merged.layers[layer][stat], t, rtol=1e-12, atol=0)
        assert torch.equal(merged.layers[layer]["count"], joint.layers[layer]["count"])


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s: s.metadata.update(model_class="Other"), "model_class"),
        (lambda s: s.metadata.update(top_k=4), "top_k"),
        (lambda s: s.metadata.update(model_fingerprint="b" * 64), "fingerprints differ"),
    ],
)
def test_merge_refuses_other_models(change, message):
    a = accumulate(None, [("en", *routing(16, 8, 2, 1))], metadata={"model_fingerprint": "a" * 64})
    b = accumulate(None, [("zh", *routing(16, 8, 2, 2))], metadata={"model_fingerprint": "a" * 64})
    change(b)
    with pytest.raises(ScoresError, match=message):
        a.merge(b)


def test_merge_refuses_other_expert_count_layers_and_baselines():
    a = accumulate(None, [("en", *routing(16, 8, 2, 1))])
    b = accumulate(None, [("en", *routing(16, 16, 2, 1))], num_experts=16)
    with pytest.raises(ScoresError, match="num_experts 8 != 16"):
        a.merge(b)
    c = accumulate(None, [("en", *routing(16, 8, 2, 1))], layers=LAYERS[:2])
    with pytest.raises(ScoresError, match=r"different layers.*model\.layers\.3\.mlp"):
        a.merge(c)
    w = ExpertScores(
        layers={l: {"router_l1": torch.rand(8, dtype=torch.float64)} for l in LAYERS},
        metadata={"kind": "weights", "method": "router_l1", "num_experts": 8},
    ).validate()
    with pytest.raises(ScoresError, match="cannot merge a calibration-free router_l1"):
        a.merge(w)


# -- validation / malformed files ---------------------------------------------------------


def _write_raw(path, tensors, meta):
    save_file(tensors, str(path), metadata={"reap_scores": json.dumps(meta)})


def _raw_meta(**over):
    meta = {
        "format": SCORES_FORMAT,
        "version": SCORES_VERSION,
        "num_experts": 4,
        "layers": ["l.layers.0.mlp"],
        "tokens": {"en": 3},
    }
    meta.update(over)
    return meta


def _raw_tensors(layer="l.layers.0.mlp", n=4, **over):
    t = {
        f"{layer}::{s}": torch.ones(n, dtype=torch.float64)
        for s in ("count", "sum_weight", "sum_norm", "sum_reap", "max_norm")
    }
    t.update(over)
    return t


def test_load_roundtrip_and_good_raw_file(tmp_path):
    _write_raw(tmp_path / "ok.scores", _raw_tensors(), _raw_meta())
    s = ExpertScores.load(tmp_path / "ok.scores")
    assert s.num_experts == 4 and s.kind == "calibration" and s.default_saliency == "reap"


def test_truncated_file(tmp_path):
    s = accumulate(None, [("en", *routing(16, 8, 2, 1))])
    path = s.save(tmp_path / "s.scores")
    data = path.read_bytes()
    (tmp_path / "t.scores").write_bytes(data[: len(data) // 2])
    with pytest.raises(ScoresError, match="cannot read scores file"):
        ExpertScores.load(tmp_path / "t.scores")
    (tmp_path / "junk.scores").write_bytes(b"not a safetensors file at all")
    with pytest.raises(ScoresError, match="cannot read scores file"):
        ExpertScores.load(tmp_path / "junk.scores")
    with pytest.raises(ScoresError, match="does not exist"):
        ExpertScores.load(tmp_path / "missing.scores")


def test_wrong_version_and_format(tmp_path):
    _write_raw(tmp_path / "v.scores", _raw_tensors(), _raw_meta(version=99))
    with pytest.raises(ScoresError, match="scores version 99 is not supported"):
        ExpertScores.load(tmp_path / "v.scores")
    _write_raw(tmp_path / "f.scores", _raw_tensors(), _raw_meta(format="something-else"))
    with pytest.raises(ScoresError, match="is not 'reap-scores'"):
        ExpertScores.load(tmp_path / "f.scores")
    save_file(_raw_tensors(), str(tmp_path / "plain.safetensors"))
    with pytest.raises(ScoresError, match="not a REAP scores file"):
        ExpertScores.load(tmp_path / "plain.safetensors")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values(tmp_path, bad):
    t = torch.ones(4, dtype=torch.float64)
    t[2] = bad
    _write_raw(tmp_path / "n.scores", _raw_tensors(**{"l.layers.0.mlp::sum_reap": t}), _raw_meta())
    with pytest.raises(
        ScoresError, match=r"l\.layers\.0\.mlp::sum_reap holds NaN/inf values \(experts \[2\]\)"
    ):
        ExpertScores.load(tmp_path / "n.scores")


def test_layer_missing(tmp_path):
    # listed in metadata, no tensors
    _write_raw(
        tmp_path / "a.scores",
        _raw_tensors(),
        _raw_meta(layers=["l.layers.0.mlp", "l.layers.1.mlp"]),
    )
    with pytest.raises(
        ScoresError, match=r"layers listed in metadata have no tensors: \['l\.layers\.1\.mlp'\]"
    ):
        ExpertScores.load(tmp_path / "a.scores")
    # the model has more MoE layers than the file holds
    _write_raw(tmp_path / "b.scores", _raw_tensors(), _raw_meta(num_moe_layers=2))
    with pytest.raises(ScoresError, match="declares 2 MoE layers but the file holds 1"):
        ExpertScores.load(tmp_path / "b.scores")
    # a statistic missing from a layer
    t = _raw_tensors()
    del t["l.layers.0.mlp::sum_reap"]
    _write_raw(tmp_path / "c.scores", t, _raw_meta())
    with pytest.raises(ScoresError, match=r"lacks statistics \['sum_reap'\]"):
        ExpertScores.load(tmp_path / "c.scores")
    # a tensor of a layer that is not listed
    t = _raw_tensors()
    t["other.layer::count"] = torch.ones(4, dtype=torch.float64)
    _write_raw(tmp_path / "d.scores", t, _raw_meta())
    with pytest.raises(ScoresError, match="belongs to no listed layer"):
        ExpertScores.load(tmp_path / "d.scores")


def test_different_expert_count_inside_a_file(tmp_path):
    _write_raw(tmp_path / "e.scores", _raw_tensors(n=6), _raw_meta())
    with pytest.raises(ScoresError, match=r"has shape \(6,\), expected \(4,\)"):
        ExpertScores.load(tmp_path / "e.scores")


def test_negative_counts(tmp_path):
    t = _raw_tensors(**{"l.layers.0.mlp::count": -torch.ones(4, dtype=torch.float64)})
    _write_raw(tmp_path / "neg.scores", t, _raw_meta())
    with pytest.raises(ScoresError, match="negative values"):
        ExpertScores.load(tmp_path / "neg.scores")


def test_weights_file_validation():
    ok = {"kind": "weights", "method": "router_l1", "num_experts": 3}
    s = ExpertScores({"a": {"router_l1": torch.tensor([1.0, 3.0, 2.0], dtype=torch.float64)}}, ok)
    assert s.validate().default_saliency == "router_l1"
    assert s.saliency(None)["a"].tolist() == [1.0, 3.0, 2.0]
    with pytest.raises(ScoresError, match="has no 'reap' saliency"):
        s.saliency("reap")
    with pytest.raises(ScoresError, match="expected one of"):
        ExpertScores(
            {"a": {"router_l2": torch.ones(3, dtype=torch.float64)}}, {**ok, "method": "router_l2"}
        ).validate()
    with pytest.raises(ScoresError, match="extra statistics"):
        ExpertScores(
            {
                "a": {
                    "router_l1": torch.ones(3, dtype=torch.float64),
                    "count": torch.ones(3, dtype=torch.float64),
                }
            },
            ok,
        ).validate()
    with pytest.raises(ScoresError, match="negative"):
        ExpertScores({"a": {"router_l1": -torch.ones(3, dtype=torch.float64)}}, ok).validate()
    signed = {**ok, "method": "router_signed_sum"}
    ExpertScores(
        {"a": {"router_signed_sum": -torch.ones(3, dtype=torch.float64)}}, signed
    ).validate()


# -- saliency names ---------------------------------------------------------------------


def test_saliency_from_stats_known_answers():
    st = {
        "count": torch.tensor([4.0, 0.0, 2.0], dtype=torch.float64),
        "sum_weight": torch.tensor([2.0, 0.0, 1.5], dtype=torch.float64),
        "sum_norm": torch.tensor([8.0, 0.0, 3.0], dtype=torch.float64),
        "sum_reap": torch.tensor([3.0, 0.0, 2.5], dtype=torch.float64),
        "max_norm": torch.tensor([2.5, 0.0, 2.0], dtype=torch.float64),
    }
    assert saliency_from_stats(st, "reap").tolist() == [0.75, 0.0, 1.25]
    assert saliency_from_stats(st, "frequency").tolist() == [4.0, 0.0, 2.0]
    assert saliency_from_stats(st, "weighted_frequency").tolist() == [2.0, 0.0, 1.5]
    assert saliency_from_stats(st, "ean").tolist() == [8.0, 0.0, 3.0]
    assert saliency_from_stats(st, "ean_mean").tolist() == [2.0, 0.0, 1.5]
    assert saliency_from_stats(st, "max_norm").tolist() == [2.5, 0.0, 2.0]
    with pytest.raises(ScoresError, match="unknown saliency 'bogus'"):
        saliency_from_stats(st, "bogus")
    with pytest.raises(ScoresError, match="reap scores from-weights"):
        saliency_from_stats(st, "router_l1")


def test_support_and_routing_rate():
    s = from_saliency(
        {"a.layers.0.mlp": [1.0, 2.0, 3.0, 4.0]},
        counts={"en": {"a.layers.0.mlp": [10, 0, 30, 40]}, "zh": {"a.layers.0.mlp": [0, 0, 5, 15]}},
        tokens={"en": 40, "zh": 10},
    )
    sup = s.support()["a.layers.0.mlp"]
    assert sup == {"median": 22.5, "min": 0.0, "max": 55.0, "mean": 25.0, "never_routed": 1}
    assert s.routing_rate("en")["a.layers.0.mlp"].tolist() == [0.25, 0.0, 0.75, 1.0]
    assert s.routing_rate("zh")["a.layers.0.mlp"].tolist() == [0.0, 0.0, 0.5, 1.5]
    assert s.routing_rate()["a.layers.0.mlp"].tolist() == [0.2, 0.0, 0.7, 1.1]
    with pytest.raises(ScoresError, match="no tokens recorded for source 'fr'"):
        s.routing_rate("fr")


# -- keep-count rule --------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, keep",
    [
        (dict(num_experts=896, top_k=16, sparsity=0.5), 448),
        (dict(num_experts=896, top_k=16, sparsity=0.25), 672),
        (dict(num_experts=896, top_k=16, sparsity=0.75), 224),
        (dict(num_experts=10, top_k=2, sparsity=0.25), 8),  # drop int(2.5) = 2, as upstream
        (dict(num_experts=100, top_k=2, sparsity=0.29), 72),  # int(28.999999999999996) = 28
        (dict(num_experts=896, top_k=16, num_experts_to_keep=450, divisible_by=8), 448),
        (dict(num_experts=896, top_k=16, sparsity=0.57, divisible_by=6), 384),
        (dict(num_experts=16, top_k=2, num_experts_to_keep=10, n_group=4, topk_group=2), 8),
        (dict(num_experts=16, top_k=2, num_experts_to_keep=10, n_group=4, topk_group=4), 10),
        (
            dict(
                num_experts=48,
                top_k=2,
                num_experts_to_keep=45,
                divisible_by=5,
                n_group=4,
                topk_group=2,
            ),
            40,
        ),  # 45 -> 44 (groups) -> 40 (lcm(5, 4) = 20)
    ],
)
def test_keep_count_rule(kwargs, keep):
    e, k = kwargs.pop("num_experts"), kwargs.pop("top_k")
    assert compute_keep_count(e, k, **kwargs).keep == keep


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(sparsity=0.5, num_experts_to_keep=4), "exactly one"),
        (dict(sparsity=1.0), r"sparsity must be in \(0, 1\)"),
        (dict(num_experts_to_keep=1), "fewer than top_k=2"),
        (dict(num_experts_to_keep=3, divisible_by=4), "rounds down to 0"),
        (dict(num_experts_to_keep=4, n_group=4, topk_group=1), "only 1 experts are reachable"),
    ],
)
def test_keep_count_rule_refusals(kwargs, message):
    with pytest.raises(PlanError, match=message):
        compute_keep_count(16, 2, **kwargs)


def test_sparsity_to_keep():
    assert sparsity_to_keep(896, 0.375) == 560 and sparsity_to_keep(10, 0.25) == 8


# -- cutting ------------------------------------------------------------------------------


def test_plan_from_scores_known_answer():
    s = from_saliency(
        {
            "m.layers.0.mlp": [0.5, 4.0, 1.0, 3.0, 2.0, 0.0, 6.0, 5.0],
            "m.layers.1.mlp": [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 0.0, 0.0],
        },
        counts={
            "en": {
                "m.layers.0.mlp": [1, 1, 1, 1, 1, 0, 1, 1],
                "m.layers.1.mlp": [1, 1, 1, 1, 1, 1, 1, 0],
            }
        },
    )
    plan = plan_from_scores(s, num_experts_to_keep=4)
    assert plan.kept == {"m.layers.0.mlp": [1, 3, 6, 7], "m.layers.1.mlp": [0, 1, 4, 5]}
    assert plan.retained["m.layers.0.mlp"] == pytest.approx(18 / 21.5)
    assert plan.retained["m.layers.1.mlp"] == pytest.approx(6 / 8)
    assert plan.ties == {"m.layers.1.mlp": 2}  # experts 2 and 3 tie with kept 0, 1
    assert plan.never_routed == {"m.layers.0.mlp": [5], "m.layers.1.mlp": [7]}
    assert plan.saliency == "reap" and plan.num_experts == 8
    # frequency ranks by counts; same rule, same tie-breaking
    plan_f = plan_from_scores(s, sparsity=0.5, saliency="frequency")
    assert plan_f.kept["m.layers.0.mlp"] == [0, 1, 2, 3]
    # plan JSON round trip
    assert PruningPlan.from_dict(json.loads(json.dumps(plan.to_dict()))).kept == plan.kept


def test_plan_from_scores_groups_and_divisible_by():
    sal = [float(x) for x in [9, 8, 1, 2, 7, 6, 5, 4, 0.1, 0.2, 0.3, 0.4, 3, 2.5, 2.2, 2.1]]
    s = from_saliency({"m.layers.0.mlp": sal}, metadata={"n_group": 4, "topk_group": 2})
    plan = plan_from_scores(s, num_experts_to_keep=10)
    # 10 -> 8 (2 per group): the best 2 of every group of 4, even the weak group 2
    assert plan.num_kept == 8
    assert plan.kept["m.layers.0.mlp"] == [0, 1, 4, 5, 10, 11, 12, 13]
    assert any("equal count" in a for a in plan.params["adjustments"])
    s2 = from_saliency({"m.layers.0.mlp": sal})
    plan2 = plan_from_scores(s2, num_experts_to_keep=10, divisible_by=4)
    assert plan2.kept["m.layers.0.mlp"] == [0, 1, 4, 5, 6, 7, 12, 13]
    with pytest.raises(PlanError, match="fewer than top_k=2"):
        plan_from_scores(s2, num_experts_to_keep=1)


def test_select_experts_matches_plan_on_random_scores():
    s = big_scores(4, 64, seed=3)
    plan = plan_from_scores(s, num_experts_to_keep=24)
    for layer, sal in s.saliency("reap").items():
        assert plan.kept[layer] == select_experts(sal, 24)


def test_cut_92x896(tmp_path):
    """A K3-sized scores file: load + cut + save (its speed: ``benchmarks/bench_cut.py``)."""
    path = big_scores().save(tmp_path / "big.scores")
    plan = plan_from_scores(ExpertScores.load(path), num_experts_to_keep=448, divisible_by=8)
    plan.save(tmp_path / "plan.json")
    assert plan.num_kept == 448 and len(plan.kept) == 92
    assert PruningPlan.load(tmp_path / "plan.json").kept == plan.kept
