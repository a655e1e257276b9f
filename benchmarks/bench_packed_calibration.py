"""Peak memory of REAP calibration on a packed MXFP4 checkpoint vs the decompress-everything path.

Writes a synthetic Kimi-K3-shaped MXFP4 checkpoint (random E2M1 codes + E8M0 scales,
routed experts packed, everything else bf16; ``tests/helpers/k3_mxfp4_synth.py``), then runs
``oneshot(model=<path>, recipe=[REAPPruningModifier(dequantize=...)])`` on a few
thousand random tokens in a fresh process per mode and prints, side by side: the
packed checkpoint size, the dense size it would need, one MoE layer's experts dense,
and per mode the peak RSS of the process (``getrusage``; loading and calibration,
interpreter included), the RSS after imports, and the wall time. Modes:

- ``layer`` (default of the modifier): one MoE layer's experts dense at a time;
- ``expert``: one expert projection dense at a time;
- ``model``: the old path (``oneshot`` loads with ``dequantize=True``).

Every run is watched and stopped when its RSS passes a budget (``--budget-gib``, default
12, and never more than the memory available minus 3 GiB): a path that does not fit
is reported with the RSS it had reached, instead of taking the machine down.

Target: peak RSS of ``layer`` <= packed checkpoint + one dense MoE layer + 1 GiB.
Then a K3-scale extrapolation (labelled as such) of memory per rank for 8 ranks.

    python benchmarks/bench_packed_calibration.py --size medium  # minutes: 0.37 GiB packed
    python benchmarks/bench_packed_calibration.py                # 1.3 GB packed, 4.8 GB dense
    python benchmarks/bench_packed_calibration.py --size large   # 4.3 GB packed, 16.3 GB dense
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
import paths  # noqa: E402,F401  (tests/helpers and tests/oracles by name)

sys.path.insert(0, str(ROOT / "src"))

GIB = 1024**3

SIZES = {
    # seconds, for trying the script: 2 MoE layers x 64 experts of 3 x 256 x 256
    "smoke": dict(hidden=256, latent=256, inter=256, experts=64, moe_layers=2, top_k=4, vocab=512),
    # minutes: 6 MoE layers x 128 experts of 3 x 512 x 512, top-4: 323 MiB packed, one MoE
    # layer's experts dense 192 MiB
    "medium": dict(
        hidden=1024, latent=512, inter=512, experts=128, moe_layers=6, top_k=4, vocab=4096
    ),
    # 8 MoE layers x 384 experts of 3 x 512 x 512, top-4: 1.28 GB packed experts, 4.8 GB dense
    "default": dict(
        hidden=1024, latent=512, inter=512, experts=384, moe_layers=8, top_k=4, vocab=4096
    ),
    # 27 MoE layers: 4.3 GB packed experts, 16.3 GB dense
    "large": dict(
        hidden=1024, latent=512, inter=512, experts=384, moe_layers=27, top_k=4, vocab=4096
    ),
}

#: checkpoint sizes quoted for the real model: (packed bytes, routed experts per layer)
K3_CHECKPOINTS = {"K3, 896 experts": (1.6e12, 896), "K3-REAP, 448 experts": (837e9, 448)}
#: dense bf16 bytes per packed MXFP4 byte (2 bytes per value vs 1/2 + 1/32)
DENSE_PER_PACKED = 64 / 17


def _word_tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", pad_token="t0")


def child(args) -> None:
    """One calibration in this process; prints a JSON line with its measurements."""
    import resource

    import psutil
    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from llmcompressor import oneshot

    import reap_modifier  # noqa: F401  (registers the modifier, patches oneshot's loader)
    from reap_modifier.modifier import REAPPruningModifier

    gen = torch.Generator().manual_seed(0)
    n = max(1, args.tokens // args.seq)
    ids = torch.randint(3, args.vocab, (n, args.seq), generator=gen).tolist()
    dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * args.seq] * n})
    tokenizer = _word_tokenizer(args.vocab)
    process = psutil.Process()
    rss_imports = process.memory_info().rss
    # RSS sampled every 10 ms, split at the modifier's initialize (model loaded)
    phase = {"name": "load", "loaded_at": None, "rss_loaded": None}
    peaks = {"load": rss_imports, "calibrate": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            rss = process.memory_info().rss
            peaks[phase["name"]] = max(peaks[phase["name"]], rss)
            stop.wait(0.01)

    original_init = REAPPruningModifier.on_initialize

    def on_initialize(self, state, **kwargs):
        phase.update(
            name="calibrate", loaded_at=time.perf_counter(), rss_loaded=process.memory_info().rss
        )
        return original_init(self, state, **kwargs)

    REAPPruningModifier.on_initialize = on_initialize
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    modifier = REAPPruningModifier(sparsity=0.5, dequantize=args.child)
    t = time.perf_counter()
    oneshot(
        model=args.path,
        recipe=[modifier],
        processor=tokenizer,
        dataset=dataset,
        num_calibration_samples=n,
        batch_size=args.batch_size,
        moe_calibrate_all_experts=False,
    )
    seconds = time.perf_counter() - t
    stop.set()
    sampler.join()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    peak = usage.ru_maxrss * 1024
    stats = modifier.packed.stats if modifier.packed is not None else None
    print(
        "RESULT "
        + json.dumps(
            {
                "mode": args.child,
                "peak_rss": peak,
                "rss_imports": rss_imports,
                "seconds": seconds,
                "cpu_seconds": usage.ru_utime + usage.ru_stime,
                "load_seconds": phase["loaded_at"] - t,
                "rss_loaded": phase["rss_loaded"],
                "peak_load": peaks["load"],
                "peak_calibrate": peaks["calibrate"],
                "tokens": n * args.seq,
                "dequantizations": stats.dequantized_modules if stats else None,
                "peak_dense_bytes": stats.peak_dense_bytes if stats else None,
            }
        ),
        flush=True,
    )


def run_mode(mode: str, path: Path, args, budget: int) -> dict:
    """Run one mode in a fresh process, watching its RSS: a run that goes over ``budget``
    bytes is stopped (so a dense model that does not fit cannot take the machine down) and
    reported as ``{"over_budget": rss, "seconds": ...}``."""
    import psutil

    cmd = [
        sys.executable,
        __file__,
        "--child",
        mode,
        "--path",
        str(path),
        "--tokens",
        str(args.tokens),
        "--seq",
        str(args.seq),
        "--vocab",
        str(args.vocab),
        "--threads",
        str(args.threads),
        "--batch-size",
        str(args.batch_size),
    ]
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(args.threads),
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join(
            [
                str(ROOT / "src"),
                str(ROOT / "tests" / "helpers"),
                str(ROOT / "tests" / "oracles"),
                os.environ.get("PYTHONPATH", ""),
            ]
        ),
    )
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
        watched, peak = psutil.Process(proc.pid), 0
        while proc.poll() is None:
            try:
                peak = max(peak, watched.memory_info().rss)
            except psutil.NoSuchProcess:
                break
            if peak > budget:
                proc.kill()
                proc.wait()
                return {"mode": mode, "over_budget": peak, "seconds": time.perf_counter() - t}
            time.sleep(0.02)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"{mode} run failed (rc={proc.returncode}):\n{stderr[-4000:]}")
    return json.loads(line[len("RESULT ") :])


def gib(x: float) -> str:
    return f"{x / GIB:7.2f}"


def k3_extrapolation(ranks: int) -> list[str]:
    """Memory of packed calibration on the real checkpoint: an extrapolation, not a measurement.

    Per MoE layer: packed bytes = checkpoint / MoE layers (an upper bound: the
    non-expert bytes are counted too), dense = packed x 64/17. Per rank (sequential
    pipeline, one decoder layer onloaded): the layer's packed bytes + what is dense at
    once + attention (bf16) + activations of one 32k-token sample and the observer's
    buffer (``benchmarks/k3_scale.py``'s assumed shape).
    """
    from k3_scale import ASSUMED_K3, memory_per_rank

    c = ASSUMED_K3
    moe_layers = c["num_hidden_layers"] - c["first_k_dense_replace"]
    per = memory_per_rank(c, seq=32768)
    other = (
        c["attention_params_per_layer"] * 2 / GIB
        + per["activations (one sample)"]
        + per["observer expert-output buffer"]
    )
    lines = [
        f"K3-scale EXTRAPOLATION (not measured): {ranks} ranks x one 32k-token sample, {moe_layers} MoE "
        "layers; per MoE layer packed = checkpoint / layers, dense = packed x 64/17. Host: "
        "compressed-tensors' distributed CPU offload keeps one copy of the packed model per node "
        "(shared memory; or disk with device_map='auto_offload'); each rank onloads one decoder layer.",
        f"{'checkpoint':22s} {'host/node':>10s} {'old path (dense)':>17s} {'per rank: layer':>16s} "
        f"{'per rank: expert':>17s}   GiB",
    ]
    for label, (packed, experts) in K3_CHECKPOINTS.items():
        layer_packed = packed / moe_layers / GIB
        layer_dense = layer_packed * DENSE_PER_PACKED
        projection = layer_dense / (3 * experts)
        lines.append(
            f"{label:22s} {packed / GIB:10.0f} {packed * DENSE_PER_PACKED / GIB:17.0f} "
            f"{layer_packed + layer_dense + other:16.1f} {layer_packed + projection + other:17.1f}"
        )
    lines.append(
        "old path: oneshot loads the checkpoint with dequantize=True, i.e. the whole dense model in "
        "host memory before calibration starts (more than any single node holds)."
    )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="default")
    p.add_argument(
        "--modes",
        nargs="+",
        default=["layer", "expert", "model"],
        choices=["layer", "expert", "model"],
    )
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--workdir", default=None, help="where the checkpoint is written (kept if given)"
    )
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument(
        "--budget-gib",
        type=float,
        default=12.0,
        help="stop any run whose RSS exceeds this (and the memory available now - 3 GiB)",
    )
    # child mode (internal)
    p.add_argument("--child", default=None)
    p.add_argument("--path", default=None)
    p.add_argument("--vocab", type=int, default=4096)
    args = p.parse_args()
    if args.child:
        return child(args)

    import psutil
    from k3_mxfp4_synth import K3Shape, write_k3_mxfp4

    shape = K3Shape(**SIZES[args.size])
    args.vocab = shape.vocab
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="bench-packed-")
    root = Path(args.workdir or tmp.name)
    path = root / f"k3-mxfp4-{args.size}"
    info_file = path / "synthetic.json"
    if info_file.is_file() and json.loads(info_file.read_text())["shape"] == asdict(shape):
        info = json.loads(info_file.read_text())
    else:
        t = time.perf_counter()
        info = write_k3_mxfp4(path, shape)
        print(f"wrote {path} in {time.perf_counter() - t:.0f} s")
    ckpt = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    dense = info["dense_checkpoint_bytes"]
    layer = info["dense_layer_expert_bytes"]
    target = ckpt + layer + GIB
    print(
        f"\nsynthetic K3-shaped MXFP4 checkpoint: {shape.moe_layers} MoE layers x {shape.experts} experts "
        f"(3 x {shape.latent} x {shape.inter}), top-{shape.top_k}; {args.tokens} tokens "
        f"({args.tokens // args.seq} x {args.seq}, batch {args.batch_size}), {args.threads} thread(s)"
    )
    print(f"  packed checkpoint on disk       {gib(ckpt)} GiB")
    print(f"  dense (bf16) it would need      {gib(dense)} GiB  ({dense / ckpt:.2f}x)")
    print(f"  one MoE layer's experts dense   {gib(layer)} GiB")
    print(f"  target for `layer`: packed + one dense layer + 1 GiB = {gib(target).strip()} GiB\n")
    rows = {}
    budget = int(min(psutil.virtual_memory().available - 3 * GIB, args.budget_gib * GIB))
    print(
        f"(each run is stopped if its RSS exceeds {gib(budget).strip()} GiB: min(available now - 3 GiB, "
        f"--budget-gib {args.budget_gib:g}))"
    )
    print(
        f"{'mode':7s} {'peak RSS':>9s} {'imports':>8s} {'loaded':>8s} {'peak load':>10s} {'peak calib':>11s} "
        f"{'vs packed':>10s} {'load s':>7s} {'wall s':>7s} {'CPU s':>7s} {'dequant':>8s}  (GiB)"
    )
    for mode in args.modes:
        r = run_mode(mode, path, args, budget)
        if "over_budget" in r:
            print(
                f"{mode:7s} STOPPED at {gib(r['over_budget']).strip()} GiB RSS after {r['seconds']:.0f} s: "
                f"does not fit in the {gib(budget).strip()} GiB budget"
                + (
                    f" (the dense model alone is {gib(dense).strip()} GiB)"
                    if mode == "model"
                    else ""
                )
            )
            continue
        rows[mode] = r
        deq = "-" if r["dequantizations"] is None else str(r["dequantizations"])
        print(
            f"{mode:7s} {gib(r['peak_rss']):>9s} {gib(r['rss_imports']):>8s} {gib(r['rss_loaded']):>8s} "
            f"{gib(r['peak_load']):>10s} {gib(r['peak_calibrate']):>11s} {r['peak_rss'] / ckpt:9.2f}x "
            f"{r['load_seconds']:7.1f} {r['seconds']:7.1f} {r['cpu_seconds']:7.1f} {deq:>8s}",
            flush=True,
        )
    if "layer" in rows:
        peak = rows["layer"]["peak_rss"]
        print(
            f"\ntarget (layer): peak RSS {gib(peak).strip()} <= packed + one dense MoE layer + 1 GiB = "
            f"{gib(target).strip()} GiB: {'MET' if peak <= target else 'MISSED'}"
        )
    if "model" in rows:
        ratio = rows["model"]["peak_rss"] / rows.get("layer", rows["model"])["peak_rss"]
        print(
            f"old path (model): peak RSS {ratio:.2f}x "
            "the packed mode's (oneshot loads with dequantize=True: everything dense before calibration)"
        )
    print()
    for line in k3_extrapolation(args.ranks):
        print(line)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
