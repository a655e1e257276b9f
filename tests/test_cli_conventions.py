"""Conventions every ``reap`` command keeps, checked by walking the command tree: ``-h`` is
``--help``, the output flag is spelled ``-o`` / ``--out`` (``--output``, the old spelling of
three commands, still accepted but not shown), and options with a fixed set of values show it
in their help."""

from __future__ import annotations

import pytest
import typer
from scores_synth import accumulate, routing
from typer.testing import CliRunner

from reap_modifier.cli import app

runner = CliRunner()


def _walk(cmd, path: tuple[str, ...] = ()):
    """(path, command) of every leaf command (typer vendors click: duck-typed)."""
    if hasattr(cmd, "commands"):
        for name, sub in sorted(cmd.commands.items()):
            yield from _walk(sub, (*path, name))
    else:
        yield path, cmd


ROOT = typer.main.get_command(app)
COMMANDS = dict(_walk(ROOT))

SALIENCY = ["reap", "frequency", "weighted_frequency", "ean", "ean_mean", "max_norm"]

#: options whose values are a fixed set, by command: they must be choices shown in help
FIXED = {
    ("eval",): {
        "--backend": ["transformers", "vllm"],
        "--dtype": ["auto", "float32", "bfloat16", "float16"],
    },
    ("scores", "from-weights"): {"--method": ["router_l1", "router_signed_sum", "random"]},
    ("export-gguf",): {"--outtype": ["auto", "f32", "f16", "bf16", "q8_0"]},
    **{
        cmd: {"--saliency": [*SALIENCY, "router_l1", "router_signed_sum", "random"]}
        for cmd in [("cut",), ("tiers",), ("compare",)]
    },
}

#: commands whose output flag was ``--output`` before it became ``--out`` (``scores
#: from-weights``, the third, needs a checkpoint: its option is checked by the walk)
RENAMED = [("scores", "merge"), ("cut",)]


def _help(args: list[str]) -> str:
    res = runner.invoke(app, args, env={"COLUMNS": "240"})
    assert res.exit_code == 0, res.output
    return res.output


def test_the_walk_finds_every_command():
    assert set(COMMANDS) == {
        ("compare",), ("cut",), ("eval",), ("export-gguf",), ("prune",), ("tiers",), ("verify",),
        ("scores", "from-weights"), ("scores", "merge"), ("scores", "show"),
    }  # fmt: skip


@pytest.mark.parametrize("path", sorted(COMMANDS), ids=" ".join)
def test_h_is_help(path):
    assert _help([*path, "-h"]) == _help([*path, "--help"])
    assert f"reap {' '.join(path)}" in " ".join(_help([*path, "-h"]).split())


@pytest.mark.parametrize("group", [[], ["scores"]], ids=["reap", "reap scores"])
def test_h_is_help_for_groups(group):
    assert _help([*group, "-h"]) == _help([*group, "--help"])


@pytest.mark.parametrize("path", sorted(COMMANDS), ids=" ".join)
def test_output_flag_is_o_out_and_output_is_hidden(path):
    cmd = COMMANDS[path]
    outs = [p for p in cmd.params if p.param_type_name == "option" and "-o" in p.opts]
    for p in outs:
        assert sorted(p.opts) == ["--out", "-o"], (path, p.opts)
    every = {
        o for p in cmd.params for o in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ()))
    }
    assert "--output" not in every  # the old spelling is an alias, not an option
    assert "--output " not in _help([*path, "-h"])


@pytest.mark.parametrize("path", sorted(FIXED), ids=" ".join)
def test_fixed_values_are_choices_shown_in_help(path):
    text = " ".join(_help([*path, "-h"]).split())
    for flag, values in FIXED[path].items():
        assert f"<{'|'.join(values)}>" in text, (flag, text)
        res = runner.invoke(app, [*path, "x", flag, "nope"], env={"COLUMNS": "240"})
        assert res.exit_code == 2 and "'nope' is not one of" in res.output, res.output


@pytest.mark.parametrize("path", RENAMED, ids=" ".join)
@pytest.mark.parametrize("spelling", ["-o", "--out", "--output", "--output="])
def test_old_output_spelling_still_works(path, spelling, tmp_path):
    a = accumulate(None, [("en", *routing(200, 8, 2, seed=1))]).save(tmp_path / "A.scores")
    b = accumulate(None, [("zh", *routing(150, 8, 2, seed=3))]).save(tmp_path / "B.scores")
    dst = tmp_path / "written"
    args = {("scores", "merge"): [str(a), str(b)], ("cut",): [str(a), "--keep", "4"]}[path]
    flag = [spelling + str(dst)] if spelling.endswith("=") else [spelling, str(dst)]
    res = runner.invoke(app, [*path, *args, *flag])
    assert res.exit_code == 0, res.output
    assert dst.is_file()


@pytest.mark.parametrize("routed", [True, False], ids=["reap", "plain-import"])
def test_llmcompressor_logs_leave_stdout_to_results(routed):
    """llm-compressor opens its log sink on stdout when imported; under the ``reap`` command
    it writes to stderr. (The plain import shows the upstream behaviour the workaround is for:
    when it fails, upstream logs to stderr and the workaround can go.)"""
    import os
    import subprocess
    import sys

    code = (
        "from reap_modifier.cli.common import third_party_logs_to_stderr as f; f()\n"
        if routed
        else ""
    ) + "import llmcompressor\nfrom loguru import logger\nlogger.warning('probe-line')\n"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    if routed:
        assert proc.stdout == "" and "probe-line" in proc.stderr
    else:
        assert "probe-line" in proc.stdout
