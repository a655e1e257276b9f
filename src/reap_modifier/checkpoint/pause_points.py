"""Test hook: stop a rewrite at a named point, so the interruption tests can kill it
there deterministically.  A no-op unless ``REAP_TEST_PAUSE_AT`` names the point."""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["POINTS", "pause_point"]

#: ``first-shard``: the first output shard is partly written; ``mid``: half of the
#: shards are written; ``rename``: the output is complete, before the rename;
#: ``swapped``: after the atomic exchange with a previous output, before removing it
POINTS = ("first-shard", "mid", "rename", "swapped")


def pause_point(point: str) -> None:
    """At ``point``, when ``REAP_TEST_PAUSE_AT`` (comma-separated) names it: write
    ``"<pid> <point>"`` to ``$REAP_TEST_PAUSE_FILE`` and wait until a file of that name
    plus ``.go`` exists (at most ``$REAP_TEST_PAUSE_S`` seconds, default 120)."""
    at = os.environ.get("REAP_TEST_PAUSE_AT")
    if not at or point not in at.split(","):
        return
    marker = Path(os.environ["REAP_TEST_PAUSE_FILE"])
    go = marker.with_name(marker.name + ".go")
    marker.write_text(f"{os.getpid()} {point}\n")
    deadline = time.monotonic() + float(os.environ.get("REAP_TEST_PAUSE_S", "120"))
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
