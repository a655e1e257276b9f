"""Each calibration sample's group (e.g. its language), read from a string column of the
calibration dataset.

oneshot's batches carry no label, and the order it calibrates in is not the dataset's
(longest first, or a random draw; the modifier only sees a deep copy of the DataLoader,
so it cannot record the real one's draws). :class:`SampleGroups` therefore tells a sample
by its tokens: the block capture (:mod:`reap_modifier.calibration.block_io`) hands it every
calibrated sample's ``input_ids`` (padding removed by the attention mask) and it returns
the label of the dataset row with those tokens, or whose tokens they begin (a collator or
``max_seq_length`` truncates). Rows with the same tokens in two groups are refused before
calibration. The column must hold strings: llm-compressor's collators drop string fields
from the batch, so the model never sees them.

With the labels, ``selection: block_error`` minimises the worst group's error rather
than the pooled one (:func:`reap_modifier.post_cut.block_selection.select_by_block_error`).
"""

from __future__ import annotations

import hashlib
from array import array

from loguru import logger

__all__ = ["SampleGroups", "group_names", "groups_column_problem"]


def groups_column_problem(loader, column: str) -> str | None:
    """Why ``column`` cannot label the samples of ``loader`` (``None``: it can)."""
    dataset = getattr(loader, "dataset", None)
    names = getattr(dataset, "column_names", None)
    if names is None:
        return (
            f"selection_groups: {column!r} names a column of the calibration dataset, but "
            f"oneshot's calibration data is not a datasets.Dataset ({type(dataset).__name__}); "
            "pass the dataset itself, with that column"
        )
    if column not in names:
        return (
            f"selection_groups: the calibration dataset has no column {column!r} (it has "
            f"{', '.join(names)}); a raw-text dataset loses its other columns when "
            "llm-compressor tokenizes it, so pass a tokenized dataset (input_ids) that keeps "
            "the label column"
        )
    bad = next((v for v in dataset[column] if not isinstance(v, str)), None)
    if bad is not None:
        return (
            f"selection_groups: column {column!r} must hold strings (it holds "
            f"{type(bad).__name__}, which the collator would pass to the model's forward); "
            "cast it, e.g. dataset.cast_column(column, Value('string'))"
        )
    return None


class SampleGroups:
    """The group label of a calibration sample, told by its tokens.

    :param loader: oneshot's calibration DataLoader (over a ``datasets.Dataset``)
    :param column: the dataset's string column holding each row's group
    :raises ValueError: the column cannot label the samples (:func:`groups_column_problem`),
        or two rows with the same tokens are in different groups
    """

    #: rows are indexed by their first tokens, to find a truncated sample's row
    _PREFIX = 8

    def __init__(self, loader, column: str):
        problem = groups_column_problem(loader, column)
        if problem is not None:
            raise ValueError(problem)
        self.column = column
        self._dataset = loader.dataset
        self._masked = "attention_mask" in self._dataset.column_names
        # a row by the digest of its tokens (a few dozen bytes a row, whatever its length)
        self._rows: dict[bytes, str] = {}
        self._by_prefix: dict[tuple[int, ...], list[int]] = {}
        n = 0
        for batch in self._dataset.iter(batch_size=1024):
            masks = batch["attention_mask"] if self._masked else [None] * len(batch[column])
            for ids, mask, label in zip(batch["input_ids"], masks, batch[column], strict=True):
                tokens = _unpadded(ids, mask)
                other = self._rows.setdefault(_digest(tokens), label)
                if other != label:
                    raise ValueError(
                        f"selection_groups: rows with the same tokens are in {column} "
                        f"{other!r} and {label!r} (row {n}); a sample's group is told by its "
                        "tokens, so remove the duplicate"
                    )
                self._by_prefix.setdefault(tuple(tokens[: self._PREFIX]), []).append(n)
                n += 1

    def label(self, ids, mask=None) -> str:
        """The group of one calibrated sample (``ids``, ``mask``: ``[T]`` tensors).

        :raises RuntimeError: no dataset row has (or begins with) those tokens, or rows
            of several groups begin with them
        """
        tokens = (ids[mask.bool()] if mask is not None else ids).tolist()
        found = self._rows.get(_digest(tokens))
        if found is not None:
            return found
        labels = set()
        for n in self._by_prefix.get(tuple(tokens[: self._PREFIX]), []):
            row = self._dataset[n]
            full = _unpadded(row["input_ids"], row["attention_mask"] if self._masked else None)
            if full[: len(tokens)] == tokens:
                labels.add(row[self.column])
        if len(labels) != 1:
            raise RuntimeError(
                f"selection_groups: a calibrated sample of {len(tokens)} tokens "
                + (
                    "matches no row of the calibration dataset"
                    if not labels
                    else f"begins rows of several {self.column}s ({', '.join(sorted(labels))})"
                )
                + "; calibrate without truncation (max_seq_length at least the longest "
                "row, batch_size 1) or drop the rows that share a beginning"
            )
        return labels.pop()


def _unpadded(ids, mask) -> list[int]:
    if mask is None:
        return [int(t) for t in ids]
    return [int(t) for t, m in zip(ids, mask, strict=True) if m]


def _digest(tokens: list[int]) -> bytes:
    return hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16).digest()


def group_names(rows: list[str], labelled: set[str], column: str) -> list[str]:
    """The groups of the captured ``rows`` (one label per row), sorted. Warns when a group
    of the calibration (``labelled``) has no row (its samples fell past
    ``router_fit_tokens``) and when the rows hold one group only."""
    names = sorted(set(rows))
    missing = sorted(set(labelled) - set(names))
    if missing:
        logger.warning(
            f"REAP block-error selection: no captured rows of {column} {', '.join(missing)} "
            f"(the first router_fit_tokens rows hold {', '.join(names)}): raise "
            "router_fit_tokens so that every group is represented"
        )
    if len(names) == 1:
        logger.warning(
            f"REAP block-error selection: the calibration rows cover one {column} "
            f"({names[0]}): the worst-group objective is the pooled one, and the cut follows "
            "that group alone"
        )
    return names
