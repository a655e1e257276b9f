"""reap-modifier: REAP expert pruning for MoE LLMs as an llm-compressor modifier.

Importing this package registers :class:`REAPPruningModifier` with llm-compressor's
``ModifierFactory``, so a YAML recipe naming ``REAPPruningModifier`` gets this one.
The registration happens as soon as llm-compressor is importable in the process:
immediately if it is already imported, otherwise right after it is first imported.
That keeps ``import reap_modifier`` (and the ``reap`` CLI, which never needs
llm-compressor for scores, plans or checkpoint surgery) fast. The public names are
imported on first use (PEP 562), so importing the package imports no torch.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

from .lazy_names import lazy_names

__version__ = "0.1.0"

__all__ = [
    "ExpertScores",
    "PruningPlan",
    "REAPPruningModifier",
    "__version__",
    "compute_keep_count",
    "plan_from_scores",
]


#: public name -> the module that defines it, imported on first use
_LAZY = {
    "ExpertScores": "scores.scores_file",
    "PruningPlan": "scores.plan",
    "REAPPruningModifier": "modifier",
    "compute_keep_count": "scores.keep_count",
    "plan_from_scores": "scores.plan",
}


__getattr__, __dir__ = lazy_names(__name__, _LAZY, __all__)


class _RegisterAfterLLMCompressor(importlib.abc.MetaPathFinder):
    """Imports :mod:`reap_modifier.modifier` (which registers the class) right after
    the ``llmcompressor`` package finishes importing."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "llmcompressor":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module):
            original_exec(module)
            importlib.import_module(f"{__name__}.modifier")

        loader.exec_module = exec_module
        return spec


if "llmcompressor" in sys.modules:
    importlib.import_module(f"{__name__}.modifier")
elif not any(isinstance(f, _RegisterAfterLLMCompressor) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterLLMCompressor())
