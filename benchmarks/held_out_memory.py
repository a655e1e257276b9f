"""What the held-out check costs in memory at K3's vocabulary: REAP + ``calibrate_router``
on a Kimi-K3-class MXFP4 checkpoint (``benchmarks/k3_counts.py``'s model: 896 routed
experts, top-16, a 163,840-token vocabulary, tiny widths) with ``validate_fit: false`` and
``true``, each in its own process, side by side in one run: each process's peak RSS
(``wait4``), the RSS rise of the held-out phases, and the difference (the target: at most
0.3 GiB on 64 x 512 calibration tokens). Before the held-out check kept the LM head's
input, it kept float32 log-probabilities of every held-out token: 4,096 x 163,840 x 4 B =
2.5 GiB here, 172 GB at a K3 calibration of 1,024 x 2,048 tokens.

    PYTHONPATH=src python benchmarks/held_out_memory.py --out held_out_memory.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from k3_counts import GIB, Size, build_model, run_child  # noqa: E402

MODES = ("router", "router+validation")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--moe-layers", type=int, default=3)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=163840)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--work", default="/tmp/reap-held-out-memory")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    size = Size(moe_layers=args.moe_layers, samples=args.samples, seq=args.seq, vocab=args.vocab)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model, _, _ = build_model(size, work / "models")
    base = ["--size", json.dumps(asdict(size)), "--work", str(work), "--model", str(model)]
    base += ["--threads", str(args.threads)]
    runs = {
        mode: run_child(
            ["--child", "oneshot", "--mode", mode, *base], work / f"{mode}.log", args.threads
        )
        for mode in MODES
    }
    validation = runs["router+validation"].get("validation") or {}
    print(
        f"\n## The held-out check's memory: {size.model_key()}, {size.samples} x {size.seq} "
        f"tokens ({validation.get('batches')} batches, {validation.get('tokens')} tokens held out)\n"
    )
    print("| validate_fit | process peak RSS GiB | wall s | ok |")
    print("|---|---:|---:|---|")
    for mode, r in runs.items():
        ok = r.get("returncode") == 0 and not r.get("error")
        print(
            f"| {str(mode == 'router+validation').lower()} | {r['process_peak_rss_gib']:.2f} "
            f"| {r['process_seconds']:.1f} | {'yes' if ok else 'NO'} |"
        )
    on, off = (runs[m]["process_peak_rss_gib"] for m in reversed(MODES))
    print(f"\npeak RSS added by the held-out check: {on - off:+.3f} GiB")
    for ph, rec in sorted(runs["router+validation"].get("phases", {}).items()):
        if "held-out" in ph:
            print(f"  {ph}: rise {rec['rise_gib']:.3f} GiB, {rec['seconds']:.1f} s")
    full = validation.get("tokens", 0) * size.vocab * 4
    print(f"full-vocabulary log-probabilities of the held-out tokens would be {full / GIB:.2f} GiB")
    if args.out:
        Path(args.out).write_text(
            json.dumps({"size": asdict(size), "runs": runs, "added_gib": on - off}, indent=2)
        )


if __name__ == "__main__":
    main()
