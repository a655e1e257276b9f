"""The main job as a short list of named stages; each stage lives in its own module and returns
a record (see the package docstring for the whole story):

0. :mod:`.inputs` -- corpora, tokenizer, calibration sets, held-out windows, prompts;
1. :mod:`.calibrate` -- REAP through ``oneshot`` once per corpus part, the rankings merged;
2. :mod:`.prune` (and :mod:`.fit_routers`) -- one verified checkpoint per method of
   :data:`~.config.METHODS`;
3. :mod:`.quality` -- held-out quality and greedy generations of every model;
4. :mod:`.comparison` -- the flip table and the tiers;
5. :mod:`.results` -- ``results.json``; :mod:`.report` -- ``report.md``; :mod:`.report_plots` --
   the plots."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from .calibrate import calibrate_parts
from .comparison import compare_and_tiers
from .config import QUICK, DemoConfig, choose_threads
from .inputs import load_inputs
from .prune import prune_and_verify
from .quality import evaluate_quality, generate_texts, load_models
from .report import render_report
from .report_plots import write_plots
from .results import assemble_results
from .workspace import Clock, checkpoint_source, log_line, prepare_out_dir


def run(cfg: DemoConfig, log: Callable[[str], None] = log_line, command: str | None = None) -> dict:
    """Run the whole job; returns the results dict (also written to ``out/results.json``).
    ``command`` is recorded as the command line that produced the report."""
    import torch

    from . import data as D

    clock = Clock()
    if cfg.quick:
        cfg = DemoConfig(**{**asdict(cfg), **QUICK})
    threads, why = choose_threads(cfg.threads)
    cfg = replace(cfg, threads=threads)
    log(why)
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    model_dir = Path(cfg.model)
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"model not found: {model_dir} has no config.json (pass --model PATH)")
    out = Path(cfg.out)
    prepare_out_dir(out)
    data_dir = Path(cfg.data_dir) if cfg.data_dir else D.default_data_dir()

    with clock.stage("corpora", log):
        inputs = load_inputs(cfg, model_dir, data_dir, log)
    with clock.stage("calibrate", log):
        calib = calibrate_parts(cfg, model_dir, inputs, out / "scores", log)
    src_dir, left_out = checkpoint_source(model_dir, out, log)
    (out / "pruned").mkdir(parents=True, exist_ok=True)
    with clock.stage("prune + verify", log):
        pruning = prune_and_verify(cfg, src_dir, left_out, out, calib, inputs)
    with clock.stage("evaluate", log):
        models = load_models(cfg, model_dir, out / "pruned", list(pruning.records))
        quality = evaluate_quality(cfg, models, inputs.windows)
    with clock.stage("generate", log):
        generations = generate_texts(cfg, models, inputs)
        del models
    with clock.stage("compare + tiers", log):
        comparison = compare_and_tiers(cfg, out, calib)

    results = assemble_results(
        cfg, command, model_dir, data_dir, out, inputs, calib, pruning, quality, generations,
        comparison, clock,
    )  # fmt: skip
    write_plots(results, out)
    (out / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    (out / "report.md").write_text(render_report(results))
    log(
        f"wrote {out / 'report.md'} and {out / 'results.json'} ({results['timing']['total']:.0f} s)"
    )
    return results
