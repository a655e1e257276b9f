"""The whole recipe at Kimi K3's counts, on this machine: every stage's wall time and peak
memory, how each grows, and what a real K3 run needs per rank (extrapolated).

The model: K3's counts with tiny widths, written as a compressed-tensors MXFP4 checkpoint
(routed experts packed, ``tests/helpers/k3_mxfp4_synth.py``): 93 decoder layers (the first
dense, 92 MoE), 896 routed experts, top-16, one shared expert, a 163,840-token vocabulary,
full (MLA) attention, hidden 32, latent (``routed_expert_hidden_size``) and expert
intermediate 32 (the smallest MXFP4 allows: its scale groups are 32 wide), a word-level
tokenizer. Calibration on random token ids.

The stages, each in its own process (its peak RSS from ``wait4``; inside ``oneshot`` the
sub-stages are timed and their RSS high-water sampled every 20 ms):

1. ``reap``: REAP alone with ``checkpoint_dir`` (the resumable calibration): the baseline
   the post-cut step's memory is compared with;
2. ``together``: the whole recipe in one ``oneshot``: REAP with ``checkpoint_dir``,
   ``selection: block_error``, ``calibrate_router``, ``calibrate_bias``, ``compensate``,
   ``validate_fit`` and the save (``output_dir``); ``--separate`` also runs the post-cut
   fields without ``checkpoint_dir`` (``post_cut``);
3. ``reap prune`` of the MXFP4 source with the whole recipe's plan;
4. ``reap verify --source`` of both outputs.

``--sweep`` then reruns the stages at three sizes of each of tokens, MoE layers, experts
and vocabulary (the others at the sweep's base), fits each stage's log-log slope, and
extrapolates to a real K3 run (labelled as such, assumptions printed).

    nice -n 10 .venv/bin/python benchmarks/k3_counts.py --parallel --out k3_counts.json  # K3's counts
    nice -n 10 .venv/bin/python benchmarks/k3_counts.py --sweep --seq 128 --out k3_sweep.json
    .venv/bin/python benchmarks/k3_counts.py --sweep --cached --seq 128 --at-counts k3_counts.json

(``--parallel``: REAP alone and the whole recipe side by side, a core each; ``--at-counts``:
the extrapolation starts from the 92-layer run, grown by the sweep's token slopes only.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
sys.path.insert(0, str(ROOT / "benchmarks"))

GIB = 1024**3

#: a real K3 run (the extrapolation's target): K3's widths, the README recipe's fit tokens
K3_TARGET = dict(
    hidden=7168,
    latent=3584,
    inter=2048,
    moe_layers=92,
    experts=896,
    top_k=16,
    vocab=163840,
    samples=1024,
    seq=2048,
    fit_tokens=4096,
)


@dataclass
class Size:
    """One run's sizes (the model's counts and widths, the calibration, the fits)."""

    moe_layers: int = 92
    experts: int = 896
    top_k: int = 16
    vocab: int = 163840
    hidden: int = 32
    latent: int = 32
    inter: int = 32
    samples: int = 16
    seq: int = 256
    fit_tokens: int = 1024
    steps: int = 5
    dense_steps: int = 5
    keep: int = 0  # 0: half the experts

    @property
    def kept(self) -> int:
        return self.keep or self.experts // 2

    @property
    def tokens(self) -> int:
        return self.samples * self.seq

    def shape(self):
        from k3_mxfp4_synth import K3Shape

        return K3Shape(
            hidden=self.hidden,
            latent=self.latent,
            inter=self.inter,
            experts=self.experts,
            top_k=self.top_k,
            moe_layers=self.moe_layers,
            dense_layers=1,
            vocab=self.vocab,
            n_group=1,
            topk_group=1,
        )

    def model_key(self) -> str:
        return (
            f"k3c-L{self.moe_layers}-E{self.experts}-k{self.top_k}-V{self.vocab}"
            f"-h{self.hidden}-l{self.latent}-i{self.inter}"
        )


# -- inside one stage's process -----------------------------------------------------------


class PhaseClock:
    """Wall time and RSS high-water per named phase of this process (a sampler thread)."""

    def __init__(self, first: str, watch: Path | None = None):
        import psutil

        #: a folder whose size is sampled every second (its high-water: ``disk_peak``)
        self.watch = watch
        self.disk_peak = 0
        self.proc = psutil.Process()
        self.stack = [first]
        self.seconds: dict[str, float] = {}
        self.peak: dict[str, int] = {}
        self.entry: dict[str, int] = {}
        self._since = time.perf_counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._enter(first)
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _enter(self, name: str) -> None:
        rss = self.proc.memory_info().rss
        self.entry.setdefault(name, rss)
        self.peak[name] = max(self.peak.get(name, 0), rss)

    def _charge(self) -> None:
        """Charge the time since the last switch to the current phase."""
        now = time.perf_counter()
        current = self.stack[-1]
        self.seconds[current] = self.seconds.get(current, 0.0) + now - self._since
        self._since = now

    def _sample(self) -> None:
        ticks = 0
        while not self._stop.wait(0.02):
            rss = self.proc.memory_info().rss
            with self._lock:
                name = self.stack[-1]
                self.peak[name] = max(self.peak.get(name, 0), rss)
            ticks += 1
            if self.watch is not None and ticks % 50 == 0 and self.watch.exists():
                self.disk_peak = max(self.disk_peak, disk_bytes(self.watch))

    def push(self, name: str) -> None:
        with self._lock:
            self._charge()
            self.stack.append(name)
            self._enter(name)

    def pop(self, then: str | None = None) -> None:
        with self._lock:
            self._charge()
            self.stack.pop()
            if then is not None:
                self.stack[-1] = then
            self._enter(self.stack[-1])

    def set(self, name: str) -> None:
        with self._lock:
            self._charge()
            self.stack[-1] = name
            self._enter(name)

    def close(self) -> dict:
        self._stop.set()
        self._thread.join()
        with self._lock:
            self._charge()
        return {
            name: {
                "seconds": round(self.seconds.get(name, 0.0), 3),
                "peak_rss_gib": round(self.peak[name] / GIB, 4),
                "rise_gib": round((self.peak[name] - self.entry[name]) / GIB, 4),
            }
            for name in self.peak
        }


def wrap(owner, attr: str, clock: PhaseClock, name, then: str | None = None) -> None:
    """Time ``owner.attr`` as phase ``name`` (a string, or a function of the call's
    arguments); on return the phase becomes ``then`` (default: the one before)."""
    original = getattr(owner, attr)

    def timed(*args, **kwargs):
        clock.push(name(*args, **kwargs) if callable(name) else name)
        try:
            return original(*args, **kwargs)
        finally:
            clock.pop(then)

    setattr(owner, attr, timed)


def instrument(clock: PhaseClock) -> None:
    """Phase marks on the modifier and the post-cut step (this process only)."""
    from reap_modifier import modifier as modifier_module
    from reap_modifier.post_cut import step, validation

    def init(original):
        def on_initialize(self, state, **kwargs):
            clock.set("calibrate")
            return original(self, state, **kwargs)

        return on_initialize

    cls = modifier_module.REAPPruningModifier
    cls.on_initialize = init(cls.on_initialize)
    wrap(step, "gather", clock, "post-cut: gather rows")
    wrap(validation.ValidationSet, "record_reference", clock, "post-cut: held-out reference")
    wrap(step, "select_layers", clock, "post-cut: block-error selection")
    wrap(step, "choose", clock, "post-cut: selection vs REAP's cut (held-out)")
    wrap(step.PostCutStep, "choose", clock, "post-cut: choose", then="cut")
    wrap(step.PostCutStep, "fit", clock, "cut", then="save")
    wrap(
        step.PostCutStep,
        "_fit_layers",
        clock,
        lambda self, component, *args, **kwargs: f"post-cut: fit {component.name}",
    )
    wrap(validation.ValidationSet, "kl", clock, "post-cut: held-out KL")


def word_tokenizer(vocab: int):
    """A word-level tokenizer over ``t0..t{vocab-1}`` (oneshot needs a processor)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", pad_token="t0")


def recipe_fields(size: Size, mode: str, work: Path) -> dict:
    """The modifier's fields for ``mode``: ``reap`` (with ``checkpoint_dir``), ``post_cut``
    (selection, router, bias, dense, validation) or ``together`` (both); ``router`` and
    ``router+validation``: REAP and the router fit, without and with the held-out check
    (``benchmarks/held_out_memory.py``)."""
    fields = dict(
        num_experts_to_keep=size.kept, scores_path=str(work / f"{mode}.scores.safetensors")
    )
    if mode in ("reap", "together"):
        fields["checkpoint_dir"] = str(work / f"{mode}.checkpoint")
    if mode in ("post_cut", "together"):
        fields.update(
            selection="block_error",
            calibrate_router=True,
            calibrate_bias=True,
            compensate=True,
            validate_fit=True,
            router_fit_tokens=size.fit_tokens,
            router_fit_steps=size.steps,
            compensation_steps=size.dense_steps,
        )
    if mode in ("router", "router+validation"):
        fields.update(
            calibrate_router=True,
            validate_fit=mode == "router+validation",
            router_fit_tokens=size.fit_tokens,
            router_fit_steps=size.steps,
        )
    return fields


def child_oneshot(args) -> None:
    """One ``oneshot`` in this process; prints ``RESULT {json}``."""
    import resource

    import torch

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    clock = PhaseClock("load", watch=work / f"{args.mode}.checkpoint")
    from datasets import Dataset
    from llmcompressor import oneshot

    import reap_modifier  # noqa: F401  (registers the modifier, patches oneshot's loader)
    from reap_modifier import REAPPruningModifier

    size = Size(**json.loads(args.size))
    instrument(clock)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, size.vocab, (size.samples, size.seq), generator=gen).tolist()
    dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * size.seq] * len(ids)})
    output_dir = work / f"{args.mode}.out" if args.mode != "reap" else None
    start = time.perf_counter()
    error = None
    try:
        modifier = REAPPruningModifier(**recipe_fields(size, args.mode, work))
        oneshot(
            model=args.model,
            recipe=[modifier],
            processor=word_tokenizer(size.vocab),
            dataset=dataset,
            num_calibration_samples=size.samples,
            moe_calibrate_all_experts=False,
            output_dir=None if output_dir is None else str(output_dir),
        )
    except Exception as exc:  # reported, with the phase it happened in
        error = f"{type(exc).__name__} in phase {clock.stack[-1]!r}: {exc}"
    seconds = time.perf_counter() - start
    phases = clock.close()
    result = {
        "mode": args.mode,
        "seconds": round(seconds, 2),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 4),
        "phases": phases,
        "checkpoint_dir_peak_bytes": clock.disk_peak,
        "error": error,
    }
    if error is None:
        plan = work / f"{args.mode}.plan.json"
        modifier.plan.save(plan)
        result["plan"] = str(plan)
        result["output_dir"] = None if output_dir is None else str(output_dir)
        result["kept_per_layer"] = sorted({len(v) for v in modifier.plan.kept.values()})
        result["layers"] = len(modifier.plan.kept)
        fit = modifier.router_fit
        if fit:
            result["components"] = [
                {k: c.get(k) for k in ("name", "kept", "kl_before", "kl_after")}
                for c in fit.get("components", [])
            ]
            result["validation"] = fit.get("validation")
            sel = fit.get("selection") or {}
            result["selection_applied"] = sel.get("applied", sel.get("chosen"))
    print("RESULT " + json.dumps(result), flush=True)


def child_cli(args) -> None:
    """``reap ARGV`` in this process (its exit status is the child's)."""
    from reap_modifier.cli import app

    sys.argv = ["reap", *args.argv]
    app()


# -- the parent: stages in processes ------------------------------------------------------


def run_child(argv: list[str], log: Path, threads: int) -> dict:
    """Run ``argv`` (this script's child modes) in a process: its wall time, peak RSS
    (``wait4``), exit status and its ``RESULT`` line, if any; output to ``log``."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, __file__, *argv], stdout=out, stderr=subprocess.STDOUT, env=env
        )
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - start
    result = {}
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
    tail = log.read_text(errors="replace").splitlines()[-15:]
    return {
        "process_seconds": round(seconds, 2),
        "process_peak_rss_gib": round(usage.ru_maxrss * 1024 / GIB, 4),
        "returncode": proc.returncode,
        **result,
        **({"log_tail": tail} if proc.returncode else {}),
    }


def disk_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (files the run removes meanwhile count as 0)."""
    total = 0
    for root, _, files in os.walk(path):  # os.walk skips folders removed under it
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


def build_model(size: Size, cache: Path) -> tuple[Path, float, dict]:
    """The synthetic MXFP4 checkpoint for ``size`` (written once per shape into ``cache``)."""
    from k3_mxfp4_synth import write_k3_mxfp4

    path = cache / size.model_key()
    info_file = path / "synthetic.json"
    if info_file.is_file():
        return path, 0.0, json.loads(info_file.read_text())
    if path.exists():
        shutil.rmtree(path)
    start = time.perf_counter()
    info = write_k3_mxfp4(path, size.shape(), shard_bytes=256 << 20)
    return path, time.perf_counter() - start, info


def run_recipe(
    size: Size,
    work: Path,
    cache: Path,
    threads: int,
    separate: bool,
    lean: bool = False,
    parallel: bool = False,
) -> dict:
    """Every stage of the recipe on one size; returns each stage's record (``lean``: the
    post-cut process and ``reap prune`` only, for the sweep; ``parallel``: the ``oneshot``
    processes side by side, each with its own ``checkpoint_dir``, for a machine with a
    core per process: each process's times are its own, its peak RSS unchanged)."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm.auto import tqdm

    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    model, build_s, info = build_model(size, cache)
    stages: dict[str, dict] = {
        "build checkpoint": {"process_seconds": round(build_s, 2), "disk_bytes": disk_bytes(model)}
    }
    base = ["--size", json.dumps(asdict(size)), "--work", str(work), "--model", str(model)]
    base += ["--threads", str(threads)]
    modes = ["together"] if lean else ["reap", "together"]
    if separate:  # the post-cut fields without checkpoint_dir, in their own run
        modes.append("post_cut")
    progress = tqdm(
        total=len(modes) + (1 if lean else 3), desc=f"k3-counts {size.model_key()} T{size.tokens}"
    )

    def oneshot_stage(mode: str) -> dict:
        if not parallel:
            progress.set_postfix_str(mode)
        record = run_child(
            ["--child", "oneshot", "--mode", mode, *base], work / f"{mode}.log", threads
        )
        progress.update()
        return record

    if parallel:
        progress.set_postfix_str(" + ".join(modes))
    with ThreadPoolExecutor(len(modes) if parallel else 1) as pool:
        stages.update(zip(modes, pool.map(oneshot_stage, modes)))
    post = stages["together"]
    if "reap" in stages:
        stages["reap"]["disk_bytes"] = stages["reap"].get("checkpoint_dir_peak_bytes", 0)
    if post.get("error") is None and post.get("returncode") == 0:
        out = Path(post["output_dir"])
        post["disk_bytes"] = disk_bytes(out)
        pruned = work / "pruned"
        cli = [
            ("reap prune", ["prune", str(model), "--plan", post["plan"], "--out", str(pruned)]),
            ("reap verify (prune)", ["verify", str(pruned), "--source", str(model)]),
            ("reap verify (oneshot save)", ["verify", str(out), "--source", str(model)]),
        ]
        for name, argv in cli[:1] if lean else cli:
            progress.set_postfix_str(name)
            stages[name] = run_child(["--child", "cli", "--", *argv], work / f"{name}.log", threads)
            progress.update()
        stages["reap prune"]["disk_bytes"] = disk_bytes(pruned)
    progress.close()
    return {"size": asdict(size), "tokens": size.tokens, "checkpoint": info, "stages": stages}


def stage_rows(run: dict) -> list[dict]:
    """One row per measured stage: the oneshot processes' phases, then the CLI stages."""
    rows = []
    for name, rec in run["stages"].items():
        phases = rec.get("phases")
        if phases:
            for phase, p in phases.items():
                rows.append(
                    {
                        "stage": f"{name}: {phase}",
                        "seconds": p["seconds"],
                        "peak_rss_gib": p["peak_rss_gib"],
                        "rise_gib": p["rise_gib"],
                    }
                )
        rows.append(
            {
                "stage": f"{name} (process)" if phases else name,
                "seconds": rec.get("process_seconds"),
                "peak_rss_gib": rec.get("process_peak_rss_gib"),
                "rise_gib": None,
                "disk_gib": round(rec["disk_bytes"] / GIB, 4) if "disk_bytes" in rec else None,
                "ok": rec.get("returncode", 0) == 0 and not rec.get("error"),
            }
        )
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| stage | wall s | peak RSS GiB | rise in stage GiB | disk GiB | ok |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:

        def f(v, spec):
            return "" if v is None else format(v, spec)

        ok = r.get("ok")
        lines.append(
            f"| {r['stage']} | {f(r['seconds'], '.1f')} | {f(r['peak_rss_gib'], '.2f')} | "
            f"{f(r['rise_gib'], '.2f')} | {f(r.get('disk_gib'), '.3f')} | "
            f"{'' if ok is None else ('yes' if ok else 'NO')} |"
        )
    return "\n".join(lines)


#: the sweep's axes: the Size fields each changes, at three sizes (the middle is the base)
AXES = {
    "layers": [dict(moe_layers=1), dict(moe_layers=2), dict(moe_layers=4)],
    "experts": [
        dict(experts=224, keep=112),
        dict(experts=448, keep=224),
        dict(experts=896, keep=448),
    ],
    "tokens": [
        dict(samples=8, fit_tokens=512),
        dict(samples=16, fit_tokens=1024),
        dict(samples=32, fit_tokens=2048),
    ],
    "vocab": [dict(vocab=40960), dict(vocab=81920), dict(vocab=163840)],
}


def axis_value(size: Size, axis: str) -> float:
    return {
        "tokens": size.tokens,
        "layers": size.moe_layers,
        "experts": size.experts,
        "vocab": size.vocab,
    }[axis]


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log y on log x (``None`` when a y is not positive)."""
    if len(xs) < 2 or any(y is None or y <= 0 for y in ys):
        return None
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / den


def sweep(
    base: Size,
    work: Path,
    cache: Path,
    threads: int,
    axes: list[str],
    cached: bool = False,
    at_counts: Path | None = None,
) -> dict:
    """Every stage at three sizes of each of ``axes`` (the base in the middle); the slopes
    (an axis not swept gets no slope, and the extrapolation does not grow with it).
    ``at_counts``: a report of the run at K3's counts (``--out`` without ``--sweep``); the
    extrapolation then starts from its measured stages, grown by the tokens' slopes only
    (its layers, experts and vocabulary are K3's already)."""
    runs: dict[str, dict] = {}
    points: dict[str, list[tuple[str, Size]]] = {}
    middle = {k: v for changes in AXES.values() for k, v in changes[1].items()}
    centre = replace(base, **middle)
    for axis, changes in AXES.items():
        if axis not in axes:
            continue
        points[axis] = []
        for change in changes:
            size = replace(centre, **change)
            key = json.dumps(asdict(size), sort_keys=True)
            done = work / "runs" / f"{size.model_key()}-T{size.tokens}-F{size.fit_tokens}.json"
            if key in runs:
                pass
            elif done.is_file():  # a rerun of the sweep reuses the sizes it measured
                runs[key] = json.loads(done.read_text())
            elif cached:  # --cached: the sizes measured so far, no new run
                continue
            else:
                runs[key] = run_recipe(
                    size, work / f"sweep-{len(runs)}", cache, threads, False, lean=True
                )
                runs[key]["rows"] = stage_rows(runs[key])
                done.parent.mkdir(parents=True, exist_ok=True)
                done.write_text(json.dumps(runs[key], indent=2))
            points[axis].append((key, size))
    centre_key = json.dumps(asdict(centre), sort_keys=True)
    stages = [r["stage"] for r in runs[centre_key]["rows"]]
    fits = {}
    for stage in stages:
        fits[stage] = {}
        for axis, pts in points.items():
            if len(pts) < 2:
                continue
            xs = [axis_value(size, axis) for _, size in pts]
            for metric in ("seconds", "peak_rss_gib", "disk_gib"):
                ys = [
                    next((r.get(metric) for r in runs[k]["rows"] if r["stage"] == stage), None)
                    for k, _ in pts
                ]
                fits[stage].setdefault(metric, {})[axis] = {
                    "x": xs,
                    "y": ys,
                    "slope": slope(xs, ys),
                }
    rows = runs[centre_key]["rows"]
    print(
        f"\n## Growth per stage (log-log slopes; base {centre.model_key()}, {centre.samples} x {centre.seq} tokens)\n"
    )
    print(growth_table(rows, fits))
    if at_counts is not None:
        measured = json.loads(Path(at_counts).read_text())
        centre = Size(**measured["run"]["size"])
        rows = [
            r
            for r in measured["rows"]
            if r["stage"] in fits or r["stage"].startswith("reap verify")
        ]
        print(f"\nThe extrapolation starts from the run at K3's counts: {at_counts}")
    extra = extrapolate(centre, rows, fits)
    print(extrapolation_text(extra))
    return {
        "base": asdict(centre),
        "runs": list(runs.values()),
        "fits": fits,
        "extrapolation": extra,
    }


def growth_table(rows: list[dict], fits: dict) -> str:
    lines = [
        "| stage | base s | " + " | ".join(f"s ~ {a}^" for a in AXES) + " | base peak GiB |",
        "|---|---:|" + "---:|" * len(AXES) + "---:|",
    ]
    for r in rows:
        sl = fits[r["stage"]].get("seconds", {})
        cells = [
            "" if a not in sl or sl[a]["slope"] is None else f"{sl[a]['slope']:.2f}" for a in AXES
        ]
        lines.append(
            f"| {r['stage']} | {r['seconds'] or 0:.1f} | "
            + " | ".join(cells)
            + f" | {r['peak_rss_gib'] or 0:.2f} |"
        )
    return "\n".join(lines)


#: assumptions of the extrapolation (printed with it)
GPU_TFLOPS = 400.0  # bf16, ~40% of an H100's dense peak
DISK_GBS = 1.0  # read or write, and sha256, per rank
HELD_OUT = 1 / 8  # the share of calibration batches the held-out check holds
ASSUMED_KL_FORWARDS = 6  # held-out forwards: reference, 2 plans, cut, after each component
FIT_TOKEN_STAGES = ("gather rows", "block-error selection", "fit router", "fit bias", "fit dense")


def k3_flops(target: dict, rows_bias_over_router: float) -> dict[str, float]:
    """FLOPs of each compute stage at K3's widths (an estimate, see the printed assumptions)."""
    from k3_scale import ASSUMED_K3, active_params

    per_token = active_params(ASSUMED_K3)  # the whole model, per token
    latent, inter, hidden = target["latent"], target["inter"], target["hidden"]
    block = (
        target["experts"] * hidden
        + target["top_k"] * 3 * latent * inter
        + 3 * hidden * inter
        + 2 * hidden * latent
    )
    tokens, fit = target["samples"] * target["seq"], target["fit_tokens"]
    layers = target["moe_layers"]
    fit_pass = 3 * 2 * block * fit * layers  # forward + backward through the block, all layers
    router = 100 * fit_pass  # router_fit_steps default
    return {
        "calibrate": 2 * 2 * per_token * tokens,  # calibration pass + propagation pass
        "held-out reference": 2 * per_token * tokens * HELD_OUT,
        "held-out KL": ASSUMED_KL_FORWARDS * 2 * per_token * tokens * HELD_OUT,
        "fit router": router,
        "fit bias": router * rows_bias_over_router,
        "fit dense": 200 * fit_pass,  # compensation_steps default
    }


def k3_bytes(target: dict) -> dict[str, float]:
    """Checkpoint bytes at K3's widths: the MXFP4 source, the pruned output, the
    calibration checkpoint's hidden states per layer (bf16, all ranks together)."""
    from k3_scale import ASSUMED_K3

    expert = 3 * target["latent"] * target["inter"] * 17 / 32
    other = (
        ASSUMED_K3["attention_params_per_layer"] * 93 * 2
        + 2 * target["vocab"] * target["hidden"] * 2
    )
    source = target["moe_layers"] * target["experts"] * expert + other
    pruned = target["moe_layers"] * (target["experts"] // 2) * expert + other
    hidden_states = target["samples"] * target["seq"] * target["hidden"] * 2
    return {"source": source, "pruned": pruned, "hidden_states_per_layer": hidden_states}


def stage_kind(stage: str) -> str | None:
    for key in (
        "calibrate",
        "held-out reference",
        "held-out KL",
        "fit router",
        "fit bias",
        "fit dense",
    ):
        if stage.endswith(key):
            return key
    return None


def extrapolate(centre: Size, rows: list[dict], fits: dict, ranks: int = 8) -> dict:
    """Each stage's time at a real K3 run (EXTRAPOLATED): the count-driven time measured
    at tiny widths, grown by its fitted slopes to K3's counts and tokens, plus the time of
    its FLOPs at K3's widths on a GPU; disk-bound stages by bytes. Memory and disk per rank
    from the tensors each stage holds."""
    t = K3_TARGET
    seconds = {r["stage"]: r["seconds"] for r in rows}
    bias_over_router = 1.0
    router = next((s for k, s in seconds.items() if k.endswith("fit router")), None)
    bias = next((s for k, s in seconds.items() if k.endswith("fit bias")), None)
    if router and bias:
        bias_over_router = bias / router
    flops = k3_flops(t, bias_over_router)
    nbytes = k3_bytes(t)
    target_axis = {
        "layers": t["moe_layers"],
        "experts": t["experts"],
        "vocab": t["vocab"],
    }
    out = []
    for r in rows:
        stage, base = r["stage"], r["seconds"]
        if base is None or stage.endswith("(process)") or stage == "build checkpoint":
            continue
        grow = 1.0
        slopes = fits.get(stage, {}).get("seconds", {})
        for axis in slopes:
            sl = slopes[axis]["slope"]
            sl = min(max(sl or 0.0, 0.0), 2.0)
            if axis == "tokens":
                fit_bound = any(k in stage for k in FIT_TOKEN_STAGES)
                ratio = (
                    t["fit_tokens"] / centre.fit_tokens
                    if fit_bound
                    else (t["samples"] * t["seq"] / centre.tokens)
                )
            else:
                ratio = target_axis[axis] / axis_value(centre, axis)
            grow *= ratio**sl
        kind = stage_kind(stage)
        gpu = flops[kind] / (GPU_TFLOPS * 1e12) if kind else 0.0
        io = 0.0
        if stage == "reap prune":
            io = (nbytes["source"] + nbytes["pruned"]) / (DISK_GBS * 1e9)
        elif stage.startswith("reap verify"):
            io = (nbytes["source"] + 2 * nbytes["pruned"]) / (DISK_GBS * 1e9)
        elif stage.endswith(": save"):
            io = 2 * nbytes["pruned"] / (DISK_GBS * 1e9)
        elif stage.endswith(": load"):
            io = nbytes["source"] / (DISK_GBS * 1e9)
        # calibration splits the samples; the post-cut step the layers (layer i on rank
        # i mod W) and the held-out samples; loading, the save and the CLI do not split
        calib = not stage.endswith((": load", ": save")) and ": " in stage
        out.append(
            {
                "stage": stage,
                "measured_s": base,
                "counts_s": base * grow,
                "gpu_compute_s": gpu,
                "io_s": io,
                "per_rank_gpu_s": (gpu + io) / (ranks if calib else 1),
                "per_rank_counts_s": base * grow / (ranks if calib else 1),
                "split_over_ranks": calib,
            }
        )
    hidden, fit = t["hidden"], t["fit_tokens"]
    held = t["samples"] * t["seq"] * HELD_OUT
    memory = {
        "calibration, one layer onloaded (benchmarks/k3_scale.py model, seq 2048)": None,
        "post-cut rows, one layer (bf16 in + out)": 2 * fit * hidden * 2,
        "post-cut rows, all 92 layers (on disk with checkpoint_dir)": 2
        * fit
        * hidden
        * 2
        * t["moe_layers"],
        "held-out reference, all ranks (LM-head inputs, bf16)": held * hidden * 2,
        "held-out KL, logits (16 MiB blocks, a handful alive)": 6 * 16 * 2**20,
        "selection, one layer's kept-expert contributions (fit tokens x top-k x latent, f32)": fit
        * t["top_k"]
        * t["latent"]
        * 4,
    }
    try:
        from k3_scale import ASSUMED_K3, memory_per_rank

        memory[next(iter(memory))] = sum(memory_per_rank(ASSUMED_K3, t["seq"]).values()) * GIB
    except Exception:  # the model is optional context
        memory.pop(next(iter(memory)))
    disk = {
        "MXFP4 source (read by every stage that loads it)": nbytes["source"],
        "pruned output (reap prune or the post-cut save)": nbytes["pruned"],
        "checkpoint_dir, one layer's inputs, per rank": nbytes["hidden_states_per_layer"] / ranks,
        "checkpoint_dir, post-cut rows of all layers (bf16), all ranks": 2
        * t["fit_tokens"]
        * t["hidden"]
        * 2
        * t["moe_layers"],
    }
    return {
        "ranks": ranks,
        "target": t,
        "assumptions": {
            "gpu_tflops": GPU_TFLOPS,
            "disk_gbs": DISK_GBS,
            "held_out_share": HELD_OUT,
            "held_out_forwards": ASSUMED_KL_FORWARDS,
            "slopes clamped to [0, 2]": True,
            "router_fit_steps / compensation_steps": "100 / 200 (defaults)",
        },
        "stages": out,
        "memory_bytes": memory,
        "disk_bytes": disk,
        "flops": flops,
    }


def extrapolation_text(extra: dict) -> str:
    t = extra["target"]
    lines = [
        f"\n## EXTRAPOLATION to a real K3 run (not measured): hidden {t['hidden']}, latent "
        f"{t['latent']}, expert intermediate {t['inter']}, {t['moe_layers']} MoE layers x "
        f"{t['experts']} experts, top-{t['top_k']}, vocab {t['vocab']}, "
        f"{t['samples']} x {t['seq']} calibration tokens, router_fit_tokens {t['fit_tokens']}, "
        f"{extra['ranks']} ranks\n",
        "counts term: the time measured here at tiny widths (per-expert and per-token "
        "overhead, one CPU thread), grown by the fitted slopes to K3's counts and tokens; "
        "GPU term: the stage's FLOPs at K3's widths at the assumed GPU rate, plus its bytes "
        "at the assumed disk rate. Calibration (by samples) and the post-cut step (by layers "
        "and held-out samples) are split over the ranks; loading, the save, prune and verify "
        "are not.\n",
        "| stage | measured s (tiny) | counts term, CPU h/rank | GPU FLOPs s | disk s "
        "| GPU + disk h/rank |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for s in extra["stages"]:
        lines.append(
            f"| {s['stage']} | {s['measured_s']:.1f} | {s['per_rank_counts_s'] / 3600:.3g} | "
            f"{s['gpu_compute_s']:.3g} | {s['io_s']:.3g} | {s['per_rank_gpu_s'] / 3600:.3g} |"
        )
    lines.append(
        "\nmemory (GiB): "
        + "; ".join(f"{k}: {v / GIB:.2f}" for k, v in extra["memory_bytes"].items())
    )
    lines.append(
        "disk (GB): " + "; ".join(f"{k}: {v / 1e9:.1f}" for k, v in extra["disk_bytes"].items())
    )
    lines.append("assumptions: " + json.dumps(extra["assumptions"]))
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    d = Size()
    for field, value in asdict(d).items():
        p.add_argument("--" + field.replace("_", "-"), type=int, default=value)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--work", default="/tmp/reap-k3-counts", help="scratch folder (removed per run)")
    p.add_argument("--cache", default=None, help="synthetic checkpoints (default: WORK/models)")
    p.add_argument("--out", default=None, help="JSON file of every measurement")
    p.add_argument(
        "--separate", action="store_true", help="also the post-cut fields without checkpoint_dir"
    )
    p.add_argument(
        "--parallel",
        action="store_true",
        help="the oneshot processes side by side (one core each)",
    )
    p.add_argument(
        "--sweep", action="store_true", help="three sizes per axis, slopes, extrapolation"
    )
    p.add_argument("--axes", default=",".join(AXES), help="the sweep's axes (default: all four)")
    p.add_argument(
        "--cached", action="store_true", help="the sweep from the sizes already measured only"
    )
    p.add_argument(
        "--at-counts",
        default=None,
        help="with --sweep: extrapolate from this report of the run at K3's counts",
    )
    p.add_argument("--child", choices=["oneshot", "cli"], help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--size", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("argv", nargs="*", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child == "oneshot":
        return child_oneshot(args)
    if args.child == "cli":
        return child_cli(args)
    size = Size(**{f: getattr(args, f) for f in asdict(Size())})
    work = Path(args.work)
    cache = Path(args.cache) if args.cache else work / "models"
    cache.mkdir(parents=True, exist_ok=True)
    report: dict = {"argv": sys.argv[1:], "threads": args.threads}
    if args.sweep:
        report.update(
            sweep(
                size, work, cache, args.threads, args.axes.split(","), args.cached, args.at_counts
            )
        )
    else:
        run = run_recipe(
            size, work / "run", cache, args.threads, args.separate, parallel=args.parallel
        )
        report["run"] = run
        report["rows"] = stage_rows(run)
        print(f"\n## The whole recipe at {size.model_key()}, {size.samples} x {size.seq} tokens\n")
        print(markdown_table(report["rows"]))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
