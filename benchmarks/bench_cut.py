"""Benchmark ``reap cut`` on a Kimi-K3-sized scores file (92 MoE layers x 896 experts).

Writes a synthetic calibration scores file (float64 sums and counts, two sources),
then times, over ``--repeat`` runs (median):

- the library call: ``ExpertScores.load`` + ``plan_from_scores`` (keep 448,
  divisible_by 8) + ``PruningPlan.save``, and each step alone;
- the CLI: ``reap cut S --keep 448 --divisible-by 8 -o plan.json`` as a fresh process
  (wall clock, so it includes Python start-up and importing the package), and the
  bare ``import reap_modifier.cli`` for comparison.

Usage: ``python benchmarks/bench_cut.py [--repeat 5] [--no-cli] [--tmp DIR]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from reap_modifier.scores import ExpertScores
from reap_modifier.scores.plan import PruningPlan, plan_from_scores

LAYERS, EXPERTS = 92, 896


def make_scores(path: Path, seed: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)
    names = [f"language_model.model.layers.{i + 1}.block_sparse_moe" for i in range(LAYERS)]
    s = ExpertScores.empty(
        names,
        EXPERTS,
        {
            "model_class": "KimiK3ForConditionalGeneration",
            "top_k": 16,
            "n_group": 1,
            "topk_group": 1,
            "num_moe_layers": LAYERS,
            "tokens": {"en": 1_420_000, "zh": 500_000},
        },
    )
    for st in s.layers.values():
        en = torch.poisson(torch.full((EXPERTS,), 25_000.0), generator=g).double()
        zh = torch.poisson(torch.full((EXPERTS,), 9_000.0), generator=g).double()
        st["count"], st["count@en"], st["count@zh"] = en + zh, en, zh
        st["sum_weight"] = st["count"] * 0.1
        st["sum_norm"] = st["count"] * 1.5
        st["sum_reap"] = (
            st["sum_norm"]
            * 0.1
            * torch.exp(0.8 * torch.randn(EXPERTS, generator=g, dtype=torch.float64))
        )
        st["max_norm"] = torch.full((EXPERTS,), 5.0, dtype=torch.float64)
    return s.save(path)


def _median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-cli", action="store_true", help="skip the subprocess timings")
    ap.add_argument("--tmp", type=Path, default=None)
    args = ap.parse_args()

    tmp = Path(args.tmp or tempfile.mkdtemp(prefix="bench_cut_"))
    tmp.mkdir(parents=True, exist_ok=True)
    scores_path = make_scores(tmp / "k3_92x896.scores")
    plan_path = tmp / "plan.json"
    size_mb = scores_path.stat().st_size / 1e6

    loaded = ExpertScores.load(scores_path)
    plan = plan_from_scores(loaded, num_experts_to_keep=448, divisible_by=8)
    t_load = _median_ms(lambda: ExpertScores.load(scores_path), args.repeat)
    t_plan = _median_ms(
        lambda: plan_from_scores(loaded, num_experts_to_keep=448, divisible_by=8), args.repeat
    )
    t_save = _median_ms(lambda: plan.save(plan_path), args.repeat)

    def library_cut():
        s = ExpertScores.load(scores_path)
        plan_from_scores(s, num_experts_to_keep=448, divisible_by=8).save(plan_path)

    t_lib = _median_ms(library_cut, args.repeat)
    assert PruningPlan.load(plan_path).num_kept == 448

    print(
        f"scores file: {LAYERS} layers x {EXPERTS} experts, {size_mb:.1f} MB, torch threads "
        f"{torch.get_num_threads()}, {os.cpu_count()} CPUs"
    )
    print(f"library  load {t_load:7.1f} ms | cut {t_plan:7.1f} ms | save plan {t_save:7.1f} ms")
    print(f"library  reap cut (load + cut + save), median of {args.repeat}: {t_lib:.1f} ms")

    if not args.no_cli:
        reap = shutil.which("reap") or str(Path(sys.executable).with_name("reap"))
        cmd = [
            reap,
            "cut",
            str(scores_path),
            "--keep",
            "448",
            "--divisible-by",
            "8",
            "-o",
            str(plan_path),
        ]

        def cli():
            subprocess.run(cmd, check=True, capture_output=True)

        def bare_import():
            subprocess.run(
                [sys.executable, "-c", "import reap_modifier.cli"], check=True, capture_output=True
            )

        cli_repeat = max(1, min(args.repeat, 3))
        t_cli = _median_ms(cli, cli_repeat)
        t_imp = _median_ms(bare_import, cli_repeat)
        print(
            f"cli      `reap cut` process wall clock, median of {cli_repeat}: {t_cli:.0f} ms "
            f"(of which `import reap_modifier.cli`: {t_imp:.0f} ms; the cut itself is the "
            f"library figure)"
        )
    print(
        f"README: reap cut, 92 x 896 scores file, keep 448 / divisible_by 8: {t_lib:.0f} ms "
        "(library: load + cut + save)"
    )
    if args.tmp is None:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
