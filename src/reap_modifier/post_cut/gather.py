"""Stage 1 of the post-cut step: what each rank works on, gathered once calibration ends.

Each MoE layer's captured rows (every rank's, in the order one process records them) go to
the rank that owns the layer (:func:`~.ranks.owner`), one layer at a time, into a
:class:`~.rows.RowStore`; the held-out samples are shared, sample ``j`` owned by rank
``j mod W``. With ``selection_groups``, every group of the calibration gets a held-out
sample (its last calibrated one, moved out of the fitting rows when the every-k-th-batch
rule gave it none), and the owned layers' rows get their group ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from loguru import logger

from ..calibration.block_io import BlockIOCapture, join_chunks
from ..calibration.sample_groups import group_names
from ..models import MoEArchitecture
from . import ranks
from .rows import RowStore
from .settings import PostCutSettings

__all__ = ["Gathered", "gather"]


@dataclass
class Gathered:
    """What one rank works on."""

    rows: RowStore
    #: every held-out sample, in one process's order: ``(position, inputs, group or None)``
    held: list[tuple]
    #: the indices into :attr:`held` this rank owns
    mine: list[int]
    #: with groups: their names and each owned layer's row group ids
    groups: tuple[list[str], dict[str, torch.Tensor]] | None = None
    #: with groups: the column, the names and the captured tokens per group
    group_record: dict | None = None


def gather(
    capture: BlockIOCapture,
    arch: MoEArchitecture,
    settings: PostCutSettings,
    group,
    labelled: bool,
) -> Gathered:
    """Stop ``capture`` and hand each rank its layers' rows and its held-out samples (see
    the module docstring); ``labelled``: the capture knows each sample's group.

    :raises RuntimeError: a layer captured fewer than 2 rows (on every rank)
    """
    capture.detach()
    labels = None
    if labelled:
        labels = dict(ranks.gathered(list(capture.labels.items()), group))
        _cover_groups(capture, labels, settings, group)
    sizes = {n: ranks.gathered(capture.chunk_rows(n), group) for n in arch.layer_names}
    empty = [n for n, c in sizes.items() if sum(r for _, r in c) < 2]
    if empty:
        raise RuntimeError(
            f"the post-cut fit captured no calibration tokens for {empty[0]}: no "
            "calibration data reached the MoE layers (num_calibration_samples > 0)"
        )
    rows, me = RowStore(settings.spill_dir), ranks.rank(group)
    for i, n in enumerate(arch.layer_names):
        chunks = ranks.gathered_to(capture.chunks(n), ranks.owner(i, group), group)
        if chunks is not None:
            rows.put(n, *join_chunks(chunks, settings.tokens))
        del chunks
    held = sorted(ranks.gathered(capture.validation_samples(), group), key=lambda h: h[0])
    out = Gathered(
        rows,
        [(p, x, labels[p] if labels is not None else None) for p, x in held],
        [j for j in range(len(held)) if ranks.owner(j, group) == me],
    )
    if labels is not None:
        owned = [n for i, n in enumerate(arch.layer_names) if ranks.owner(i, group) == me]
        out.groups, out.group_record = _label_rows(labels, sizes, owned, arch, settings)
    return out


def _label_rows(labels, sizes, owned, arch, settings):
    """The group names (of the first layer's captured rows; warns when a group of the
    calibration has none, or there is one), each owned layer's row group ids, and the
    record's column, names and captured tokens per group."""

    def positions(chunks) -> torch.Tensor:
        chunks = sorted(chunks)
        pos = torch.tensor([p for p, _ in chunks], dtype=torch.long)
        counts = torch.tensor([r for _, r in chunks], dtype=torch.long)
        return torch.repeat_interleave(pos, counts)[: settings.tokens]

    first = positions(sizes[arch.layer_names[0]]).tolist()
    column = settings.selection_groups
    names = group_names([labels[p] for p in first], set(labels.values()), column)
    index = {name: i for i, name in enumerate(names)}
    ids = {n: torch.tensor([index[labels[p]] for p in positions(sizes[n]).tolist()]) for n in owned}
    counts = torch.tensor([index[labels[p]] for p in first]).bincount(minlength=len(names))
    record = {
        "column": column,
        "names": names,
        "tokens": dict(zip(names, counts.tolist(), strict=True)),
    }
    return (names, ids), record


def _cover_groups(capture: BlockIOCapture, labels: dict[int, str], settings, group) -> None:
    """Hold out, in every group with no held-out sample, its last calibrated sample (the
    same choice on every rank; each rank moves the samples it calibrated)."""
    if not settings.holdout_every:
        return
    held = {p for p, _ in ranks.gathered(capture.validation_samples(), group)}
    covered = {labels[p] for p in held if p in labels}
    extra = {
        max(p for p, g in labels.items() if g == name) for name in set(labels.values()) - covered
    }
    if extra:
        logger.info(
            f"REAP post-cut step: held out {len(extra)} more sample(s) so that every "
            f"{settings.selection_groups} has one ("
            + ", ".join(sorted(labels[p] for p in extra))
            + ")"
        )
        capture.hold_out(extra)
