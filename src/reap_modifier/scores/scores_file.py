"""Per-expert calibration statistics (the *scores file*).

The raw float64 sums and counts are kept (not only the means) so that files from
different corpora, machines or ranks merge by addition and can be re-cut into any
tier later, on CPU, without recalibrating.

On disk a scores file is a safetensors file with one float64 ``[num_experts]``
tensor per ``"{layer}::{stat}"`` and JSON metadata under the ``reap_scores`` key.
The format's names (:mod:`.names`) and :class:`ScoresError` (:mod:`.errors`) are
re-exported here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..fileio import atomic_path
from .errors import ScoresError
from .names import (
    BASELINE_METHODS,
    KIND_CALIBRATION,
    KIND_WEIGHTS,
    SALIENCY_FROM_STATS,
    SALIENCY_NAMES,
    SCORES_FORMAT,
    SCORES_VERSION,
    SOURCE_PREFIX,
    STAT_NAMES,
)

__all__ = [
    "BASELINE_METHODS",
    "KIND_CALIBRATION",
    "KIND_WEIGHTS",
    "SALIENCY_NAMES",
    "SCORES_FORMAT",
    "SCORES_VERSION",
    "SOURCE_PREFIX",
    "STAT_NAMES",
    "SALIENCY_FROM_STATS",
    "ExpertScores",
    "ScoresError",
    "saliency_from_stats",
]

#: statistics that can never be negative (counts, norms); checked on validation
_NON_NEGATIVE = ("count", "sum_norm", "max_norm", "router_l1", "random")


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    return torch.where(den > 0, num / den.clamp(min=1.0), torch.zeros_like(num))


def saliency_from_stats(stats: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Saliency vector (float64 ``[E]``) for criterion ``name`` from one layer's stats.

    ``reap`` = mean over routed tokens of ``g * ||f||`` (0 for never-routed experts);
    ``frequency`` = routed count; ``weighted_frequency`` = sum of gate weights;
    ``ean`` = sum of output norms; ``ean_mean`` = mean output norm; ``max_norm``.
    A baseline name (``router_l1``, ...) returns the stored statistic of that name,
    which only a *weights* scores file carries.
    """
    if name in BASELINE_METHODS:
        if name in stats:
            return stats[name].clone()
        raise ScoresError(
            f"saliency {name!r} is computed from router weights, not from calibration "
            f"statistics; create it with `reap scores from-weights CHECKPOINT --method "
            f"{name} -o FILE` (or the modifier's `saliency: {name}`) and cut that file"
        )
    if name in SALIENCY_FROM_STATS and "count" not in stats:
        have = sorted(stats)
        raise ScoresError(
            f"saliency {name!r} needs calibration statistics, but this file holds only "
            f"{have} (a calibration-free baseline); cut it with --saliency {have[0]}"
        )
    if name == "reap":
        return _safe_div(stats["sum_reap"], stats["count"])
    if name == "frequency":
        return stats["count"].clone()
    if name == "weighted_frequency":
        return stats["sum_weight"].clone()
    if name == "ean":
        return stats["sum_norm"].clone()
    if name == "ean_mean":
        return _safe_div(stats["sum_norm"], stats["count"])
    if name == "max_norm":
        return stats["max_norm"].clone()
    raise ScoresError(f"unknown saliency {name!r}; choose one of {', '.join(SALIENCY_NAMES)}")


@dataclass
class ExpertScores:
    """Statistics for every observed MoE layer plus metadata.

    :param layers: layer name -> stat name -> float64 ``[num_experts]``
    :param metadata: JSON-serialisable description (model class, num_experts,
        top_k, groups, tokens per source, versions, ...)
    """

    layers: dict[str, dict[str, torch.Tensor]]
    metadata: dict = field(default_factory=dict)

    # -- construction --------------------------------------------------------

    @classmethod
    def empty(
        cls, layer_names: Iterable[str], num_experts: int, metadata: dict | None = None
    ) -> ExpertScores:
        layers = {
            name: {stat: torch.zeros(num_experts, dtype=torch.float64) for stat in STAT_NAMES}
            for name in layer_names
        }
        meta = {"num_experts": num_experts}
        meta.update(metadata or {})
        return cls(layers=layers, metadata=meta)

    # -- accessors -------------------------------------------------------------

    @property
    def num_experts(self) -> int:
        return int(self.metadata["num_experts"])

    @property
    def layer_names(self) -> list[str]:
        return list(self.layers)

    @property
    def sources(self) -> list[str]:
        names = set()
        for stats in self.layers.values():
            names.update(k[len(SOURCE_PREFIX) :] for k in stats if k.startswith(SOURCE_PREFIX))
        return sorted(names)

    @property
    def kind(self) -> str:
        """``"calibration"`` (statistics from data) or ``"weights"`` (a baseline)."""
        return str(self.metadata.get("kind", KIND_CALIBRATION))

    @property
    def method(self) -> str | None:
        """The baseline method of a weights file (``None`` for calibration files)."""
        return self.metadata.get("method") if self.kind == KIND_WEIGHTS else None

    @property
    def default_saliency(self) -> str:
        """``"reap"`` for calibration files, the baseline method for weights files."""
        return self.method or "reap"

    def saliency(self, name: str | None = "reap") -> dict[str, torch.Tensor]:
        """Per-layer saliency vectors (float64 ``[E]``) for criterion ``name``.

        ``None`` means :attr:`default_saliency`. Calibration files give the
        statistic-derived criteria; a weights file gives its own baseline method.
        """
        name = name or self.default_saliency
        if self.kind == KIND_WEIGHTS and name != self.method:
            raise ScoresError(
                f"this scores file holds the calibration-free baseline {self.method!r} "
                f"(computed from router weights); it has no {name!r} saliency. Use "
                f"--saliency {self.method} or a calibrated scores file"
            )
        return {layer: saliency_from_stats(stats, name) for layer, stats in self.layers.items()}

    def total_tokens(self) -> int:
        """Tokens observed (per layer; every layer sees every token)."""
        return int(sum(self.metadata.get("tokens", {}).values()))

    def source_tokens(self) -> dict[str, int]:
        """Calibration tokens per source (``metadata["tokens"]``)."""
        return {str(k): int(v) for k, v in self.metadata.get("tokens", {}).items()}

    def calibration_runs(self) -> list[dict]:
        """One record per calibration run (a merged file has several): source, world
        size and, when recorded, ``ranks``: each rank's samples, tokens and padding."""
        spec = self.metadata.get("calibration")
        return [dict(s) for s in (spec if isinstance(spec, list) else [spec] if spec else [])]

    def routing_rate(self, source: str | None = None) -> dict[str, torch.Tensor]:
        """Per-token routing rate per layer: ``count@source / tokens[source]``.

        ``source=None`` uses the total ``count`` over all tokens. A token reaches
        ``top_k`` experts, so the rates of one layer sum to ``top_k``.
        """
        if self.kind == KIND_WEIGHTS:
            raise ScoresError("a weights (baseline) scores file has no routing counts")
        tokens = self.source_tokens()
        if source is None:
            n, stat = sum(tokens.values()), "count"
        else:
            if source not in tokens:
                raise ScoresError(
                    f"no tokens recorded for source {source!r} (sources: {sorted(tokens)})"
                )
            n, stat = tokens[source], SOURCE_PREFIX + source
        if n <= 0:
            raise ScoresError(f"source {source or 'all'!r} has no calibration tokens")
        out = {}
        for layer, stats in self.layers.items():
            if stat not in stats:
                raise ScoresError(f"layer {layer!r} lacks per-source counts {stat!r}")
            out[layer] = stats[stat] / float(n)
        return out

    def support(self) -> dict[str, dict[str, float]]:
        """Per-layer support: routed (token, expert) pairs per expert (median, min,
        max, mean) and how many experts were never routed."""
        out = {}
        for layer, stats in self.layers.items():
            if "count" not in stats:
                continue
            c = stats["count"]
            out[layer] = {
                "median": float(torch.quantile(c, 0.5)),  # mean of the middle two if even
                "min": float(c.min()),
                "max": float(c.max()),
                "mean": float(c.mean()),
                "never_routed": int((c == 0).sum()),
            }
        return out

    # -- validation ------------------------------------------------------------

    def validate(self) -> ExpertScores:
        """Raise :class:`ScoresError` on missing stats, wrong shapes or non-finite values."""
        if "num_experts" not in self.metadata:
            raise ScoresError("scores metadata lacks 'num_experts'")
        if not self.layers:
            raise ScoresError("scores file holds no layers")
        num_experts = self.num_experts
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ScoresError(f"metadata num_experts={num_experts!r} is not a positive integer")
        declared = self.metadata.get("num_moe_layers")
        if declared is not None and int(declared) != len(self.layers):
            raise ScoresError(
                f"scores metadata declares {declared} MoE layers but the file holds "
                f"{len(self.layers)}; a layer is missing (or extra) — the file is "
                "incomplete, recalibrate or re-merge it"
            )
        kind = self.kind
        if kind not in (KIND_CALIBRATION, KIND_WEIGHTS):
            raise ScoresError(f"unknown scores kind {kind!r}")
        if kind == KIND_WEIGHTS:
            method = self.metadata.get("method")
            if method not in BASELINE_METHODS:
                raise ScoresError(
                    f"weights scores file names method {method!r}; expected one of "
                    f"{', '.join(BASELINE_METHODS)}"
                )
            required: tuple[str, ...] = (method,)
        else:
            required = STAT_NAMES
        for layer, stats in self.layers.items():
            missing = [s for s in required if s not in stats]
            if missing:
                raise ScoresError(f"layer {layer!r} lacks statistics {missing}")
            if kind == KIND_WEIGHTS and set(stats) != {required[0]}:
                raise ScoresError(
                    f"layer {layer!r} of a {required[0]} baseline file holds extra "
                    f"statistics {sorted(set(stats) - {required[0]})}"
                )
            for stat, tensor in stats.items():
                if tensor.shape != (num_experts,):
                    raise ScoresError(
                        f"{layer}::{stat} has shape {tuple(tensor.shape)}, expected "
                        f"({num_experts},) from metadata num_experts"
                    )
                if not torch.isfinite(tensor).all():
                    bad = (~torch.isfinite(tensor)).nonzero().flatten().tolist()[:8]
                    raise ScoresError(
                        f"{layer}::{stat} holds NaN/inf values (experts {bad}); "
                        "recalibrate or drop this file"
                    )
                if (stat in _NON_NEGATIVE or stat.startswith(SOURCE_PREFIX)) and (tensor < 0).any():
                    bad = (tensor < 0).nonzero().flatten().tolist()[:8]
                    raise ScoresError(
                        f"{layer}::{stat} holds negative values (experts {bad}); counts and "
                        "norms cannot be negative: recalibrate or drop this file"
                    )
        return self

    # -- merge -------------------------------------------------------------------

    def merge(self, other: ExpertScores) -> ExpertScores:
        """Return the sum of two score sets (sums/counts add, max_norm takes the max).

        Refuses baseline (weights) files and files from different models, expert
        counts, top-k or layer sets, saying which.
        """
        for s in (self, other):
            if s.kind != KIND_CALIBRATION:
                raise ScoresError(
                    f"cannot merge a calibration-free {s.method or s.kind} baseline file: "
                    "only calibration statistics (sums and counts) add"
                )
        for key in ("num_experts", "model_class", "top_k"):
            a, b = self.metadata.get(key), other.metadata.get(key)
            if a is not None and b is not None and a != b:
                raise ScoresError(f"cannot merge scores of different models: {key} {a!r} != {b!r}")
        a_fp = self.metadata.get("model_fingerprint")
        b_fp = other.metadata.get("model_fingerprint")
        if a_fp and b_fp and a_fp != b_fp:
            raise ScoresError(
                "cannot merge scores of different models: router weight "
                f"fingerprints differ ({a_fp[:12]} != {b_fp[:12]})"
            )
        if set(self.layers) != set(other.layers):
            only_a = sorted(set(self.layers) - set(other.layers))[:4]
            only_b = sorted(set(other.layers) - set(self.layers))[:4]
            raise ScoresError(
                f"cannot merge scores with different layers (only in first: {only_a},"
                f" only in second: {only_b})"
            )
        layers = {}
        for name, stats in self.layers.items():
            o = other.layers[name]
            merged = {}
            for stat in set(stats) | set(o):
                x = stats.get(stat)
                y = o.get(stat)
                if x is None or y is None:
                    merged[stat] = (x if y is None else y).clone()
                elif stat == "max_norm":
                    merged[stat] = torch.maximum(x, y)
                else:
                    merged[stat] = x + y
            layers[name] = merged
        meta = dict(self.metadata)
        tokens = dict(self.metadata.get("tokens", {}))
        for src, n in other.metadata.get("tokens", {}).items():
            tokens[src] = tokens.get(src, 0) + n
        meta["tokens"] = tokens
        meta["runs"] = int(self.metadata.get("runs", 1)) + int(other.metadata.get("runs", 1))
        # per-run calibration specs, in merge order (a merged file has several)
        specs = []
        for part in (self.metadata, other.metadata):
            spec = part.get("calibration")
            specs.extend(spec if isinstance(spec, list) else [spec] if spec else [])
        if specs:
            meta["calibration"] = specs
        return ExpertScores(layers=layers, metadata=meta)

    # -- io ----------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically (temp file in the same folder, then rename)."""
        path = Path(path)
        tensors = {
            f"{layer}::{stat}": t.detach().to("cpu", torch.float64).contiguous()
            for layer, stats in self.layers.items()
            for stat, t in stats.items()
        }
        meta = dict(self.metadata)
        meta["format"] = SCORES_FORMAT
        meta["version"] = SCORES_VERSION
        meta["layers"] = list(self.layers)
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata={"reap_scores": json.dumps(meta)})
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> ExpertScores:
        """Read and validate a scores file; raise :class:`ScoresError` with the reason."""
        path = Path(path)
        if not path.is_file():
            raise ScoresError(f"scores file {path} does not exist")
        try:
            with safe_open(str(path), framework="pt") as f:
                raw_meta = (f.metadata() or {}).get("reap_scores")
                if raw_meta is None:
                    raise ScoresError(
                        f"{path} is a safetensors file but not a REAP scores file "
                        "(no 'reap_scores' metadata)"
                    )
                meta = json.loads(raw_meta)
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except ScoresError:
            raise
        except Exception as exc:  # truncated / corrupt header
            raise ScoresError(f"cannot read scores file {path}: {exc}") from exc
        if not isinstance(meta, dict) or not isinstance(meta.get("layers", []), list):
            raise ScoresError(
                f"{path}: the 'reap_scores' metadata is not a JSON object with a layer list"
            )
        if meta.get("format") != SCORES_FORMAT:
            raise ScoresError(f"{path}: format {meta.get('format')!r} is not {SCORES_FORMAT!r}")
        if meta.get("version") != SCORES_VERSION:
            raise ScoresError(
                f"{path}: scores version {meta.get('version')!r} is not supported "
                f"(this reap-modifier reads version {SCORES_VERSION})"
            )
        layers: dict[str, dict[str, torch.Tensor]] = {name: {} for name in meta.get("layers", [])}
        for key, tensor in tensors.items():
            layer, _, stat = key.rpartition("::")
            if layer not in layers:
                raise ScoresError(f"{path}: tensor {key!r} belongs to no listed layer")
            layers[layer][stat] = tensor.to(torch.float64)
        empty = [name for name, stats in layers.items() if not stats]
        if empty:
            raise ScoresError(f"{path}: layers listed in metadata have no tensors: {empty[:4]}")
        meta = {k: v for k, v in meta.items() if k not in ("format", "version", "layers")}
        try:
            return cls(layers=layers, metadata=meta).validate()
        except ScoresError as exc:
            raise ScoresError(f"{path}: {exc}") from exc
