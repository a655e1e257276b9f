"""How a ``REAPPruningModifier`` prepares and tidies up calibration: the recipe's other
modifiers, compressed experts kept packed or the model decompressed (and made computable
for each post-cut stage), the sequential trace checked to reach every MoE
block, the resumable calibration checkpoint opened, and ``moe_calibrate_all_experts``
restored.

``CalibrationSetup`` is a mixin of the modifier: its methods read the recipe's fields and
the modifier's state (``_arch``, ``_observer``, ``_progress``, ``_cpu_group``,
``_packed``, ``_checkpoint``, ``_traced_model``, ``_restore_calibrate_all``) and call its
``_other_modifiers`` and ``_fingerprint``.
"""

from __future__ import annotations

import weakref

import torch
from loguru import logger

from . import registries
from .calibration import distributed
from .calibration.checkpointing import CalibrationCheckpoint, calibration_identity
from .calibration.decompress_hook import decompress_loaded_model
from .calibration.packed import PackedCompute, check_module_formats, compressed_modules
from .calibration.routed_only import set_calibrate_all_experts
from .models.refusals import check_traced

__all__ = ["POST_CUT_IDENTITY", "CalibrationSetup"]

#: the recipe fields a resumed post-cut step must share with the run that wrote its results
POST_CUT_IDENTITY = (
    "sparsity",
    "num_experts_to_keep",
    "divisible_by",
    "saliency",
    "selection",
    "selection_candidates",
    "selection_drops",
    "selection_groups",
    "calibrate_router",
    "calibrate_bias",
    "compensate",
    "router_fit_tokens",
    "router_fit_steps",
    "router_fit_lr",
    "compensation_steps",
    "compensation_lr",
    "validate_fit",
)


class CalibrationSetup:
    """Prepare the weights and the calibration, and tidy up after it (a mixin of
    ``REAPPruningModifier``)."""

    def _check_trace_of(self, model: torch.nn.Module) -> None:
        """Refuse, after the sequential pipeline traces ``model`` and before its first
        calibration batch, a trace whose subgraphs never call some MoE block."""
        self._traced_model = weakref.ref(model)
        registries.add_traced_subgraphs_listener(self._on_traced)

    def _on_traced(
        self, model: torch.nn.Module, subgraphs: list[set[int]] | None, error: Exception | None
    ) -> None:
        ref = self._traced_model
        if ref is None or ref() is not model:  # another oneshot's model
            return
        check_traced(model, self._arch, subgraphs, error)
        if self._progress is not None and subgraphs:
            self._progress.total = len(subgraphs)

    def _open_checkpoint(self, model: torch.nn.Module) -> None:
        """``checkpoint_dir``: refuse another model, recipe or world size now; the
        sequential pipeline reports to it (resume and saves: calibration/checkpointing.py)."""
        others = self._other_modifiers()
        if others:
            raise ValueError(
                f"checkpoint_dir resumes REAP's statistics only, but the recipe also runs "
                f"{', '.join(others)}; run REAP in a recipe of its own or remove checkpoint_dir"
            )
        fields = ("ignore", "calibration_source", "dequantize")
        if self.fits_after_cut:  # the post-cut step resumes too: its results are the cut's
            fields += POST_CUT_IDENTITY
        recipe = {k: getattr(self, k) for k in fields}
        identity = calibration_identity(
            model, self._arch, self._fingerprint(), recipe, distributed.world_size()
        )
        self._checkpoint = CalibrationCheckpoint(
            self.checkpoint_dir, identity, self._observer.accumulators, self._cpu_group
        )
        if self._post_cut is not None:  # the post-cut step resumes with the calibration
            self._checkpoint.on_restore.append(self._post_cut.restored)
        registries.set_sequential_checkpoint(model, self._checkpoint)

    def _prepare_weights(self, model: torch.nn.Module) -> None:
        """Compressed-tensors experts: keep them packed (calibration dequantizes one
        MoE layer or expert at a time) or decompress the whole model (``dequantize:
        model``, or another modifier in the recipe), before any pruning or calibration.

        :raises PackedFormatError: a compressed module's format has no decompressor
        """
        packed = compressed_modules(model)
        if not packed:
            return
        check_module_formats(packed)  # a format nothing can compute: refuse now
        others = self._other_modifiers()
        if self.dequantize == "model" or others:
            why = f"the recipe also runs {', '.join(others)}" if others else "dequantize: model"
            logger.info(f"REAP: decompressing the whole model before calibration ({why})")
            decompress_loaded_model(model)
            return
        if not (self.calibrates or self.fits_after_cut):
            logger.info("REAP: pruning without calibration: compressed experts stay packed")
            return
        self._packed = PackedCompute(model, self.dequantize)
        self._packed.attach()

    def _other_modifiers(self) -> list[str]:
        from llmcompressor.core import active_session

        recipe = active_session().lifecycle.recipe
        return [
            type(m).__name__
            for m in (recipe.modifiers if recipe is not None else [])
            if not isinstance(m, type(self))
        ]

    def _packed_overlay(self, model: torch.nn.Module) -> PackedCompute | None:
        """Packed experts made computable for one post-cut stage (``None``: not packed)."""
        if not compressed_modules(model):
            return None
        packed = PackedCompute(model, "expert" if self.dequantize == "expert" else "layer")
        packed.attach()
        return packed

    def _other_calibrating_modifiers(self) -> list[str]:
        """Other modifiers of this calibration that need data (the independent
        pipeline, oneshot's default, calibrates each modifier on its own)."""
        from llmcompressor.core import active_session

        recipe = active_session().lifecycle.recipe
        return [
            type(m).__name__
            for m in (recipe.modifiers if recipe is not None else [])
            if m is not self and getattr(m, "requires_calibration_data", False)
        ]

    def _restore_calibrate_all_flag(self) -> None:
        if self._restore_calibrate_all is not None:
            set_calibrate_all_experts(self._restore_calibrate_all)
            self._restore_calibrate_all = None

    def _release_packed(self) -> None:
        if self._packed is not None:
            self._packed.detach()


def sample_positions(loader, group) -> dict:
    """Where this rank's calibration samples stand in the order one process calibrates in:
    ``{"position": local index -> position, "samples": all ranks' samples, "batch_size"}``
    (the post-cut step keys its captured rows by position, so data parallel fits what one
    process fits). One process: the identity. Every rank given the same dataset (split by
    :class:`~reap_modifier.compat.RankShareSampler`): rank ``r`` of ``W`` holds positions
    ``r, r + W, ...``. Each rank its own dataset: rank-major, as one process over the
    datasets concatenated in rank order (one process orders samples of unequal length
    longest first, so there the fit is that of the concatenation, not of one process over
    the union). Collective under data parallel."""
    from .compat import RankShareSampler

    batch_size = getattr(loader, "batch_size", None) or 1
    sampler = getattr(loader, "sampler", None)
    try:
        local = len(sampler) if sampler is not None else len(loader) * batch_size
    except TypeError:
        return {"position": None, "samples": None, "batch_size": batch_size}
    if group is None:
        return {"position": None, "samples": local, "batch_size": batch_size}
    if isinstance(sampler, RankShareSampler):
        world, rank = sampler.world_size, sampler.rank
        return {
            "position": lambda i: i * world + rank,
            "samples": sampler.num_selected,
            "batch_size": batch_size,
        }
    import torch.distributed as dist

    counts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(counts, local, group=group)
    offset = sum(counts[: dist.get_rank(group)])
    return {"position": lambda i: offset + i, "samples": sum(counts), "batch_size": batch_size}
