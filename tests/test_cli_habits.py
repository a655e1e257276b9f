"""What every ``reap`` command promises: ``--version``, ``--help`` with an example, exit
codes (0 ok, 1 check failed, 2 bad input), and tables on stdout without ``-o``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from scores_synth import accumulate, routing
from typer.testing import CliRunner

import reap_modifier
from reap_modifier.cli import app

runner = CliRunner()

COMMANDS = [
    ("scores", "merge"),
    ("scores", "show"),
    ("scores", "from-weights"),
    ("cut",),
    ("tiers",),
    ("compare",),
    ("prune",),
    ("verify",),
    ("export-gguf",),
]


def test_version_from_the_installed_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "reap_modifier.cli", "--version"],
        capture_output=True,
        text=True,
        env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == f"reap-modifier {reap_modifier.__version__}"


@pytest.mark.parametrize("cmd", COMMANDS, ids=" ".join)
def test_every_command_has_help_with_an_example(cmd):
    res = runner.invoke(app, [*cmd, "--help"])
    assert res.exit_code == 0, res.output
    assert "Example" in res.output and f"reap {' '.join(cmd)}" in " ".join(res.output.split())


def test_top_level_help_documents_exit_codes():
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0
    assert "Exit codes: 0 ok, 1 a check failed, 2 usage or bad input" in " ".join(
        res.output.split()
    )


def _two_files(tmp_path):
    a = accumulate(None, [("en", *routing(200, 8, 2, seed=1))]).save(tmp_path / "A.scores")
    b = accumulate(None, [("zh", *routing(150, 8, 2, seed=3, prefer=[5, 6]))]).save(
        tmp_path / "B.scores"
    )
    return a, b


def test_compare_and_tiers_print_tables_and_write_nothing_without_o(tmp_path, monkeypatch):
    a, b = _two_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    res = runner.invoke(app, ["compare", str(a), str(b), "--keep", "4"])
    assert res.exit_code == 0, res.output
    assert (
        "keep/drop flips at keep 4" in res.output
        and "A -> B" in res.output
        and "wrote" not in res.output
    )
    res = runner.invoke(app, ["tiers", str(a), "--keep", "6", "4"])
    assert res.exit_code == 0, res.output
    assert "retained reap mass" in res.output and "wrote" not in res.output
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize(
    "args",
    [
        ["cut", "{missing}", "--keep", "4", "-o", "{out}"],
        ["tiers", "{a}"],
        ["compare", "{a}"],
        ["scores", "merge", "{a}", "-o", "{out}"],
        ["prune", "{tmp}", "--plan", "{missing}", "--out", "{out}"],
    ],
)
def test_bad_input_exits_2_and_writes_nothing(tmp_path, args):
    a, _ = _two_files(tmp_path)
    names = {
        "missing": tmp_path / "nope.scores",
        "out": tmp_path / "out.json",
        "a": a,
        "tmp": tmp_path,
    }
    res = runner.invoke(app, [x.format(**names) for x in args])
    assert res.exit_code == 2, res.output
    assert "error" in res.output.lower() and "Traceback" not in res.output
    assert not (tmp_path / "out.json").exists()
