"""``pruning_manifest.json``: what was pruned, how, and from which bytes."""

from __future__ import annotations

import platform
from datetime import UTC, datetime
from importlib import metadata as importlib_metadata

from ..fileio import sha256_file, write_json_atomic
from ..scores.plan import PruningPlan

__all__ = [
    "MANIFEST_FORMAT",
    "MANIFEST_NAME",
    "build_manifest",
    "sha256_file",
    "tool_versions",
    "write_json_atomic",
]

MANIFEST_FORMAT = "reap-pruning-manifest"
MANIFEST_NAME = "pruning_manifest.json"


def tool_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for dist in (
        "reap-modifier",
        "torch",
        "transformers",
        "llmcompressor",
        "compressed-tensors",
        "safetensors",
    ):
        try:
            versions[dist] = importlib_metadata.version(dist)
        except importlib_metadata.PackageNotFoundError:
            versions[dist] = "not installed"
    return versions


def build_manifest(
    plan: PruningPlan,
    *,
    method: str,
    model_class: str | None = None,
    count_key: str | None = None,
    source: dict | None = None,
    scores: dict | None = None,
    extra: dict | None = None,
) -> dict:
    """Assemble the manifest dict.

    :param plan: the plan that was applied
    :param method: e.g. ``"REAP (in-memory surgery)"`` or ``"REAP (checkpoint rewrite)"``
    :param source: ``{"path": ..., "shards": {file: sha256}}`` for checkpoint rewrites
    :param scores: ``{"path": ..., "sha256": ...}`` of the scores file, when one was used
    """
    layers = {}
    for layer, kept in plan.kept.items():
        layers[layer] = {
            "kept_original_ids": kept,
            "old_to_new": {str(old): new for new, old in enumerate(kept)},
            "retained_saliency_mass": plan.retained.get(layer),
        }
    masses = [v for v in plan.retained.values() if v is not None]
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": 1,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "method": method,
        "saliency": plan.saliency,
        "parameters": plan.params,
        "model_class": model_class,
        "count_key": count_key,
        "num_experts_before": plan.num_experts,
        "num_experts_after": plan.num_kept,
        "num_moe_layers": len(plan.kept),
        "retained_saliency_mass_mean": sum(masses) / len(masses) if masses else None,
        "ties_at_cut": plan.ties,
        "never_routed": plan.never_routed,
        "layers": layers,
        "source": source,
        "scores": scores,
        "versions": tool_versions(),
    }
    if extra:
        manifest.update(extra)
    return manifest
