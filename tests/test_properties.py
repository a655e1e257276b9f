"""Property tests (hypothesis, a bounded number of examples, derandomized for CI):

- random plans over tiny checkpoints of four families (random keep counts, random kept
  sets, equal per group for group-limited routers) -> rewrite -> ``reap verify
  --source`` passes and the reloaded model's logits equal the unpruned model's with the
  dropped experts masked out of routing;
- random splits of a calibration set, calibrated part by part and merged with ``reap
  scores merge`` (in any order), equal the scores of the whole set.

``REAP_PROPERTY_EXAMPLES`` raises the number of examples (e.g. for a nightly run).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

# hypothesis keeps caches (example database, constants) under ./.hypothesis: not in the repo
os.environ.setdefault(
    "HYPOTHESIS_STORAGE_DIRECTORY", str(Path(tempfile.gettempdir()) / "reap-modifier-hypothesis")
)

from badinput import cli  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from mxfp4_fixtures import mask_routing, tree_sha256  # noqa: E402

from reap_modifier.checkpoint import rewrite_checkpoint  # noqa: E402
from reap_modifier.scores import ExpertScores  # noqa: E402
from reap_modifier.scores.plan import PruningPlan  # noqa: E402

EXAMPLES = int(os.environ.get("REAP_PROPERTY_EXAMPLES", "0"))


def _settings(n: int):
    return settings(
        max_examples=EXAMPLES or n,
        deadline=None,
        database=None,  # nothing written into the repository
        derandomize=not EXAMPLES,  # CI: the same examples every run
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


# ---------------------------------------------------------------------------
# random plans -> rewrite -> verify + masked-routing oracle

#: family -> (dtype the reloaded model runs in, tolerance on logits)
FAMILIES = {
    "qwen3_moe": ("bfloat16", 0.0),
    "deepseek_v3": ("bfloat16", 0.0),  # n_group=4, topk_group=2: equal count per group
    "kimi_k3": ("bfloat16", 0.0),
    # float32 grouped_mm sums in an order that depends on group offsets: ulp-level
    "gpt_oss": ("float32", 1e-5),
}


@st.composite
def plans(draw, fx):
    """A random valid plan for fixture ``fx``: keep in [top_k, E] (per group for
    group-limited routers, enough groups' worth to reach top_k), random kept sets."""
    E, top_k = fx.num_experts, fx.top_k
    n_group = fx.n_group if fx.n_group and fx.topk_group and fx.topk_group < fx.n_group else None
    kept = {}
    if n_group:
        size = E // n_group
        low = -(-top_k // fx.topk_group)  # topk_group * per_group >= top_k
        per = draw(st.integers(low, size), label="per_group")
        for block in fx.moe_blocks:
            ids = []
            for g in range(n_group):
                ids += [
                    g * size + i
                    for i in draw(st.sets(st.integers(0, size - 1), min_size=per, max_size=per))
                ]
            kept[block] = sorted(ids)
    else:
        keep = draw(st.integers(top_k, E), label="keep")
        for block in fx.moe_blocks:
            kept[block] = sorted(draw(st.sets(st.integers(0, E - 1), min_size=keep, max_size=keep)))
    return PruningPlan(kept=kept, num_experts=E, saliency="random-plan")


def _logits(cls, path, dtype, ids, block_kept=None):
    model = cls.from_pretrained(path, dtype=dtype).eval()
    if block_kept is not None:
        mask_routing(model, block_kept)
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_random_plans_rewrite_verify_and_match_the_oracle(sources, family):
    from tiny_models import reload_class, sample_input_ids

    fx = sources["fx"][family]
    dtype_name, tol = FAMILIES[family]
    dtype = getattr(torch, dtype_name)
    cls = reload_class(family)
    ids = sample_input_ids(vocab=128, batch=2, seq=24, seed=3)

    @_settings(4)
    @given(plan=plans(fx))
    def check(plan):
        with tempfile.TemporaryDirectory() as d:
            dst = rewrite_checkpoint(
                fx.path, plan, Path(d) / "out", progress=False, hash_cache=False
            )
            res = cli("verify", dst, "--source", fx.path, "-q")
            assert res.exit_code == 0, res.output
            manifest = json.loads((dst / "pruning_manifest.json").read_text())
            block_kept = manifest["checkpoint"]["block_kept"]
            assert block_kept == {b: plan.kept[b] for b in fx.moe_blocks}
            ref = _logits(cls, fx.path, dtype, ids, block_kept)
            got = _logits(cls, dst, dtype, ids)
            assert torch.isfinite(got).all()
            diff = float((ref - got).abs().max())
            assert diff <= tol, f"max |logits - masked oracle| = {diff} for {plan.kept}"

    check()
    assert tree_sha256(fx.path) == sources["hashes"][family]


# ---------------------------------------------------------------------------
# random splits of a calibration set: merge(parts) == whole

POOL = 8  # calibration batches in the pool


@pytest.fixture(scope="module", params=["qwen3_moe", "kimi_k3"])
def calib(request):
    from test_saliency_oracle import observe
    from tiny_models import build_tiny

    model, info = build_tiny(request.param, seed=7)
    gen = torch.Generator().manual_seed(11)
    batches = [
        torch.randint(
            3, info.vocab_size, (2, int(torch.randint(4, 13, (1,), generator=gen))), generator=gen
        )
        for _ in range(POOL)
    ]
    return {"model": model, "batches": batches, "observe": observe}


@st.composite
def splits(draw):
    """A calibration set (a non-empty subset of the pool, in random order) split into
    2-4 non-empty parts, and the order the parts are merged in."""
    chosen = draw(st.lists(st.integers(0, POOL - 1), min_size=2, max_size=POOL, unique=True))
    k = draw(st.integers(2, min(4, len(chosen))))
    labels = draw(
        st.lists(st.integers(0, k - 1), min_size=len(chosen), max_size=len(chosen)).filter(
            lambda xs: len(set(xs)) == k
        )
    )
    parts = [[b for b, lab in zip(chosen, labels) if lab == i] for i in range(k)]
    order = draw(st.permutations(range(k)))
    return chosen, [parts[i] for i in order]


def test_merged_splits_equal_the_whole(calib):
    observe, model, batches = calib["observe"], calib["model"], calib["batches"]

    @_settings(10)
    @given(split=splits())
    def check(split):
        chosen, parts = split
        whole = observe(model, [batches[i] for i in chosen], calibrate_all=False)
        with tempfile.TemporaryDirectory() as d:
            files = []
            for j, part in enumerate(parts):
                files.append(
                    observe(model, [batches[i] for i in part], calibrate_all=False).save(
                        Path(d) / f"p{j}.scores"
                    )
                )
            res = cli("scores", "merge", *files, "-o", Path(d) / "merged.scores")
            assert res.exit_code == 0, res.output
            merged = ExpertScores.load(Path(d) / "merged.scores")
        assert merged.source_tokens() == whole.source_tokens()
        assert set(merged.layers) == set(whole.layers)
        for layer, stats in whole.layers.items():
            assert set(merged.layers[layer]) == set(stats)
            for stat, ref in stats.items():
                got = merged.layers[layer][stat]
                if stat in ("count", "max_norm") or stat.startswith("count@"):
                    assert torch.equal(got, ref), (
                        layer,
                        stat,
                    )  # integers / max: exact in any order
                else:  # float64 sums added in another order
                    torch.testing.assert_close(
                        got, ref, rtol=1e-12, atol=0.0, msg=f"{layer}::{stat}"
                    )
        # the decision is the same too
        from reap_modifier.scores.plan import plan_from_scores

        n = merged.num_experts // 2
        assert (
            plan_from_scores(merged, num_experts_to_keep=n).kept
            == plan_from_scores(whole, num_experts_to_keep=n).kept
        )

    check()
