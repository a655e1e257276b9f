"""Benchmark: how long the ``reap`` command takes to start, as whole processes, beside an empty
interpreter (``python -c pass``).

Times, each as a fresh process (interpreter start, imports and exit included), in turn
(round-robin, so a drifting machine load spreads over all of them):

- ``python -c pass``: the floor every command pays;
- ``reap --help`` (run as ``python -m reap_modifier.cli --help``, what the ``reap`` script runs);
- ``reap prune SRC.gguf --plan plan.json -o DST.gguf``: a tiny synthetic GGUF (2 MoE layers x 8
  Q4_K experts, ~1.8 MB), half the experts kept; each run writes a new file.

Prints min and median wall seconds per command and the median over ``python -c pass``.

    python benchmarks/bench_cli_startup.py [--runs 9] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
from gguf_synth import write_moe  # noqa: E402

KEPT = {"model.layers.0.mlp": [0, 3, 5, 6], "model.layers.1.mlp": [1, 2, 4, 7]}


def wall(cmd: list[str]) -> float:
    """Seconds from the start of ``cmd`` to its exit; it must exit 0."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=9, help="timed runs per command (after 1 warm-up)")
    ap.add_argument("--workdir", type=Path, default=None, help="where the tiny GGUF goes")
    args = ap.parse_args()
    if args.runs < 1:
        raise SystemExit("--runs must be at least 1")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-cli-startup-"))
    work.mkdir(parents=True, exist_ok=True)
    src = write_moe(work / "src.gguf", expert_type="Q4_K")
    plan = work / "plan.json"
    plan.write_text(
        json.dumps({"format": "reap-plan", "version": 1, "num_experts": 8, "kept": KEPT})
    )
    py, reap = sys.executable, [sys.executable, "-m", "reap_modifier.cli"]
    counter = iter(range(1 << 30))

    def prune() -> list[str]:
        out = work / f"out-{next(counter)}.gguf"
        return [*reap, "prune", str(src), "--plan", str(plan), "-o", str(out), "-q"]

    commands = {
        "python -c pass": lambda: [py, "-c", "pass"],
        "reap --help": lambda: [*reap, "--help"],
        "reap prune SRC.gguf --plan": prune,
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    for run in range(args.runs + 1):  # the first round is the warm-up
        for name, cmd in commands.items():
            dt = wall(cmd())
            if run:
                times[name].append(dt)
    for stale in work.glob("out-*.gguf"):
        stale.unlink()
    floor = statistics.median(times["python -c pass"])
    print(f"{args.runs} runs each after 1 warm-up, in turn; wall seconds of the whole process")
    print(f"{'command':<30} {'min s':>7} {'median s':>9} {'median - python s':>18}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<30} {min(ts):7.3f} {med:9.3f} {med - floor:18.3f}")


if __name__ == "__main__":
    main()
