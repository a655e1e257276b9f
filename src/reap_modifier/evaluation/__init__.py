"""Evaluation: what a cut cost, measured on the user's own checkpoints and texts.

One implementation, used by ``reap eval`` and by the main job (:mod:`reap_modifier.demo`):

- :mod:`.texts`: text files -> paragraphs; seeded windows of token ids; held-out prompts;
- :mod:`.metrics`: NLL, paired differences with standard error, top-1 agreement, KL (exact,
  and the top-N estimate with its bound), the degeneration check (longest repeat run);
- :mod:`.hf`: the transformers backend (exact, streaming: never holds all logits);
- :mod:`.vllm`: the vLLM backend (each model served in turn, prompt log-probs, throughput);
- :mod:`.cache`: the reference cache (one reference run for many candidates);
- :mod:`.checkpoints`: checkpoints and tokenizers checked before any model loads;
- :mod:`.choices`: the backends and dtypes an evaluation accepts (no torch);
- :mod:`.run`: one evaluation, end to end (:func:`prepare`, :func:`evaluate`);
- :mod:`.report`: ``eval.json`` / ``eval.md`` / ``eval.png`` and the main table;
- :mod:`.lm_eval`: standard benchmarks through lm-evaluation-harness (optional extra ``eval``).

The names are imported on first use (PEP 562): importing the package imports no torch.
"""

from __future__ import annotations

from ..lazy_names import lazy_names

#: public name -> the module that defines it, imported on first use
_LAZY = {
    "evaluate": "run",
    "evaluate_models": "hf",
    "greedy_generate": "hf",
    "longest_repeat_run": "metrics",
    "paired_difference": "metrics",
    "prepare": "run",
    "repetition_stats": "metrics",
    "run_models": "hf",
    "token_metrics": "metrics",
    "topn_kl": "metrics",
    "zero_routed_experts": "hf",
    "EvalInputError": "run",
    "Prepared": "run",
    "ReferenceTopN": "hf",
    "Settings": "run",
    "WindowMetrics": "metrics",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_names(__name__, _LAZY, __all__)
