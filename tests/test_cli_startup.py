"""The ``reap`` command imports only what the command needs: ``reap --help`` (and a command's
help) imports no torch, transformers, llm-compressor, safetensors or numpy, and a GGUF prune
(``gguf`` + numpy) no torch, transformers, llm-compressor or safetensors. Each runs as its own
process (``python -X importtime -m reap_modifier.cli``); the modules it imported are read from
its import-time log. Judged on the module set, never on time."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gguf_synth import write_moe, write_plan

#: what only model work needs (torch and what stands on it)
MODEL_STACK = {"torch", "transformers", "llmcompressor", "compressed_tensors", "safetensors"}

_IMPORT_LINE = re.compile(r"^import time:\s+\d+ \|\s+\d+ \| *(\S+)$", re.M)


def imported(*args: str, cwd=None) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``reap ARGS`` in a fresh interpreter; the process and the top-level packages
    it imported."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "reap_modifier.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env={**os.environ, "COLUMNS": "120"},
    )
    return proc, {name.split(".")[0] for name in _IMPORT_LINE.findall(proc.stderr)}


def test_import_log_is_read():
    """The oracle reads the log: a process that imports numpy shows it."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import numpy"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "numpy" in {n.split(".")[0] for n in _IMPORT_LINE.findall(proc.stderr)}


@pytest.mark.parametrize("args", [["--help"], ["prune", "--help"], ["eval", "-h"]])
def test_help_imports_no_model_stack(args):
    proc, modules = imported(*args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Usage:" in proc.stdout
    assert "typer" in modules  # the log was read
    assert modules & (MODEL_STACK | {"numpy"}) == set()


def test_gguf_prune_imports_no_torch(tmp_path):
    src = write_moe(tmp_path / "src.gguf", expert_type="Q4_K")
    plan = write_plan(tmp_path / "plan.json")
    out = tmp_path / "out.gguf"
    proc, modules = imported("prune", src, "--plan", plan, "-o", out, "-q")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert Path(proc.stdout.strip()).resolve() == out.resolve()
    assert out.is_file()
    assert "gguf" in modules  # it did the work
    assert modules & MODEL_STACK == set()
