"""Test hook: stop a rewrite at a named point, so the interruption tests can signal it
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
    plus ``.go`` exists.

    There is no deadline: however loaded the machine, the process stays at the point
    until the test resumes or signals it.  Only when the process that started it is gone
    (the test run died) does it exit, so a paused process is never left behind."""
    at = os.environ.get("REAP_TEST_PAUSE_AT")
    if not at or point not in at.split(","):
        return
    marker = Path(os.environ["REAP_TEST_PAUSE_FILE"])
    go = marker.with_name(marker.name + ".go")
    parent = os.getppid()
    tmp = marker.with_name(marker.name + ".tmp")
    tmp.write_text(f"{os.getpid()} {point}\n")
    os.replace(tmp, marker)  # the marker appears whole
    while not go.exists():
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(0.01)
