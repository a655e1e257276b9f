"""Makes the suite's helper modules importable by their plain names: ``tests/helpers``
(input builders, fixtures' makers) and ``tests/oracles`` (reference values) go on
``sys.path``. ``conftest.py``, the data-parallel worker and every fresh-process script import
it first (``sys.path.insert(0, "<tests>/helpers"); import paths``)."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
HELPERS = TESTS / "helpers"
ORACLES = TESTS / "oracles"

for _folder in (TESTS, ORACLES, HELPERS):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))
