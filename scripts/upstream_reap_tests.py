"""Run llm-compressor 0.14.0.1's own REAP tests against reap-modifier's modifier.

Fetches llm-compressor's source distribution from PyPI into ``build/upstream/`` (once),
extracts ``tests/llmcompressor/modifiers/pruning/reap/`` with the conftests and helpers
it imports, and runs it with pytest and ``scripts/upstream_reap_plugin.py``, which points
upstream's ``REAPPruningModifier`` at ours. Prints one line per test (``outcome nodeid``)
and writes ``{nodeid: {"outcome": ..., "message": ...}}`` to ``--json``. The tests that
fail by design are listed, with why, in docs/upstream-compatibility.md and checked by
tests/test_upstream_suite.py.

Usage: .venv/bin/python scripts/upstream_reap_tests.py [--json build/upstream/results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

VERSION = "0.14.0.1"
ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "upstream"
SDIST = f"llmcompressor-{VERSION}.tar.gz"
TOP = f"llmcompressor-{VERSION}"
SUITE = "tests/llmcompressor/modifiers/pruning/reap"
#: besides the suite: the conftests on its path (fixtures, markers) and what it imports
NEEDED = (
    "pyproject.toml",
    "tests/__init__.py",
    "tests/conftest.py",
    "tests/testing_utils.py",
    "tests/llmcompressor/__init__.py",
    "tests/llmcompressor/conftest.py",
    "tests/llmcompressor/modifiers/__init__.py",
    "tests/llmcompressor/modifiers/pruning/__init__.py",
)


def fetch() -> Path:
    """The sdist, downloaded from PyPI by pip when not already in ``build/upstream``."""
    sdist = BUILD / SDIST
    if not sdist.is_file():
        BUILD.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llmcompressor=={VERSION}", "-d", str(BUILD), "-q"],
            check=True,
        )  # fmt: skip
    return sdist


def extract(sdist: Path) -> Path:
    """The suite and what it needs, under ``build/upstream/llmcompressor-<version>``."""
    with tarfile.open(sdist) as tar:
        wanted = [
            m
            for m in tar.getmembers()
            if m.isfile()
            and (m.name.removeprefix(TOP + "/") in NEEDED or m.name.startswith(f"{TOP}/{SUITE}/"))
        ]
        tar.extractall(BUILD, members=wanted, filter="data")
    return BUILD / TOP


def run(tree: Path, report: Path) -> int:
    """pytest on the suite with the plugin; its junit XML at ``report``."""
    env = dict(os.environ)
    paths = [str(ROOT / "scripts"), str(ROOT / "src"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    tmp = BUILD / "tmp"  # upstream's conftest walks the temp folder before and after
    tmp.mkdir(exist_ok=True)
    env["TMPDIR"] = str(tmp)
    command = [sys.executable, "-m", "pytest", SUITE, "-p", "upstream_reap_plugin",
               "-p", "no:cacheprovider", "-q", "-rN", f"--junitxml={report}"]  # fmt: skip
    return subprocess.run(command, cwd=tree, env=env).returncode


def outcomes(report: Path) -> dict[str, dict[str, str]]:
    """``{nodeid: {"outcome", "message"}}`` from pytest's junit XML."""
    results = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        parts = module.split("/")
        cls = parts.pop() if parts and parts[-1][:1].isupper() else None
        nodeid = "/".join(parts) + ".py::" + (f"{cls}::" if cls else "") + case.get("name", "")
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = node.get("message") or ""
                break
        results[nodeid] = {"outcome": outcome, "message": message}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=BUILD / "results.json")
    args = parser.parse_args(argv)
    tree = extract(fetch())
    report = BUILD / "junit.xml"
    report.unlink(missing_ok=True)
    rc = run(tree, report)
    if not report.is_file():
        print(f"pytest wrote no report (exit code {rc})", file=sys.stderr)
        return 2
    results = outcomes(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    for nodeid, result in sorted(results.items()):
        print(f"{result['outcome']:8} {nodeid}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
