"""What a ``REAPPruningModifier`` writes and how the pruned model is saved: the report
(``report_path``, upstream's format), the manifest (``manifest_path``), the plan's
parameters, and the save path (a bit-exact rewrite of a compressed source when only
REAP ran, else the regular save with its fixups).

``ModifierOutputs`` is a mixin of the modifier: its methods read the recipe's fields and
the modifier's state (``_arch``, ``_plan``, ``_scores``, ``_router_fit``,
``_fitted_tensors``) and call its ``_other_modifiers``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import registries
from .checkpoint.compressed_save import compressed_source, route_save_through_rewriter
from .checkpoint.manifest import build_manifest
from .fileio import sha256_file, write_json_atomic
from .scores.plan import PruningPlan

__all__ = ["ModifierOutputs"]


class ModifierOutputs:
    """Write the report and manifest, choose the save path (a mixin of
    ``REAPPruningModifier``)."""

    def _make_output_dirs(self) -> None:
        for path in (self.report_path, self.scores_path, self.manifest_path):
            if path is not None:
                Path(path).parent.mkdir(parents=True, exist_ok=True)

    def _plan_params(self) -> dict:
        return {
            "calibration_source": self.calibration_source if self.calibrates else None,
            "scores_in": self.scores_in,
            "seed": self.seed if self.saliency == "random" else None,
            "tokens": self._scores.metadata.get("tokens") if self._scores else None,
            "propagate_pruned": self.propagate_pruned,
        }

    def _write_outputs(self, plan: PruningPlan) -> None:
        if self.report_path is not None:
            write_json_atomic(self.report_path, plan.kept)
        if self.manifest_path is not None:
            scores_file = self.scores_in or self.scores_path
            scores_ref = None
            if scores_file is not None and Path(scores_file).is_file():
                scores_ref = {"path": str(scores_file), "sha256": sha256_file(scores_file)}
            source = "plan " + str(self.plan_in) if self.plan_in else f"saliency {plan.saliency}"
            manifest = build_manifest(
                plan,
                method=f"REAP modifier, in-memory surgery ({source})",
                model_class=self._arch.model_class,
                count_key=self._arch.count_keys[0],
                scores=scores_ref,
                extra={"router_fit": self._router_fit} if self._router_fit else None,
            )
            write_json_atomic(self.manifest_path, manifest)

    def _choose_save_path(self, model: torch.nn.Module) -> None:
        """Bit-exact rewrite of a compressed source when only REAP ran, else the
        regular save (with linearized experts repacked so every family reloads)."""
        source = compressed_source(model)
        if source is not None and self._plan is not None:
            others = self._other_modifiers()
            fit = (self._router_fit, self._fitted_tensors) if self._router_fit else None
            if route_save_through_rewriter(
                model, self._plan, source, other_modifiers=others, router_fit=fit
            ):
                return
        registries.run_save_fixups(model)  # e.g. linearized experts repacked (compat)
