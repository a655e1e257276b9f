"""The main job's report renders byte for byte as recorded:
``tests/fixtures/demo_results.json`` is a ``--quick`` run's ``results.json`` (trimmed to what the
report reads, with a model card; the components' ``change`` / ``se`` and the selections'
``end_to_end`` records, which that run predates, added by hand in the shape the step writes), and ``demo_report.md`` / ``demo_tables.md`` are what the
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
    assert want[:23] == [
        ("reap_en", "reap_en_zh", False),
        ("reap_en_zh", "reap_en_zh_code", False),
        ("reap_en", "reap_en_zh_code", False),
        ("frequency", "reap_en_zh_code", False),
        ("ean", "reap_en_zh_code", False),
        ("ean_mean", "reap_en_zh_code", False),
        ("router_l1", "reap_en_zh_code", False),
        ("router_signed_sum", "reap_en_zh_code", False),
        ("random", "reap_en_zh_code", False),
        ("reap_en", "reap_en_fit", True),
        ("reap_en_zh_code", "reap_en_zh_code_fit", True),
        ("reap_en", "reap_en_comp", True),
        ("reap_en_zh_code", "reap_en_zh_code_comp", True),
        ("reap_en_zh_code", "block_error_comp", True),
        ("reap_en_zh_code", "block_error_lang_comp", True),
        ("block_error_comp", "block_error_lang_comp", True),
        ("frequency", "block_error_comp", True),
        ("ean", "block_error_comp", True),
        ("ean_mean", "block_error_comp", True),
        ("router_l1", "block_error_comp", True),
        ("router_signed_sum", "block_error_comp", True),
        ("random", "block_error_comp", True),
        ("reap_en_25", "reap_en_zh_25", False),
    ]


def test_report_sections_count_their_own_rows():
    """The post-cut section's target counts each fit against its own cut (never a baseline
    against the best of ours), its fit tokens exclude the held-out batches, and the two
    selection objectives have their own paired table: each count read back from the recorded
    run's pairs and records."""
    import re

    from reap_modifier.demo import render_report

    results = json.loads((FIXTURES / "demo_results.json").read_text(encoding="utf-8"))
    report = render_report(results)
    pr = results["pruning"]
    fits = [n for n, r in pr.items() if r.get("router_fit")]
    cuts = {"reap_en", "reap_en_zh_code", "reap_en_75", "reap_en_zh_code_75"}
    assert len(fits) == 11
    target = re.search(r"met in (\d+) of the (\d+) rows of this table \(each fit", report)
    assert target and int(target[2]) == 3 * len(fits)
    q = results["eval"]["quality"]
    cut_and_fit = [p for p in results["paired"] if p["b"] in fits and p["a"] in cuts]
    assert len(cut_and_fit) == len(fits)
    met = sum(
        q[p["b"]][lang]["kl"] / q[p["a"]][lang]["kl"] - 1 <= -0.4
        for p in cut_and_fit
        for lang in ("en", "zh", "code")
    )
    assert int(target[1]) == met
    for name in fits:
        fit = pr[name]["router_fit"]
        assert fit["tokens"] - fit["validation"]["tokens"] == 320  # 384 less one batch of 64
    assert "| 320 | en |" in report and "| 384 | en |" not in report
    assert report.count("| block-error selection + compensation | worst-language block-error") == 2
    assert report.count("| block-error selection + compensation 75% | worst-language") == 2
    # what the post-cut step kept: every recorded decision once, counted from the records
    decisions = [
        (c["kept"], c["kl_before"], c["kl_after"])
        for n in fits
        for c in pr[n]["router_fit"]["components"]
    ] + [
        (e["applied"] == "block_error", e["kl_ranking_cut"], e["kl_selection"])
        for n in fits
        if (e := (pr[n]["router_fit"]["selection"] or {}).get("end_to_end"))
    ]
    kept = re.search(r"Kept: (\d+) of the (\d+) changes tried", report)
    assert kept and (int(kept[1]), int(kept[2])) == (sum(d[0] for d in decisions), len(decisions))
    section = report.split("## What the post-cut step kept")[1].split("\n## ")[0]
    cells = re.findall(r"(\d\.\d{4}) -> (\d\.\d{4}), [-+]\d\.\d{4} \+- \d\.\d{4}, (\S+)", section)
    assert sorted((k == "**kept**", float(a), float(b)) for a, b, k in cells) == sorted(
        (k, round(a, 4), round(b, 4)) for k, a, b in decisions
    )


def test_a_generation_stays_on_one_line_of_the_report():
    """Greedy text may hold ``\\r`` or other line breaks; the report escapes them, so a reader
    with universal newlines reads back what was written."""
    from reap_modifier.demo.report_generations import _md

    text = _md("a\rb\nc|d\x0be\u2028f\tg`")
    assert text.splitlines() == [text]
    assert text == "a\\u000db \u21b5 c\\|d\\u000be\\u2028f\tg'"


def test_a_run_on_the_development_split_says_so():
    """``--split dev``: the quality section names the development split, and the unpruned row
    is not compared with the model card's windows."""
    from reap_modifier.demo import render_report

    results = json.loads((FIXTURES / "demo_results.json").read_text(encoding="utf-8"))
    assert results["eval"]["split"] == "eval"
    eval_report = render_report(results)
    assert "`data.eval_windows`, seed 1234" in eval_report
    results["eval"] = {**results["eval"], "split": "dev", "seed": 4242}
    results["model"]["model_card"]["same_windows"] = False
    report = render_report(results)
    assert "**the development split**: `data.dev_windows`, seed 4242" in report
    assert "`data.eval_windows`" not in report
    assert "Unpruned NLL vs the model card (different windows: not comparable)" in report
