"""The main job's report renders byte for byte as recorded:
``tests/fixtures/demo_results.json`` is a ``--quick`` run's ``results.json`` (trimmed to what the
report reads, with a model card), and ``demo_report.md`` / ``demo_tables.md`` are what the
renderer wrote from it, reviewed when the report's wording changed (regenerate them only for an
intended change, and read the diff). Also: the method table drives the paired differences."""

from __future__ import annotations

import json
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"


def test_report_and_summary_tables_are_byte_identical_to_the_recorded_ones():
    from reap_modifier.demo import render_report, summary_tables

    results = json.loads((FIXTURES / "demo_results.json").read_text(encoding="utf-8"))
    assert render_report(results) == (FIXTURES / "demo_report.md").read_text(encoding="utf-8")
    assert summary_tables(results) == (FIXTURES / "demo_tables.md").read_text(encoding="utf-8")


def test_paired_rows_of_the_recorded_run_are_the_recorded_pairs():
    """The pairs the method table yields for the run's models are the ones ``results.json``
    recorded, in the same order."""
    from reap_modifier.demo.results import paired_rows

    results = json.loads((FIXTURES / "demo_results.json").read_text(encoding="utf-8"))
    got = [(a, b, "kl" in m) for a, b, m in paired_rows(results["eval"]["quality"])]
    want = [(p["a"], p["b"], "kl" in p) for p in results["paired"]]
    assert got == want
    # written out for the job's sparsity, so a change to the table shows here
    assert want[:10] == [
        ("reap_en", "reap_en_zh", False),
        ("reap_en_zh", "reap_en_zh_code", False),
        ("reap_en", "reap_en_zh_code", False),
        ("frequency", "reap_en_zh_code", False),
        ("router_l1", "reap_en_zh_code", False),
        ("router_signed_sum", "reap_en_zh_code", False),
        ("random", "reap_en_zh_code", False),
        ("reap_en", "reap_en_fit", True),
        ("reap_en_zh_code", "reap_en_zh_code_fit", True),
        ("reap_en_25", "reap_en_zh_25", False),
    ]


def test_a_generation_stays_on_one_line_of_the_report():
    """Greedy text may hold ``\\r`` or other line breaks; the report escapes them, so a reader
    with universal newlines reads back what was written."""
    from reap_modifier.demo.report_generations import _md

    text = _md("a\rb\nc|d\x0be\u2028f\tg`")
    assert text.splitlines() == [text]
    assert text == "a\\u000db \u21b5 c\\|d\\u000be\\u2028f\tg'"
