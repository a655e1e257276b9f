"""Benchmark: ``reap prune`` on a GGUF file against ``cp`` of the same kept bytes, and the
rewriting process's peak RSS.

Builds a synthetic GGUF (default ~1 GiB: Q4_K-typed random expert tensors, 64 experts, f32
routers; written one tensor at a time with the ``gguf`` package's writer), prunes half of the
experts with a random plan (kept ids scattered), and prints:

- the rewrite itself (``prepare_gguf_rewrite(...).run()``, timed in a fresh process after its
  imports), with its peak RSS (``VmHWM``) and the RSS after imports;
- ``reap prune SRC.gguf --plan`` end to end (interpreter start and imports included);
- ``cp`` of the pruned output (exactly the bytes written) to a new file.

Target: rewrite >= 0.8x cp. Every step starts after ``sync`` and with the source in the page
cache (read once before), so no step pays for the previous one's dirty pages or a cold read.

    python benchmarks/bench_gguf_prune_throughput.py [--gib 1] [--repeat 3] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MiB, GiB = 1 << 20, 1 << 30

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from reap_modifier.gguf import prepare_gguf_rewrite
from reap_modifier.scores.plan import PruningPlan
t1 = time.perf_counter()
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
rss_imports = status("VmRSS")
src, plan, dst = sys.argv[1:4]
t2 = time.perf_counter()
prepare_gguf_rewrite(src, PruningPlan.load(plan), dst, progress=False).run()
t3 = time.perf_counter()
print(json.dumps({"imports_s": t1 - t0, "rewrite_s": t3 - t2, "rss_imports": rss_imports,
                  "peak_rss": status("VmHWM")}))
"""


def build(path: Path, gib: float, n_expert: int = 64, embd: int = 2048, ff: int = 512) -> int:
    """A Q4_K MoE GGUF of about ``gib`` GiB, written one tensor at a time; returns layers."""
    import gguf
    import numpy as np

    qt = gguf.GGMLQuantizationType.Q4_K
    block, size = gguf.GGML_QUANT_SIZES[qt]
    per_tensor = n_expert * ff * embd // block * size
    layers = max(1, round(gib * GiB / (3 * per_tensor)))
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_block_count(layers)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(8)
    shapes = {}
    for L in range(layers):
        shapes[f"blk.{L}.ffn_gate_inp.weight"] = ((n_expert, embd), np.float32, None)
        for name, (ne1, ne0) in (("gate", (ff, embd)), ("up", (ff, embd)), ("down", (embd, ff))):
            byte_shape = (n_expert, ne1, ne0 // block * size)
            shapes[f"blk.{L}.ffn_{name}_exps.weight"] = (byte_shape, np.uint8, qt)
    for name, (shape, dtype, raw) in shapes.items():
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, shape, np.dtype(dtype), nbytes, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for shape, dtype, _ in shapes.values():
        if dtype == np.uint8:
            w.write_tensor_data(rng.integers(0, 256, shape, dtype=np.uint8))
        else:
            w.write_tensor_data(rng.standard_normal(shape).astype(dtype))
    w.close()
    return layers


def sync_and_cache(path: Path) -> None:
    subprocess.run(["sync"], check=True)
    with open(path, "rb") as f:
        while f.read(64 * MiB):
            pass


def timed(cmd, env=None) -> tuple[float, str]:
    t = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-gguf-", dir=args.workdir))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    try:
        src = work / "src.gguf"
        layers = build(src, args.gib)
        rnd = random.Random(0)
        kept = {f"model.layers.{L}.mlp": sorted(rnd.sample(range(64), 32)) for L in range(layers)}
        plan = work / "plan.json"
        plan.write_text(
            json.dumps({"format": "reap-plan", "version": 1, "num_experts": 64, "kept": kept})
        )
        rows = {"rewrite": [], "reap prune (CLI)": [], "cp": []}
        child = {}
        for i in range(args.repeat):
            for p in work.glob("out*"):
                p.unlink()
            sync_and_cache(src)
            _, out = timed(
                [sys.executable, "-c", CHILD, str(src), str(plan), str(work / f"out{i}.gguf")], env
            )
            child = json.loads(out.strip().splitlines()[-1])
            rows["rewrite"].append(child["rewrite_s"])
            sync_and_cache(src)
            cli = [
                sys.executable,
                "-m",
                "reap_modifier.cli",
                "prune",
                str(src),
                "--plan",
                str(plan),
            ]
            s, _ = timed([*cli, "-o", str(work / f"out-cli{i}.gguf"), "-q"], env)
            rows["reap prune (CLI)"].append(s)
            sync_and_cache(work / f"out{i}.gguf")
            s, _ = timed(["cp", str(work / f"out{i}.gguf"), str(work / f"out-cp{i}.gguf")])
            rows["cp"].append(s)
        written = (work / f"out{args.repeat - 1}.gguf").stat().st_size
        cp_best = min(rows["cp"])
        print(
            f"source {src.stat().st_size / GiB:.2f} GiB, written {written / GiB:.2f} GiB "
            f"({layers} layers x 3 Q4_K expert tensors, 64 -> 32 experts), best of {args.repeat}:"
        )
        for name, times in rows.items():
            best = min(times)
            print(
                f"  {name:18s} {best:6.2f} s  {written / GiB / best:5.2f} GiB/s  {cp_best / best:4.2f}x cp"
            )
        print(
            f"  imports {child['imports_s']:.2f} s; RSS after imports {child['rss_imports'] / MiB:.0f} MiB, "
            f"peak {child['peak_rss'] / MiB:.0f} MiB"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
