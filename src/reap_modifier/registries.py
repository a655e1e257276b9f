"""Extension points between the core and :mod:`reap_modifier.compat`.

The core registers here what it needs from upstream's machinery (a listener for the
calibration batches, the rule for loading a recipe's model packed, fixups of a saved
model); the patches in ``compat`` find them here. This module imports nothing of ours, so
``compat`` depends on it and, for one patch, on the config reader
:mod:`reap_modifier.models.moe_fields` (itself importing nothing else of ours).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "PackedLoadRule",
    "add_calibration_batch_listener",
    "add_save_fixup",
    "add_traced_subgraphs_listener",
    "add_saved_config_fixup",
    "calibration_batch_listeners",
    "clear_sequential_checkpoint",
    "packed_load_rule",
    "remove_calibration_batch_listener",
    "remove_traced_subgraphs_listener",
    "run_save_fixups",
    "saved_config_fixups",
    "SequentialCheckpoint",
    "sequential_checkpoint",
    "set_packed_load_rule",
    "set_sequential_checkpoint",
    "traced_subgraphs_listeners",
]

# -- the calibration batches the sequential pipeline caches ----------------------------

_BATCH_LISTENERS: list[Callable[[list[dict]], None]] = []


def add_calibration_batch_listener(listener: Callable[[list[dict]], None]) -> None:
    """Call ``listener(batches: list[dict])`` whenever the sequential pipeline caches
    the calibration batches (in the order ``state.current_batch_idx`` indexes: a resumed
    calibration's recorded order, see :class:`SequentialCheckpoint`)."""
    if listener not in _BATCH_LISTENERS:
        _BATCH_LISTENERS.append(listener)


def remove_calibration_batch_listener(listener: Callable[[list[dict]], None]) -> None:
    if listener in _BATCH_LISTENERS:
        _BATCH_LISTENERS.remove(listener)


def calibration_batch_listeners() -> list[Callable[[list[dict]], None]]:
    return list(_BATCH_LISTENERS)


# -- the sequential pipeline's traced subgraphs ------------------------------------------

TraceListener = Callable[[object, "list[set[int]] | None", "Exception | None"], None]
_TRACE_LISTENERS: list[TraceListener] = []


def add_traced_subgraphs_listener(listener: TraceListener) -> None:
    """Call ``listener(model, subgraph_modules, error)`` when the sequential pipeline has
    traced ``model`` (before any calibration batch): one set of module ``id``s per
    subgraph, every module that subgraph runs (at any depth), and ``error`` ``None``;
    or, when tracing raised, ``None`` and the exception (raised again afterwards)."""
    if listener not in _TRACE_LISTENERS:
        _TRACE_LISTENERS.append(listener)


def remove_traced_subgraphs_listener(listener: TraceListener) -> None:
    if listener in _TRACE_LISTENERS:
        _TRACE_LISTENERS.remove(listener)


def traced_subgraphs_listeners() -> list[TraceListener]:
    return list(_TRACE_LISTENERS)


# -- the sequential pipeline, resumable -----------------------------------------------


class SequentialCheckpoint(Protocol):
    """What the sequential pipeline asks of a resumable calibration (one per run).

    Subgraph indices are 0-based, in the pipeline's order; the pipeline calls, in order:
    ``traced`` once, ``restore`` once, then per subgraph ``skips`` and, for a subgraph
    it runs, ``starting`` before its first forward and ``forwarded`` after each.
    """

    def traced(self, count: int) -> None:
        """The pipeline traced ``count`` subgraphs (raise when a resumed run's differ)."""

    def restore(self, cache: object, batches: list[dict]) -> list[dict]:
        """The activations cache is built from ``batches`` (``input_ids`` /
        ``attention_mask`` per batch, in the data loader's order): check the data, and
        when resuming replace the cache's contents with the saved inputs of the first
        subgraph still to run. Returns the batches in the order the cache holds them
        then (the calibration-batch listeners get these)."""

    def skips(self, index: int) -> bool:
        """Whether subgraph ``index`` was completed by an earlier run (it does nothing)."""

    def starting(self, index: int) -> None:
        """Subgraph ``index`` is about to run its first forward; the cache holds its
        inputs (everything the subgraphs from ``index`` on need)."""

    def forwarded(self, index: int, calls: int) -> None:
        """Subgraph ``index`` ran its ``calls``-th forward."""


_SEQUENTIAL_CHECKPOINT: list[tuple[weakref.ref, SequentialCheckpoint]] = []


def set_sequential_checkpoint(model: object, checkpoint: SequentialCheckpoint) -> None:
    """The checkpoint the next sequential calibration of ``model`` reports to."""
    _SEQUENTIAL_CHECKPOINT[:] = [(weakref.ref(model), checkpoint)]


def clear_sequential_checkpoint(checkpoint: SequentialCheckpoint) -> None:
    if _SEQUENTIAL_CHECKPOINT and _SEQUENTIAL_CHECKPOINT[0][1] is checkpoint:
        _SEQUENTIAL_CHECKPOINT.clear()


def sequential_checkpoint(model: object) -> SequentialCheckpoint | None:
    """The checkpoint registered for ``model`` (none for any other model)."""
    if _SEQUENTIAL_CHECKPOINT and _SEQUENTIAL_CHECKPOINT[0][0]() is model:
        return _SEQUENTIAL_CHECKPOINT[0][1]
    return None


# -- ``oneshot(model=<path>)`` loading a REAP-only recipe's model packed ----------------


@dataclass(frozen=True)
class PackedLoadRule:
    """When ``oneshot`` may load a compressed checkpoint with its experts packed.

    :param keeps_packed: ``(recipe) -> bool``: only REAP reads the weights
    :param check_config: ``(config.json dict) -> None``: raises for a format that
        calibration on packed experts cannot compute, before anything is loaded
    """

    keeps_packed: Callable[[object], bool]
    check_config: Callable[[dict], None]


_PACKED_LOAD: list[PackedLoadRule] = []


def set_packed_load_rule(rule: PackedLoadRule) -> None:
    _PACKED_LOAD[:] = [rule]


def packed_load_rule() -> PackedLoadRule | None:
    return _PACKED_LOAD[0] if _PACKED_LOAD else None


# -- fixups of a saved model ------------------------------------------------------------

_SAVE_FIXUPS: list[Callable[[object], object]] = []
_SAVED_CONFIG_FIXUPS: list[Callable[[object, str], None]] = []


def add_save_fixup(fixup: Callable[[object], object]) -> None:
    """``fixup(model)`` runs before the regular (llm-compressor) save of a pruned model."""
    if fixup not in _SAVE_FIXUPS:
        _SAVE_FIXUPS.append(fixup)


def run_save_fixups(model) -> None:
    for fixup in list(_SAVE_FIXUPS):
        fixup(model)


def add_saved_config_fixup(fixup: Callable[[object, str], None]) -> None:
    """``fixup(config, save_dir)`` runs after upstream rewrites a saved ``config.json``."""
    if fixup not in _SAVED_CONFIG_FIXUPS:
        _SAVED_CONFIG_FIXUPS.append(fixup)


def saved_config_fixups() -> list[Callable[[object, str], None]]:
    return list(_SAVED_CONFIG_FIXUPS)
