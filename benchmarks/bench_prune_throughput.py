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

Targets: rewrite >= 0.8x cp throughput; peak RSS < largest shard + 256 MiB.
Every step starts after ``sync`` so that no step pays for the previous one's dirty
pages.  Everything runs from the page cache when RAM allows (both cp and prune).

    python benchmarks/bench_prune_throughput.py [--gib 2] [--shard-mib 512]
        [--sparsity 0.5] [--repeat 2] [--workdir DIR] [--keep-files]
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
t2 = time.perf_counter()
rewrite_checkpoint(src, plan, dst, progress=False, hash_source=hash_source == "1",
                   hash_cache=False if cache == "off" else cache)
t3 = time.perf_counter()
print("BENCH " + json.dumps({"import_s": t1 - t0, "rewrite_s": t3 - t2, "rss_imports": rss_imports,
                             "rss_peak": status("VmHWM")}))
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

        def fresh(path: Path):
            shutil.rmtree(path, ignore_errors=True)
            os.sync()

        results: dict[str, list] = {"cp": [], "cold": [], "warm": [], "nohash": [], "cli": []}
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
            t = time.perf_counter()
            subprocess.run(["cp", "-r", str(out_dir), str(cp_dst)], check=True)
            results["cp"].append(time.perf_counter() - t)
            fresh(cp_dst)
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

        best = {k: min(v) for k, v in results.items()}
        gbps = {k: kept_bytes / v / GiB for k, v in best.items()}
        print(
            f"kept bytes written: {kept_bytes / GiB:.3f} GiB ({kept_bytes / src_bytes:.1%} of the source)"
        )
        print(f"{'step':38s} {'best s':>8s} {'GiB/s':>7s} {'vs cp':>7s}")
        rows = [
            ("cp -r of the pruned output", "cp"),
            ("rewrite, sha256 src+out (cold)", "cold"),
            ("rewrite, src sha256 cached (warm)", "warm"),
            ("rewrite, --no-hash-source", "nohash"),
            ("reap prune CLI end to end (warm)", "cli"),
        ]
        for title, k in rows:
            print(f"{title:38s} {best[k]:8.2f} {gbps[k]:7.2f} {gbps[k] / gbps['cp']:6.2f}x")
        limit = largest + 256 * MiB
        worst = max(rss[k] for k in ("cold", "warm", "nohash", "cli"))
        print(
            f"peak RSS: rewrite process {rss['cold'] / MiB:.0f} MiB (cold), {rss['warm'] / MiB:.0f} (warm), "
            f"{rss['nohash'] / MiB:.0f} (no-hash), CLI {rss['cli'] / MiB:.0f}; "
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
                    "cpus": os.cpu_count(),
                }
            )
        )
    finally:
        if not args.keep_files and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
