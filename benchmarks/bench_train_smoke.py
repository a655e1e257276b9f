"""Time ``scripts/train_tiny_k3.py --preset smoke`` end to end (tokenizer -> a few
training steps -> MXFP4 -> model card) on the synthetic corpus of
``tests/test_train_script.py``, as a fresh process (wall clock, so Python start-up and
imports included), median over ``--repeat`` runs. Target: under 60 s on a CI runner.

Usage: ``python benchmarks/bench_train_smoke.py [--repeat 3]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
import paths  # noqa: E402,F401  (tests/helpers and tests/oracles by name)
from test_train_script import SCRIPT, synthetic_corpus  # noqa: E402

TARGET_S = 60.0


def run_once(root: Path, seed: int) -> float:
    data = synthetic_corpus(root / "data")
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, str(SCRIPT), "--preset", "smoke", "--data-dir", str(data),
           "--out", str(root / "model"), "--work-dir", str(root / "work"),
           "--max-minutes", "0", "--seed", str(seed)]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-6000:])
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    times = []
    for i in range(args.repeat):
        with tempfile.TemporaryDirectory() as tmp:
            times.append(run_once(Path(tmp), seed=3))
        print(f"run {i + 1}: {times[-1]:.1f} s")
    med = statistics.median(times)
    verdict = "met" if med < TARGET_S else "MISSED"
    print(f"train_tiny_k3.py --preset smoke, median of {args.repeat}: {med:.1f} s "
          f"(target < {TARGET_S:.0f} s: {verdict})")  # fmt: skip


if __name__ == "__main__":
    main()
