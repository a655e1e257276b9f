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
than the pooled one (:func:`reap_modifier.block_selection.select_by_block_error`).
"""

from __future__ import annotations

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
        dataset = loader.dataset
        masks = dataset["attention_mask"] if "attention_mask" in dataset.column_names else None
        self._rows: dict[tuple[int, ...], str] = {}
        self._by_prefix: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        for n, (ids, label) in enumerate(zip(dataset["input_ids"], dataset[column], strict=True)):
            if masks is not None:
                ids = [t for t, m in zip(ids, masks[n], strict=True) if m]
            key = tuple(int(t) for t in ids)
            other = self._rows.setdefault(key, label)
            if other != label:
                raise ValueError(
                    f"selection_groups: rows with the same tokens are in {column} {other!r} "
                    f"and {label!r} (row {n}); a sample's group is told by its tokens, so "
                    "remove the duplicate"
                )
            self._by_prefix.setdefault(key[: self._PREFIX], []).append(key)

    def label(self, ids, mask=None) -> str:
        """The group of one calibrated sample (``ids``, ``mask``: ``[T]`` tensors).

        :raises RuntimeError: no dataset row has (or begins with) those tokens, or rows
            of several groups begin with them
        """
        tokens = ids[mask.bool()] if mask is not None else ids
        key = tuple(tokens.tolist())
        found = self._rows.get(key)
        if found is not None:
            return found
        labels = {
            self._rows[row]
            for row in self._by_prefix.get(key[: self._PREFIX], [])
            if row[: len(key)] == key
        }
        if len(labels) != 1:
            raise RuntimeError(
                f"selection_groups: a calibrated sample of {len(key)} tokens "
                + (
                    "matches no row of the calibration dataset"
                    if not labels
                    else f"begins rows of several {self.column}s ({', '.join(sorted(labels))})"
                )
                + "; calibrate without truncation (max_seq_length at least the longest "
                "row, batch_size 1) or drop the rows that share a beginning"
            )
        return labels.pop()


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
