"""reap-modifier: REAP expert pruning for MoE LLMs as an llm-compressor modifier.

Importing this package registers :class:`REAPPruningModifier` with llm-compressor's
``ModifierFactory`` so a YAML recipe naming ``REAPPruningModifier`` gets this one.
"""

from .plan import PruningPlan, compute_keep_count
from .scores import ExpertScores

__version__ = "0.1.0"

__all__ = ["ExpertScores", "PruningPlan", "REAPPruningModifier", "compute_keep_count"]

try:  # the modifier pulls in llm-compressor; kept importable while it is written
    from .modifier import REAPPruningModifier  # noqa: F401
except ModuleNotFoundError as _exc:  # pragma: no cover - transitional
    if _exc.name != f"{__name__}.modifier":
        raise
