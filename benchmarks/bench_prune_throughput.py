"""Benchmark: ``reap prune`` throughput vs ``cp`` of the same kept bytes, and peak RSS
vs the largest shard.

Builds a multi-shard MXFP4-like checkpoint (random uint8 ``weight_packed`` /
``weight_scale`` tensors with Kimi-K3 naming, bf16 routers, default 2 GiB in 512 MiB
shards), prunes it with a random plan (default 50% of experts, kept ids scattered),
and prints in one run:

- the rewrite itself (``rewrite_checkpoint``, timed inside a fresh process after its
  imports): cold (sha256 of every source shard and every output shard), warm (a
  second cut from the same source: source hashes reused from the cache) and
  ``hash_source=False``;
- ``reap prune --plan`` end to end (interpreter start and imports included);
- ``cp -r`` of the pruned output (exactly the kept bytes) to a new directory;
- peak RSS (``VmHWM``, measured inside each child) of the rewriting process and of
  the CLI vs the largest shard, and the RSS of the interpreter after its imports.

Each step also reports its CPU seconds (user + system, every thread; ``cp``'s from
``RUSAGE_CHILDREN``): on a shared machine wall times move with the load, the work does
not.  The ratio to ``cp`` is also given per repetition (each rewrite against the ``cp``
of the same repetition): min and median.

Targets: rewrite >= 0.8x cp throughput; peak RSS < largest shard + 256 MiB.
Every step starts after ``sync`` so that no step pays for the previous one's dirty
pages.  Everything runs from the page cache when RAM allows (both cp and prune).

``--alignment`` instead copies the plan's kept byte ranges with ``copy_file_range``
three ways, side by side, and prints the CPU seconds per GiB of each (best of
``--repeat``): the output data placed as the writer places it (source offsets kept
modulo ``COPY_ALIGN``, first piece of each range cut at a multiple of it), placed
right after a header as long as the source's in 16 MiB pieces from the start of each
range (as the previous writer did), and ``cp`` of the first way's files (same bytes).

    python benchmarks/bench_prune_throughput.py [--gib 2] [--shard-mib 512]
        [--sparsity 0.5] [--repeat 2] [--workdir DIR] [--keep-files] [--alignment] [--no-cli]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
import paths  # noqa: E402,F401  (tests/helpers and tests/oracles by name)

sys.path.insert(0, str(ROOT / "src"))

MiB = 1 << 20
GiB = 1 << 30

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from reap_modifier.checkpoint import rewrite_checkpoint
from reap_modifier.scores.plan import PruningPlan
import reap_modifier.cli  # what `reap prune` imports too
t1 = time.perf_counter()
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
rss_imports = status("VmRSS")
src, plan, dst, hash_source, cache = sys.argv[1:6]
plan = PruningPlan.load(plan)
c2 = time.process_time()
t2 = time.perf_counter()
rewrite_checkpoint(src, plan, dst, progress=False, hash_source=hash_source == "1",
                   hash_cache=False if cache == "off" else cache)
t3 = time.perf_counter()
c3 = time.process_time()
print("BENCH " + json.dumps({"import_s": t1 - t0, "rewrite_s": t3 - t2, "cpu_s": c3 - c2,
                             "rss_imports": rss_imports, "rss_peak": status("VmHWM")}))
"""


#: `reap` CLI, reporting its own peak RSS (VmHWM) at exit: wait4's ru_maxrss would
#: also count the parent's memory image the child was forked/vforked from
CLI = r"""
import atexit, sys
def _hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            sys.stderr.write("BENCH-HWM %d\n" % (int(line.split()[1]) * 1024))
atexit.register(_hwm)
from reap_modifier.cli import app
sys.argv = ["reap"] + sys.argv[1:]
app()
"""


def _dir_bytes(path: Path, suffix: str = ".safetensors") -> int:
    return sum(p.stat().st_size for p in path.rglob(f"*{suffix}"))


def _run(args: list[str], env: dict | None = None) -> tuple[str, str, float]:
    """Run a child; return (stdout, stderr, wall seconds)."""
    env = dict(env or os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryFile("w+") as fout, tempfile.TemporaryFile("w+") as ferr:
        t = time.perf_counter()
        proc = subprocess.Popen(args, stdout=fout, stderr=ferr, env=env, text=True)
        proc.wait()
        wall = time.perf_counter() - t
        fout.seek(0)
        ferr.seek(0)
        out, err = fout.read(), ferr.read()
    if proc.returncode:
        raise SystemExit(f"child failed ({proc.returncode}):\n{out[-2000:]}\n{err[-4000:]}")
    return out, err, wall


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def alignment(src: Path, plan_file: Path, work: Path, repeat: int) -> None:
    """CPU seconds per GiB of the kernel copy of the plan's kept ranges, placed three ways."""
    from reap_modifier.checkpoint.binding import bind_plan
    from reap_modifier.checkpoint.byte_copy import (
        COPY_ALIGN,
        copy_range,
        copy_residue,
        merge_ranges,
    )
    from reap_modifier.checkpoint.rewrite import inspect_source
    from reap_modifier.scores.plan import PruningPlan

    layout = inspect_source(src)
    spec = bind_plan(layout, PruningPlan.load(plan_file))
    jobs = []
    for shard in layout.shards:
        names = [n for n, s in layout.weight_map.items() if s == shard]
        segs = [r for _, _, ranges, _ in spec.output_plan(shard, names) for r in ranges]
        jobs.append((layout.path / shard, merge_ranges(segs), layout.shards[shard].header_len))
    out = work / "alignment"

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    def ranged(aligned: bool) -> tuple[float, int]:
        fresh(out)
        out.mkdir()
        c, total = cpu(), 0
        for i, (path, segs, header_len) in enumerate(jobs):
            fi = os.open(path, os.O_RDONLY)
            fo = os.open(out / str(i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            pos = 8 + header_len  # a header as long as the source's
            if aligned:
                pos += (copy_residue(segs) - pos) % COPY_ALIGN
            for b, e in segs:
                if aligned:
                    copy_range(fi, fo, b, e, pos)
                else:  # the previous writer: 16 MiB pieces from the start of each range
                    while b < e:
                        n = os.copy_file_range(fi, fo, min(16 * MiB, e - b), b, pos)
                        b, pos, total = b + n, pos + n, total + n
                    continue
                pos, total = pos + e - b, total + e - b
            os.close(fi)
            os.close(fo)
        return cpu() - c, total

    def whole(files: list[Path]) -> tuple[float, int]:
        fresh(out)
        out.mkdir()
        c = _children_cpu()
        subprocess.run(["cp", *map(str, files), str(out)], check=True)
        return _children_cpu() - c, sum(p.stat().st_size for p in files)

    fresh(work / "aligned_out")
    copied = ranged(True)  # an output to cp: the kept bytes, written as the writer does
    kept_files = sorted(out.iterdir())
    shutil.move(str(out), work / "aligned_out")
    kept_files = [work / "aligned_out" / p.name for p in kept_files]
    best: dict[str, float] = {}
    for _ in range(repeat):
        for label, fn in (
            ("writer's placement (COPY_ALIGN)", lambda: ranged(True)),
            ("unpadded header, 16 MiB pieces", lambda: ranged(False)),
            ("cp of those kept bytes", lambda: whole(kept_files)),
        ):
            sec, nbytes = fn()
            best[label] = min(best.get(label, 1e9), sec / (nbytes / GiB))
    fresh(out)
    fresh(work / "aligned_out")
    print(
        f"kernel copy of the kept ranges ({copied[1] / GiB:.3f} GiB), CPU s per GiB, best of {repeat}:"
    )
    for label, v in best.items():
        print(f"  {label:34s} {v:6.3f}  ({v / best['cp of those kept bytes']:.2f}x cp's CPU)")
    print("BENCH-ALIGNMENT " + json.dumps({"cpu_s_per_gib": best, "copy_align": COPY_ALIGN}))


def fresh(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.sync()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gib", type=float, default=2.0, help="approximate source size (GiB, >= 1)")
    ap.add_argument("--shard-mib", type=int, default=512, help="shard size (MiB)")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--repeat", type=int, default=2, help="timed repetitions (best is reported)")
    ap.add_argument(
        "--workdir", type=Path, default=None, help="where to build (default: a temp dir)"
    )
    ap.add_argument("--keep-files", action="store_true")
    ap.add_argument(
        "--alignment",
        action="store_true",
        help="only the kernel copy's CPU cost by output placement (see above)",
    )
    ap.add_argument(
        "--no-cli",
        action="store_true",
        help="skip the end-to-end CLI step (its imports take most of a loaded machine's time)",
    )
    args = ap.parse_args()

    from mxfp4_fixtures import write_synthetic_mxfp4

    from reap_modifier.scores.plan import PruningPlan

    work = Path(args.workdir or tempfile.mkdtemp(prefix="reap-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    src = work / "src"
    hidden, inter, E = 2048, 1024, args.experts
    per_expert = 3 * (inter * hidden // 2 + inter * hidden // 32)
    layers = max(2, round(args.gib * GiB / (per_expert * E)))
    try:
        t = time.perf_counter()
        if not (src / "model.safetensors.index.json").is_file():
            info = write_synthetic_mxfp4(
                src,
                num_layers=layers + 1,
                num_experts=E,
                top_k=8,
                hidden=hidden,
                inter=inter,
                shard_bytes=args.shard_mib * MiB,
                dense_layers=1,
            )
        else:
            idx = json.loads((src / "model.safetensors.index.json").read_text())
            blocks = sorted(
                {k.split(".experts.")[0] for k in idx["weight_map"] if ".experts." in k}
            )
            info = {"blocks": blocks}
        build_s = time.perf_counter() - t
        src_bytes = _dir_bytes(src)
        largest = max(p.stat().st_size for p in src.glob("*.safetensors"))
        n_shards = len(list(src.glob("*.safetensors")))
        keep = E - round(args.sparsity * E)
        rng = random.Random(0)
        plan = PruningPlan(
            kept={b: sorted(rng.sample(range(E), keep)) for b in info["blocks"]},
            num_experts=E,
            saliency="random",
        )
        plan_file = work / "plan.json"
        plan.save(plan_file)
        print(
            f"source: {src_bytes / GiB:.2f} GiB in {n_shards} shards (largest {largest / MiB:.0f} MiB), "
            f"{len(info['blocks'])} MoE layers x {E} experts -> keep {keep}  [built in {build_s:.1f}s]"
        )
        if args.alignment:
            alignment(src, plan_file, work, args.repeat)
            return

        results: dict[str, list] = {"cp": [], "cold": [], "warm": [], "nohash": [], "cli": []}
        cpu: dict[str, list] = {"cp": [], "cold": [], "warm": [], "nohash": []}
        rss: dict[str, int] = {}
        kept_bytes = None
        cache = work / "sha256-cache.json"
        env_cache = dict(os.environ, REAP_SHA256_CACHE=str(cache))

        def rewrite(label: str, hash_flag: str, cache_arg: str):
            dst = work / f"dst_{label}"
            fresh(dst)
            out, _, _ = _run(
                [
                    sys.executable,
                    "-c",
                    CHILD,
                    str(src),
                    str(plan_file),
                    str(dst),
                    hash_flag,
                    cache_arg,
                ]
            )
            data = json.loads(next(l for l in out.splitlines() if l.startswith("BENCH "))[6:])
            results[label].append(data["rewrite_s"])
            cpu[label].append(data["cpu_s"])
            rss[label] = max(rss.get(label, 0), data["rss_peak"])
            rss["after_imports"] = data["rss_imports"]
            return dst

        for _rep in range(args.repeat):
            cache.unlink(missing_ok=True)
            out_dir = rewrite("cold", "1", str(cache))  # hashes every source shard
            rewrite("warm", "1", str(cache))  # a second cut: source hashes from the cache
            rewrite("nohash", "0", "off")
            kept_bytes = _dir_bytes(out_dir)
            cp_dst = work / "cp_of_kept"
            fresh(cp_dst)
            c = _children_cpu()
            t = time.perf_counter()
            subprocess.run(["cp", "-r", str(out_dir), str(cp_dst)], check=True)
            results["cp"].append(time.perf_counter() - t)
            cpu["cp"].append(_children_cpu() - c)
            fresh(cp_dst)
            if args.no_cli:
                continue
            cli_dst = work / "dst_cli"
            fresh(cli_dst)
            _, err, wall = _run(
                [
                    sys.executable,
                    "-c",
                    CLI,
                    "prune",
                    str(src),
                    "--plan",
                    str(plan_file),
                    "--out",
                    str(cli_dst),
                    "-q",
                ],
                env_cache,
            )
            results["cli"].append(wall)
            hwm = int(next(l for l in err.splitlines() if l.startswith("BENCH-HWM ")).split()[1])
            rss["cli"] = max(rss.get("cli", 0), hwm)
            fresh(cli_dst)

        results = {k: v for k, v in results.items() if v}
        best = {k: min(v) for k, v in results.items()}
        gbps = {k: kept_bytes / v / GiB for k, v in best.items()}
        print(
            f"kept bytes written: {kept_bytes / GiB:.3f} GiB ({kept_bytes / src_bytes:.1%} of the source)"
        )
        print(
            f"{'step':38s} {'best s':>8s} {'GiB/s':>7s} {'vs cp':>7s} {'CPU s':>7s} "
            f"{'per-rep vs cp min/median':>25s}"
        )
        rows = [
            ("cp -r of the pruned output", "cp"),
            ("rewrite, sha256 src+out (cold)", "cold"),
            ("rewrite, src sha256 cached (warm)", "warm"),
            ("rewrite, --no-hash-source", "nohash"),
            ("reap prune CLI end to end (warm)", "cli"),
        ]
        paired: dict[str, list[float]] = {
            k: sorted(c / r for c, r in zip(results["cp"], results[k], strict=True))
            for k in results
        }
        for title, k in rows:
            if k not in results:
                continue
            c = f"{min(cpu[k]):7.2f}" if k in cpu else f"{'':7s}"
            p = paired[k]
            print(
                f"{title:38s} {best[k]:8.2f} {gbps[k]:7.2f} {gbps[k] / gbps['cp']:6.2f}x {c} "
                f"{p[0]:11.2f}x / {p[len(p) // 2]:.2f}x"
            )
        limit = largest + 256 * MiB
        worst = max(rss[k] for k in ("cold", "warm", "nohash", "cli") if k in rss)
        print(
            f"peak RSS: rewrite process {rss['cold'] / MiB:.0f} MiB (cold), {rss['warm'] / MiB:.0f} (warm), "
            f"{rss['nohash'] / MiB:.0f} (no-hash), CLI {rss.get('cli', 0) / MiB:.0f}; "
            f"RSS after imports {rss['after_imports'] / MiB:.0f} MiB"
        )
        print(
            f"largest shard + 256 MiB = {limit / MiB:.0f} MiB -> {'OK' if worst < limit else 'OVER'} "
            f"(worst {worst / MiB:.0f} MiB)"
        )
        for k in ("cold", "warm", "nohash"):
            ok = gbps[k] >= 0.8 * gbps["cp"]
            print(
                f"throughput target (>= 0.8x cp), {k}: {'OK' if ok else 'MISSED'} ({gbps[k] / gbps['cp']:.2f}x)"
            )
        print(
            "BENCH-RESULT "
            + json.dumps(
                {
                    "source_bytes": src_bytes,
                    "kept_bytes": kept_bytes,
                    "largest_shard": largest,
                    "shards": n_shards,
                    "best_s": best,
                    "gib_per_s": gbps,
                    "peak_rss": rss,
                    "runs": results,
                    "cpu_s": cpu,
                    "paired_ratio": paired,
                    "cpus": os.cpu_count(),
                }
            )
        )
    finally:
        if not args.keep_files and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
