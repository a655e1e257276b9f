"""The main job: does the calibration corpus change what REAP prunes, and what does that
do to quality -- measured end to end on the bundled MXFP4 Kimi-K3-architecture model.

    python -m reap_modifier.demo [--model PATH] [--out out/demo] [--quick]

1. **Calibrate** REAP with ``oneshot`` + :class:`~reap_modifier.modifier.REAPPruningModifier`,
   once per corpus (English part 1, English part 2, Chinese, code; every run reloads the model from
   its directory and keeps only the scores file), then merge the files: ``A`` = en1, ``B`` = en1+en2
   (REAP(en)), ``C`` = B+zh, ``D`` = C+code (REAP(en+zh+code)).
2. **Prune** to 50% with REAP(en), REAP(en+zh), REAP(en+zh+code), frequency (from D), router_l1,
   router_signed_sum, random, and REAP(en) / REAP(en+zh+code) with their routers fitted after the
   cut -- every method also to 75% (where the seed's build collapsed in Chinese), the REAP mixes
   and random also to 25%: each plan by :func:`~reap_modifier.scores.plan.plan_from_scores`,
   each checkpoint by :func:`~reap_modifier.checkpoint.rewrite_checkpoint` (kept MXFP4 bytes copied
   verbatim) and checked by :func:`~reap_modifier.checkpoint.verify.verify_checkpoint` against the source.
   The methods are the rows of :data:`~reap_modifier.demo.config.METHODS`; adding one is adding a
   row (the :mod:`~reap_modifier.demo.config` docstring says how).
3. **Evaluate** the unpruned model, every pruned checkpoint and (for scale) the unpruned model with
   every routed expert's output zeroed on held-out English / Chinese / code windows
   (:mod:`reap_modifier.evaluation`): NLL / perplexity, top-1 agreement and KL to the unpruned model,
   longest repeat run in greedy generations.
4. **Flip table** of rankings A, B, C, D at 50% (and 25% / 75%)
   (:func:`~reap_modifier.analysis.compare.compare_rankings`).
5. **Write** ``report.md`` (rendered from ``results.json`` only), ``results.json``, PNG plots, the
   score files, plans and pruned checkpoints (with manifests) under ``--out``.

``--quick`` shrinks every size (for the smoke test); the numbers it gives mean nothing.
"""

from .config import DemoConfig
from .job import run
from .report import render_report, summary_tables
from .workspace import OUT_MARKER, checkpoint_source, prepare_out_dir

__all__ = [
    "OUT_MARKER",
    "DemoConfig",
    "checkpoint_source",
    "prepare_out_dir",
    "render_report",
    "run",
    "summary_tables",
]
