"""``python -m reap_modifier.demo``: the main job's command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .config import DEFAULT_MODEL, DEFAULT_OUT, DemoConfig
from .job import run
from .report import summary_tables
from .workspace import quiet_libraries


def _package_doc() -> str:
    from . import __doc__ as doc

    return doc


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the job (or print ``--tables``); returns the exit code.
    (Long because it is the argument parser's option list written out.)"""
    ap = argparse.ArgumentParser(
        prog="python -m reap_modifier.demo", description=_package_doc().split("\n\n")[0]
    )
    ap.add_argument(
        "--model",
        default=str(DEFAULT_MODEL),
        help="MXFP4 MoE checkpoint directory (with tokenizer)",
    )
    ap.add_argument(
        "--out", default=str(DEFAULT_OUT), help="output folder (its demo files are replaced)"
    )
    ap.add_argument(
        "--data-dir",
        default=None,
        help="corpora folder (default: the repository's data/, built if missing)",
    )
    ap.add_argument(
        "--quick", action="store_true", help="tiny sizes (smoke test); the numbers mean nothing"
    )
    ap.add_argument("--sparsity", type=float, default=DemoConfig.sparsity)
    ap.add_argument(
        "--extra-sparsities",
        type=float,
        nargs="*",
        default=list(DemoConfig.extra_sparsities),
        help="also prune to these sparsities (at 0.25 REAP(en), REAP(en+zh), REAP(en+zh+code) and "
        "random; at any other every method); none given: only --sparsity",
    )
    ap.add_argument(
        "--tokens-per-part",
        type=int,
        default=DemoConfig.tokens_per_part,
        help="calibration tokens of each part (en1, en2, zh, code)",
    )
    ap.add_argument(
        "--eval-windows", type=int, default=DemoConfig.eval_windows, help="per language"
    )
    ap.add_argument(
        "--split",
        choices=("eval", "dev"),
        default=DemoConfig.split,
        help="windows the quality tables measure: eval (the evaluation windows the final tables"
        " report) or dev (the development split's, disjoint from them: for choosing methods and"
        " settings)",
    )
    ap.add_argument("--gen-tokens", type=int, default=DemoConfig.gen_tokens)
    ap.add_argument("--prompts", type=int, default=DemoConfig.prompts_per_lang, help="per language")
    ap.add_argument("--seed", type=int, default=DemoConfig.seed)
    ap.add_argument(
        "--threads",
        type=int,
        default=DemoConfig.threads,
        help="CPU threads (default 0: every core on an idle machine, 1 when other jobs load it)",
    )
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=DemoConfig.dtype,
        help="compute dtype (weights are exact in float32; bf16 is slow on CPUs without AVX-512 BF16)",
    )
    ap.add_argument("--verbose", action="store_true", help="keep library logging")
    ap.add_argument(
        "--tables",
        metavar="RESULTS_JSON",
        default=None,
        help="only print the summary tables of an earlier run's results.json (for the README)",
    )
    a = ap.parse_args(argv)
    if a.tables:
        print(summary_tables(json.loads(Path(a.tables).read_text())), end="")
        return 0
    if not a.verbose:
        quiet_libraries()
    cfg = DemoConfig(
        model=a.model,
        out=a.out,
        data_dir=a.data_dir,
        sparsity=a.sparsity,
        extra_sparsities=tuple(a.extra_sparsities),
        tokens_per_part=a.tokens_per_part,
        eval_windows=a.eval_windows,
        split=a.split,
        gen_tokens=a.gen_tokens,
        prompts_per_lang=a.prompts,
        seed=a.seed,
        threads=a.threads,
        dtype=a.dtype,
        quick=a.quick,
    )
    run(
        cfg,
        command="python -m reap_modifier.demo"
        + "".join(f" {x}" for x in (argv if argv is not None else sys.argv[1:])),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
