"""The post-cut step on 1 rank and on 2 ranks, side by side in one run: each stage's wall time
and the 2-rank / 1-rank ratio (the target: the whole step at <= 0.6x), with the fitted tensors
asserted equal, bit for bit.

Builds a tiny random Kimi K3 (sigmoid router with a score-correction bias, a latent MoE, one
shared expert; tests/helpers/tiny_models.py) with ``--layers`` MoE layers of ``--experts``
experts, then runs the whole recipe through ``oneshot`` twice on the same ``--tokens``
calibration tokens (random ids, ``--seq`` per sample, batch size 1): once alone, once under
``torchrun --nproc-per-node 2`` (gloo, the same dataset on both ranks: llm-compressor splits
it), each process on one torch thread (``OMP_NUM_THREADS=1``). The recipe: REAP's cut to half
the experts, ``selection: block_error``, ``calibrate_router``, ``calibrate_bias``,
``compensate``, ``validate_fit``. Only the post-cut step is timed: its record's ``seconds``
(each stage's wall time on a rank; a 2-rank stage is the slower rank's; each rank's wait in
it, the time it spent exchanging results, mostly waiting for the other, shows imbalance),
beside each stage's CPU time (each rank's; its ratio takes the busier rank's), which leaves out
the time a process waited for a core: on a loaded machine that is the ratio to read (cache and
memory contention still inflate it). Prints the table, then asserts that on both ranks every
component's fitted tensors (kept or not), every tensor of the final model, the kept experts
and each component's decision and held-out KL equal the single process's (``torch.equal``,
``==``).

Bit for bit needs MKL's conditional numerical reproducibility pinned (``MKL_CBWR=AVX2``, which
the launcher sets for both runs unless it is set): otherwise MKL rounds a float32 matrix
product by its operands' memory alignment, so the calibration forward of the same sample
differs in the last bit between processes (seen here: the rows of the second MoE layer on),
and the post-cut step's inputs with it. Given equal rows, the step is equal on any number of
ranks.

    PYTHONPATH=src python benchmarks/post_cut_ranks.py          # the default size: the measurement
    PYTHONPATH=src python benchmarks/post_cut_ranks.py --quick  # a smoke run: it runs, it matches

The ratio means something only on 2 otherwise idle cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
import paths  # noqa: E402,F401  (tests/helpers and tests/oracles by name)
from launch import launch  # noqa: E402

#: the record's stages, in the order the step runs them (``total``: all of it, the cut too)
STAGES = {
    "gather": "gather rows",
    "reference": "held-out reference",
    "selection": "block-error selection",
    "selection_check": "selection vs REAP's cut (held-out KL)",
    "cut_check": "held-out KL of the cut",
    "router": "fit router",
    "router_check": "held-out KL after router",
    "bias": "fit bias",
    "bias_check": "held-out KL after bias",
    "dense": "fit dense",
    "dense_check": "held-out KL after dense",
    "total": "post-cut step (total)",
}
#: ``--quick``: finishes in under a minute
QUICK = dict(layers=4, experts=32, tokens=1024, seq=64, steps=5)


def build(args, folder: Path) -> Path:
    """The tiny Kimi K3 of ``args``, saved under ``folder``."""
    from tiny_models import build_tiny

    model, _ = build_tiny(
        "kimi_k3",
        seed=7,
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers + 1,  # the first is dense
        num_experts=args.experts,
        num_experts_per_token=args.top_k,
        vision_config=dict(text_hidden_size=args.hidden),
    )
    model.save_pretrained(folder)
    return folder


def cpu_clock() -> dict[str, float]:
    """This process's CPU time per stage of the post-cut step, filled as it runs (the step's
    own stage clock wrapped; ``total``: the whole step, as the record's)."""
    from reap_modifier import modifier
    from reap_modifier.post_cut.step import PostCutStep

    cpu: dict[str, float] = {}

    def add(stage: str, start: float) -> None:
        cpu[stage] = cpu.get(stage, 0.0) + time.process_time() - start

    timed = PostCutStep._timed

    @contextmanager
    def both(self, stage: str):
        start = time.process_time()
        try:
            with timed(self, stage):
                yield
        finally:
            add(stage, start)

    run_post_cut = modifier.REAPPruningModifier._run_post_cut

    def whole(self, model):
        start = time.process_time()
        try:
            return run_post_cut(self, model)
        finally:
            if self._router_fit is not None and "total" not in cpu:
                add("total", start)

    PostCutStep._timed = both
    modifier.REAPPruningModifier._run_post_cut = whole
    return cpu


def child(args) -> None:
    """One run of the recipe (alone, or as one torchrun rank); writes ``rank{r}.json`` and
    ``fitted_rank{r}.pt`` to ``--out``."""
    import torch.distributed as dist
    from conftest import make_dataset, make_tokenizer
    from llmcompressor import oneshot
    from tiny_models import reload_class

    from reap_modifier import REAPPruningModifier
    from reap_modifier.post_cut import ranks

    torch.set_num_threads(1)
    cpu = cpu_clock()
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = Path(args.out)
    model = reload_class("kimi_k3").from_pretrained(args.model, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    samples = [
        torch.randint(3, args.vocab, (args.seq,), generator=gen)
        for _ in range(args.tokens // args.seq)
    ]
    modifier = REAPPruningModifier(
        num_experts_to_keep=args.experts // 2,
        selection="block_error",
        calibrate_router=True,
        calibrate_bias=True,
        compensate=True,
        validate_fit=True,
        router_fit_tokens=args.tokens,
        router_fit_steps=args.steps,
        compensation_steps=args.steps,
    )
    fitted: list[dict] = []  # every component's fitted tensors, kept or not
    hold = ranks.hold_tensors

    def spy(arch, tensors):
        fitted.append(tensors)
        hold(arch, tensors)

    ranks.hold_tensors = spy
    start = time.perf_counter()
    oneshot(
        model=model,
        recipe=[modifier],
        processor=make_tokenizer(args.vocab),
        dataset=make_dataset(samples),
        num_calibration_samples=len(samples),
        shuffle_calibration_samples=False,
        moe_calibrate_all_experts=False,
    )
    record = modifier.router_fit
    result = {
        "oneshot_s": time.perf_counter() - start,
        "seconds": record["seconds"],
        "cpu": cpu,
        "kept": modifier.plan.kept,
        "selection": record["selection"]["end_to_end"].get("applied"),
        "components": [
            {k: c[k] for k in ("name", "kept", "kl_before", "kl_after")}
            for c in record["components"]
        ],
    }
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save({"fitted": fitted, "state": state}, out / f"fitted_rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run(args, ranks: int, work: Path) -> list[dict]:
    """The recipe on ``ranks`` ranks; every rank's result, its fitted tensors included."""
    out = work / f"ranks{ranks}"
    out.mkdir()
    argv = ["--child", "--out", str(out), "--model", str(work / "model")]
    argv += [f"--{k}={getattr(args, k.replace('-', '_'))}" for k in SIZE_FLAGS]
    launch(Path(__file__).resolve(), argv, ranks, work)
    results = []
    for r in range(ranks):
        res = json.loads((out / f"rank{r}.json").read_text())
        res.update(torch.load(out / f"fitted_rank{r}.pt"))
        results.append(res)
    return results


def assert_equal(single: dict, multi: list[dict]) -> int:
    """Every rank's kept experts, components (decisions and held-out KLs), fitted tensors
    (every component's, kept or not) and final model tensors are the single process's, bit
    for bit; returns the number of fitted tensors compared."""
    count = sum(len(t) for fits in single["fitted"] for t in fits.values())
    assert count, "nothing was fitted"
    for r, res in enumerate(multi):
        assert res["kept"] == single["kept"], f"rank {r}: other kept experts"
        assert res["selection"] == single["selection"], f"rank {r}: other plan applied"
        assert res["components"] == single["components"], (
            f"rank {r}: {res['components']} != {single['components']}"
        )
        pairs = [("state", res["state"], single["state"])]
        pairs += [
            (f"component {i}: {layer}", got[layer], want[layer])
            for i, (got, want) in enumerate(zip(res["fitted"], single["fitted"], strict=True))
            for layer in want
        ]
        for what, got, want in pairs:
            assert got.keys() == want.keys(), f"rank {r}, {what}: other tensors"
            for name, tensor in want.items():
                assert torch.equal(got[name], tensor), (
                    f"rank {r}, {what}: {name} differs by "
                    f"{(got[name].double() - tensor.double()).abs().max().item():.3g}"
                )
    return count


def table(single: dict, multi: list[dict]) -> list[tuple]:
    """``(stage, 1-rank s, 2-rank s, each rank's wait s, 1-rank CPU s, each rank's CPU s)``
    for every stage either run recorded (a 2-rank stage: the slower rank's wall time; a wait:
    the part of a rank's wall time spent exchanging results, waiting for the other, ``None``
    where the stage exchanges nothing)."""
    rows = []
    for key, label in STAGES.items():
        if key in single["seconds"] or any(key in m["seconds"] for m in multi):
            one = single["seconds"].get(key, 0.0)
            two = max(m["seconds"].get(key, 0.0) for m in multi)
            waits = [m["seconds"].get(f"{key}_wait") for m in multi]
            cpu_one = single["cpu"].get(key, 0.0)
            cpu_two = [m["cpu"].get(key, 0.0) for m in multi]
            rows.append((label, one, two, waits, cpu_one, cpu_two))
    return rows


SIZE_FLAGS = ("layers", "experts", "top-k", "hidden", "vocab", "tokens", "seq", "steps")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12, help="MoE layers")
    ap.add_argument("--experts", type=int, default=128, help="routed experts per layer")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=8192, help="calibration tokens in all")
    ap.add_argument("--seq", type=int, default=256, help="tokens per calibration sample")
    ap.add_argument("--steps", type=int, default=50, help="router and dense fit steps")
    ap.add_argument("--quick", action="store_true", help=f"a run of under a minute: {QUICK}")
    ap.add_argument("--json", default=None, help="write the table and the sizes there")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    sizes = {k: getattr(args, k.replace("-", "_")) for k in SIZE_FLAGS}
    print(f"post-cut step, 1 rank vs 2 ranks (one thread each): {sizes}", flush=True)
    with tempfile.TemporaryDirectory(prefix="post_cut_ranks-") as tmp:
        work = Path(tmp)
        build(args, work / "model")
        single = run(args, 1, work)[0]
        multi = run(args, 2, work)
    rows = table(single, multi)
    print(
        f"applied: {single['selection']}; components kept: "
        + ", ".join(f"{c['name']}={c['kept']}" for c in single["components"])
    )
    print(
        "\n| stage | 1-rank s | 2-rank s | ratio | 2-rank waits s (rank 0 / 1) "
        "| 1-rank CPU s | 2-rank CPU s (rank 0 / 1) | CPU ratio |"
        "\n|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    for label, one, two, waits, cpu_one, cpu_two in rows:
        ratio = f"{two / one:.2f}" if one > 0 else "-"
        cpu_ratio = f"{max(cpu_two) / cpu_one:.2f}" if cpu_one > 0 else "-"
        wait = " / ".join("-" if w is None else f"{w:.2f}" for w in waits)
        cpu = " / ".join(f"{c:.2f}" for c in cpu_two)
        print(
            f"| {label} | {one:.2f} | {two:.2f} | {ratio} | {wait} | {cpu_one:.2f} "
            f"| {cpu} | {cpu_ratio} |"
        )
    print(
        f"\noneshot per process (calibration, cut and post-cut): 1 rank "
        f"{single['oneshot_s']:.1f} s, 2 ranks {max(m['oneshot_s'] for m in multi):.1f} s"
    )
    count = assert_equal(single, multi)
    print(
        f"\nboth ranks equal the single process bit for bit: {count} fitted tensors (every "
        f"component's, kept or not), every tensor of the final model, the decisions and KLs"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"sizes": sizes, "stages": rows, "fitted_tensors": count}, indent=1)
        )


if __name__ == "__main__":
    main()
