"""One "do these scores belong to this model" check and one "exactly one of keep /
sparsity" check, with one exception type and one wording for every caller."""

from __future__ import annotations

import pytest
from scores_synth import from_saliency

from reap_modifier.scores.belongs import ModelFacts, ScoresMismatchError, check_scores_belong
from reap_modifier.scores.keep_count import PlanError, check_keep_spec
from reap_modifier.scores.plan import cut_scores

A, B = "model.layers.1.mlp", "model.layers.2.mlp"


def _scores(layers=(A, B), metadata=None):
    return from_saliency(
        {layer: [8, 7, 6, 5, 4, 3, 2, 1] for layer in layers},
        metadata={"model_fingerprint": "f" * 64, **(metadata or {})},
    )


def _facts(**kw):
    return ModelFacts(**{"num_experts": 8, "layers": (A, B), "top_k": 2, **kw})


@pytest.mark.parametrize(
    "scores, facts, message",
    [
        (_scores(), _facts(num_experts=16), "S holds 8 experts per layer, the model has 16"),
        (
            _scores(layers=(A,)),
            _facts(),
            f"S does not cover the model's MoE layers (missing e.g. ['{B}'])",
        ),
        (_scores(layers=(A, B, "x")), _facts(), "S: layer 'x' is not a MoE layer of the model"),
        (_scores(), _facts(top_k=4), "S states top_k=2, the model has top_k=4"),
        (
            _scores(),
            _facts(fingerprint=lambda: "0" * 64),
            "S was computed on a model with different router weights (model_fingerprint mismatch)",
        ),
    ],
)
def test_scores_of_another_model_are_refused(scores, facts, message):
    with pytest.raises(ScoresMismatchError) as exc:
        check_scores_belong(scores, facts, "S")
    assert str(exc.value) == f"{message}; the scores were made for another model"


def test_partial_scores_pass_when_not_all_layers_are_required():
    check_scores_belong(_scores(layers=(A,)), _facts(cover_all=False), "S")
    check_scores_belong(_scores(), _facts(fingerprint=lambda: "f" * 64), "S")


def test_the_model_is_authoritative_for_top_k():
    # the scores state no top-k: the model's 5 refuses keeping 4
    scores = _scores(metadata={"top_k": None})
    with pytest.raises(PlanError, match="fewer than top_k=5"):
        cut_scores(scores, _facts(top_k=5), keep=4)
    assert cut_scores(scores, _facts(), keep=4).kept == {A: [0, 1, 2, 3], B: [0, 1, 2, 3]}


@pytest.mark.parametrize(
    "keep, sparsity, given", [(4, 0.5, "both were given"), (None, None, "neither was given")]
)
def test_exactly_one_of_keep_or_sparsity(keep, sparsity, given):
    with pytest.raises(PlanError) as exc:
        check_keep_spec(keep, sparsity, "--keep N", "--sparsity S")
    assert str(exc.value) == f"give exactly one of --keep N or --sparsity S ({given})"
    check_keep_spec(keep or 4, None)
    check_keep_spec(None, sparsity or 0.5)
