"""``selection_groups``: each calibration sample's group (a string column of the dataset)
reaches the block-error selection in the order oneshot calibrates, shuffled or not.

Oracles: the rows a DataLoader pass drew are read back from the batches' contents (each
row's first token is its index); each layer's per-group error the record reports is
recomputed from the unpruned model's blocks on each group's samples alone, routed without
the dropped experts by the masked-routing oracle (:mod:`generic_oracle`, which never
imports the product).
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tokenizer, save_and_reload
from family_routing import moe_blocks
from generic_oracle import masked_block_errors
from pydantic import ValidationError
from tiny_models import build_tiny, reload_class

from reap_modifier import REAPPruningModifier
from reap_modifier.calibration.sample_groups import SampleGroups, group_names
from reap_modifier.checkpoint.verify_manifest import post_cut_lines

SEQ = 24
#: dataset order of the groups (interleaved, so a shuffled draw mixes them)
LABELS = ["en", "zh", "en", "en", "zh", "zh", "en", "zh", "zh", "en", "en", "zh"]


def _samples(vocab: int) -> list[torch.Tensor]:
    """English draws ids from the low third of the vocabulary, Chinese from the top
    third: the groups' block inputs differ, so do their errors."""
    gen = torch.Generator().manual_seed(7)
    low, high = (3, vocab // 3), (2 * vocab // 3, vocab)
    return [torch.randint(*(low if g == "en" else high), (SEQ,), generator=gen) for g in LABELS]


def _dataset(samples, labels, column="language"):
    from datasets import Dataset

    ids = [s.tolist() for s in samples]
    return Dataset.from_dict(
        {"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids], column: labels}
    )


class _Loader:
    """What :class:`SampleGroups` reads of a DataLoader: its dataset."""

    def __init__(self, dataset):
        self.dataset = dataset


def test_a_sample_is_told_by_its_tokens_padded_or_truncated():
    from datasets import Dataset

    rows = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [5, 6, 7, 8, 9, 10, 11, 12, 99], [40, 41]]
    labels = ["en", "zh", "code"]
    ds = Dataset.from_dict({"input_ids": rows, "language": labels})
    groups = SampleGroups(_Loader(ds), "language")
    for row, label in zip(rows, labels, strict=True):
        assert groups.label(torch.tensor(row)) == label
    # left padding, removed by the mask
    padded, mask = torch.tensor([0, 0, 40, 41]), torch.tensor([0, 0, 1, 1])
    assert groups.label(padded, mask) == "code"
    # truncated: the row the tokens begin
    assert groups.label(torch.tensor(rows[0][:9])) == "en"
    with pytest.raises(RuntimeError, match="begins rows of several languages .*en, zh"):
        groups.label(torch.tensor(rows[0][:8]))
    with pytest.raises(RuntimeError, match="matches no row"):
        groups.label(torch.tensor([41, 40]))


def test_the_same_tokens_in_two_groups_are_refused():
    from datasets import Dataset

    ds = Dataset.from_dict({"input_ids": [[5, 6], [7], [5, 6]], "language": ["en", "en", "zh"]})
    with pytest.raises(ValueError, match="same tokens are in language 'en' and 'zh' \\(row 2\\)"):
        SampleGroups(_Loader(ds), "language")


def test_worst_group_selection_sees_each_sample_in_its_group(tmp_path):
    """Shuffled calibration with a ``language`` column: the record's per-group error of
    every layer's kept set equals the oracle's on each group's samples."""
    from llmcompressor import oneshot

    model, info = build_tiny("kimi_k3", seed=5)
    model = save_and_reload(model, "kimi_k3", tmp_path / "src")
    samples = _samples(info.vocab_size)
    modifier = REAPPruningModifier(
        sparsity=0.5,
        selection="block_error",
        selection_groups="language",
        selection_candidates=None,
        validate_fit=False,
        router_fit_tokens=10**6,
    )
    torch.manual_seed(0)
    oneshot(
        model=model,
        recipe=[modifier],
        processor=make_tokenizer(info.vocab_size),
        dataset=_dataset(samples, LABELS),
        num_calibration_samples=len(samples),
        shuffle_calibration_samples=True,
    )
    record = modifier.router_fit["selection"]
    assert record["objective"] == "worst_group"
    assert record["groups"] == {
        "column": "language",
        "names": ["en", "zh"],
        "tokens": {"en": SEQ * LABELS.count("en"), "zh": SEQ * LABELS.count("zh")},
    }

    (line,) = post_cut_lines({"router_fit": modifier.router_fit})
    assert line.startswith("selection: block_error (worst language of en, zh error); ")
    assert f"; {record['differs_from_ranking']} kept experts differ from reap's cut" in line

    unpruned = reload_class("kimi_k3").from_pretrained(tmp_path / "src").eval()
    blocks = moe_blocks(unpruned, "kimi_k3")
    assert sorted(blocks) == sorted(modifier.plan.kept)
    io: dict[str, list] = {n: [] for n in blocks}
    hooks = [
        b.register_forward_hook(
            lambda m, a, o, n=n: io[n].append(
                (
                    a[0].reshape(-1, a[0].shape[-1]),
                    (o[0] if isinstance(o, tuple) else o).reshape(-1, a[0].shape[-1]),
                )
            )
        )
        for n, b in blocks.items()
    ]
    with torch.no_grad():
        for g in ("en", "zh"):
            ids = torch.stack([s for s, lab in zip(samples, LABELS, strict=True) if lab == g])
            unpruned(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    for name, block in blocks.items():
        (x_en, y_en), (x_zh, y_zh) = io[name]
        groups = torch.tensor([0] * x_en.shape[0] + [1] * x_zh.shape[0])
        want = masked_block_errors(
            block,
            "kimi_k3",
            torch.cat([x_en, x_zh]),
            torch.cat([y_en, y_zh]),
            modifier.plan.kept[name],
            groups,
        )
        got = record["layers"][name]["group_errors"]
        assert [got["en"], got["zh"]] == pytest.approx(want, rel=1e-4), name
        assert record["layers"][name]["objective"] == pytest.approx(max(want), rel=1e-4)
        assert abs(want[0] - want[1]) > 0.05 * max(want)  # a mislabelled row would show


@pytest.mark.parametrize(
    "column, labels, message",
    [
        ("lang", LABELS, "has no column 'lang'.*input_ids, attention_mask, language"),
        ("language", [i % 2 for i in range(len(LABELS))], "must hold strings .*int"),
    ],
)
def test_a_column_that_cannot_label_is_refused_before_calibration(
    tmp_path, column, labels, message
):
    from llmcompressor import oneshot

    model, info = build_tiny("kimi_k3", seed=5)
    model = save_and_reload(model, "kimi_k3", tmp_path / "src")
    modifier = REAPPruningModifier(sparsity=0.5, selection="block_error", selection_groups=column)
    with pytest.raises(ValueError, match=message):
        oneshot(
            model=model,
            recipe=[modifier],
            processor=make_tokenizer(info.vocab_size),
            dataset=_dataset(_samples(info.vocab_size), labels),
            num_calibration_samples=len(LABELS),
        )
    assert modifier.plan is None  # nothing was calibrated or cut


def test_groups_need_block_error():
    with pytest.raises(ValidationError, match="selection_groups only apply with"):
        REAPPruningModifier(sparsity=0.5, selection_groups="language")


def test_one_group_or_a_missing_group_is_warned():
    from loguru import logger

    lines: list[str] = []
    sink = logger.add(lines.append, level="WARNING")
    try:
        assert group_names(["en", "en"], {"en", "zh"}, "language") == ["en"]
    finally:
        logger.remove(sink)
    assert len(lines) == 2
    assert "no captured rows of language zh" in lines[0]
    assert "cover one language (en)" in lines[1]
