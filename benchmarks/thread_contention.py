"""Calibration wall time by thread setting, on an idle machine and beside a second CPU-bound job.

Each run is a fresh process (OpenMP reads its settings once, at start) that calibrates REAP on the
bundled model through ``oneshot`` (packed MXFP4 experts, one MoE layer dense at a time, as the main
job does) over ``--tokens`` random token ids.  Settings, run interleaved, ``--repeats`` times each:

- ``1 thread``: ``torch.set_num_threads(1)``
- ``2 threads``: two OpenMP threads, the library's default wait policy (threads spin at barriers)
- ``2 threads, PASSIVE``: two threads with ``OMP_WAIT_POLICY=PASSIVE`` (threads sleep at barriers)

``--load`` runs every setting a second time beside another CPU-bound job: a process multiplying
matrices with as many threads as the machine has cores, as a second torch job would.  A run that
takes longer than ``--cap`` times the idle 1-thread run is stopped and printed as ``>``.

Usage: ``python benchmarks/thread_contention.py [--tokens 16384] [--repeats 2] [--load]``
       ``python benchmarks/thread_contention.py --load-only SECONDS`` (just the CPU-bound job)
       ``python benchmarks/thread_contention.py --wrap -- CMD ...`` (CMD beside the CPU-bound job)
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "tiny-k3-bilingual"
SETTINGS = {
    "1 thread": {"threads": 1, "env": {}},
    "2 threads": {"threads": 2, "env": {}},
    "2 threads, PASSIVE": {"threads": 2, "env": {"OMP_WAIT_POLICY": "PASSIVE"}},
}


def cpu_load(seconds: float) -> None:
    """A CPU-bound job: float32 matrix products on every core until ``seconds`` pass."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    a = torch.randn(512, 512)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        a = torch.tanh(a @ a)


def start_load(seconds: float = 3600) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, "--load-only", str(seconds)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def calibrate(tokens: int, seq: int, threads: int) -> None:
    """One REAP calibration of the bundled model (the measured work)."""
    import torch

    torch.set_num_threads(threads)
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoTokenizer

    from reap_modifier.demo.workspace import load_model, quiet_libraries
    from reap_modifier.modifier import REAPPruningModifier

    quiet_libraries()
    tok = AutoTokenizer.from_pretrained(MODEL)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, len(tok), (tokens // seq, seq), generator=gen).tolist()
    ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * seq for _ in ids]})
    model = load_model(str(MODEL), packed=True, dtype="float32")
    oneshot(
        model=model,
        recipe=[REAPPruningModifier(sparsity=0.5, dequantize="layer")],
        processor=tok,
        dataset=ds,
        num_calibration_samples=len(ds),
        moe_calibrate_all_experts=False,
    )


def timed_run(setting: str, tokens: int, seq: int, cap: float | None) -> float | None:
    """Wall seconds of one calibration in a fresh process; ``None`` when stopped at ``cap``."""
    s = SETTINGS[setting]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    env.update(s["env"], OMP_NUM_THREADS=str(s["threads"]))
    cmd = [sys.executable, __file__, "--child", str(tokens), str(seq), str(s["threads"])]
    t = time.monotonic()
    try:
        subprocess.run(cmd, env=env, check=True, timeout=cap, capture_output=True)
    except subprocess.TimeoutExpired:
        return None
    return time.monotonic() - t


def measure(args, loaded: bool, base: float | None) -> dict[str, list[float | None]]:
    times: dict[str, list[float | None]] = {k: [] for k in SETTINGS}
    load = start_load() if loaded else None
    try:
        for _ in range(args.repeats):
            for setting in SETTINGS:
                cap = args.cap * base if base else None
                times[setting].append(timed_run(setting, args.tokens, args.seq, cap))
                if base is None and setting == "1 thread":
                    base = times[setting][-1]
    finally:
        if load is not None:
            load.kill()
            load.wait()
    return times


def fmt(ts: list[float | None], cap_s: float) -> str:
    done = [t for t in ts if t is not None]
    if len(done) < len(ts):
        return f">{cap_s:.0f}"
    return f"{statistics.median(done):.1f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--load", action="store_true", help="also measure beside a CPU-bound job")
    p.add_argument("--cap", type=float, default=15.0, help="stop a run past this x idle 1-thread")
    p.add_argument("--child", nargs=3, type=int, help=argparse.SUPPRESS)
    p.add_argument("--load-only", type=float, metavar="SECONDS", help="only run the CPU-bound job")
    p.add_argument("--wrap", metavar="CMD", help="-- CMD ...: run CMD beside the CPU-bound job")
    argv = sys.argv[1:]
    wrap = argv[argv.index("--wrap") + 1 :] if "--wrap" in argv else None
    a = p.parse_args(argv[: argv.index("--wrap")] if wrap is not None else argv)
    a.wrap = wrap[1:] if wrap and wrap[0] == "--" else wrap
    if a.child:
        calibrate(*a.child)
        return 0
    if a.load_only:
        cpu_load(a.load_only)
        return 0
    if a.wrap:
        cmd = a.wrap
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: stop both
        load = start_load()
        t = time.monotonic()
        proc = subprocess.Popen(cmd)
        try:
            rc = proc.wait()
        finally:
            for p in (proc, load):
                if p.poll() is None:
                    p.kill()
                p.wait()
        print(f"{' '.join(cmd)}: rc {rc}, {time.monotonic() - t:.0f} s beside a CPU-bound job")
        return rc

    print(
        f"REAP calibration of {MODEL.name}: {a.tokens} tokens ({a.tokens // a.seq} x {a.seq}), "
        f"{os.cpu_count()} CPUs, median of {a.repeats}, load average at start "
        f"{os.getloadavg()[0]:.1f}"
    )
    idle = measure(a, loaded=False, base=None)
    base = statistics.median([t for t in idle["1 thread"] if t is not None])
    rows = [("idle", idle)]
    if a.load:
        rows.append(("beside a CPU-bound job", measure(a, loaded=True, base=base)))
    print("| machine | " + " | ".join(f"{k} s" for k in SETTINGS) + " |")
    print("|---|" + "---:|" * len(SETTINGS))
    for name, times in rows:
        print(f"| {name} | " + " | ".join(fmt(times[k], a.cap * base) for k in SETTINGS) + " |")
    print(f"(ratios to the idle 1-thread run; a '>' run was stopped at {a.cap:.0f}x)")
    for name, times in rows:
        print(
            f"| {name} | "
            + " | ".join(
                "-" if None in times[k] else f"{statistics.median(times[k]) / base:.2f}x"
                for k in SETTINGS
            )
            + " |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
