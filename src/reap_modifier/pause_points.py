"""Test hook: stop a run at a named point, so the interruption tests can signal it there
deterministically.  A no-op unless ``REAP_TEST_PAUSE_AT`` names the point.

``REAP_TEST_PAUSE_AT`` is a comma-separated list of points; a point that takes an index
is named ``point:index`` (``layer-saving:2``).  Points:

- the checkpoint rewriter (:mod:`reap_modifier.checkpoint`): ``first-shard`` (the first
  output shard is partly written), ``mid`` (half of the shards are written), ``rename``
  (the output is complete, before the rename), ``swapped`` (after the atomic exchange
  with a previous output, before removing it);
- resumable calibration (:mod:`reap_modifier.calibration.checkpointing`), with the
  1-based layer (sequential subgraph) index: ``layer-calibrating:k`` (layer ``k`` has
  observed its first calibration batch), ``layer-saving:k`` (layer ``k``'s files are
  written, not yet committed), ``between-layers:k`` (layer ``k`` is committed, layer
  ``k + 1`` has not started).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["LAYER_POINTS", "POINTS", "pause_point"]

#: the rewriter's points
POINTS = ("first-shard", "mid", "rename", "swapped")
#: resumable calibration's points (each takes the layer index)
LAYER_POINTS = ("layer-calibrating", "layer-saving", "between-layers")


def pause_point(point: str, index: int | None = None) -> None:
    """At ``point`` (``point:index`` when ``index`` is given), when ``REAP_TEST_PAUSE_AT``
    names it: write ``"<pid> <point>"`` to ``$REAP_TEST_PAUSE_FILE`` and wait until a
    file of that name plus ``.go`` exists.

    There is no deadline: however loaded the machine, the process stays at the point
    until the test resumes or signals it.  Only when the process that started it is gone
    (the test run died) does it exit, so a paused process is never left behind."""
    at = os.environ.get("REAP_TEST_PAUSE_AT")
    name = point if index is None else f"{point}:{index}"
    if not at or name not in at.split(","):
        return
    marker = Path(os.environ["REAP_TEST_PAUSE_FILE"])
    go = marker.with_name(marker.name + ".go")
    parent = os.getppid()
    tmp = marker.with_name(marker.name + ".tmp")
    tmp.write_text(f"{os.getpid()} {name}\n")
    os.replace(tmp, marker)  # the marker appears whole
    while not go.exists():
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(0.01)
