"""Calibration-free expert saliencies computed from router weights alone.

These are the baselines REAP must be shown to beat. Each maps a router weight
``W`` of shape ``[E, hidden]`` (one row per routed expert) to a float64 ``[E]``:

``router_l1``
    ``W[i].abs().sum()`` — the L1 magnitude of expert ``i``'s router row, exactly
    the criterion of compressed-tensors' ``MagnitudeExpertPruner``
    (``weight.abs().sum(dim=-1)``). We upcast to float64 before summing (the
    converter sums in the checkpoint dtype), so near-ties may order differently
    from a bf16 sum; the definition is the same.
``router_signed_sum``
    ``W[i].sum()`` — the signed sum of the router row, the criterion of the
    calibration-free ``Kimi-K3-pruned50`` checkpoint (seed 002).
``random``
    Uniform ``[0, 1)`` draws, seeded: layer ``L`` uses a ``torch.Generator`` seeded
    with ``seed * 1_000_003 + L`` where ``L`` is the layer number in the module path
    (the last ``layers.<n>``; a CRC32 of the path if there is none), so the same
    seed gives the same draw for a layer whether it comes from the in-memory model
    or from a checkpoint, whatever the path prefix.

A *weights* scores file stores one of these per layer as its only statistic
(``metadata["kind"] == "weights"``, ``metadata["method"]``); ``reap cut`` and
``ExpertScores.saliency(method)`` read it like any other scores file.

Router tensors are found in safetensors checkpoints by name: ``<block>.gate.weight``
or ``<block>.router.weight``, two-dimensional, one row per routed expert. The layer
key is the MoE block path ``<block>`` (``model.layers.1.mlp``,
``language_model.model.layers.1.block_sparse_moe``), the same key calibrated
scores files use. One-dimensional tensors (``e_score_correction_bias``, router
biases) are never read.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from pathlib import Path

import torch
from safetensors import safe_open

from ..models.moe_fields import moe_fields
from ..models.tensor_names import ROUTER_WEIGHT_RE, layer_index
from .scores_file import BASELINE_METHODS, KIND_WEIGHTS, ExpertScores, ScoresError

__all__ = [
    "BASELINE_METHODS",
    "ROUTER_NAME_RE",
    "baseline_saliency",
    "baseline_scores",
    "layer_number",
    "model_fingerprint",
    "read_checkpoint_config",
    "read_router_weights",
    "router_fingerprint",
    "scores_from_weights",
]

#: a router's logits weight (:data:`reap_modifier.models.tensor_names.ROUTER_WEIGHT_RE`)
ROUTER_NAME_RE = ROUTER_WEIGHT_RE


def layer_number(layer: str) -> int:
    """The layer number in a module path (last ``layers.<n>``), else CRC32 of the path."""
    index = layer_index(layer)
    return index if index is not None else zlib.crc32(layer.encode())


def _check_router(layer: str, weight: torch.Tensor) -> torch.Tensor:
    if weight.ndim != 2:
        raise ScoresError(
            f"router weight of {layer!r} has shape {tuple(weight.shape)}; expected "
            "[num_experts, hidden]"
        )
    if not weight.dtype.is_floating_point:
        raise ScoresError(
            f"router weight of {layer!r} has dtype {weight.dtype}; router baselines "
            "need an unquantized (floating point) router"
        )
    w = weight.detach().to("cpu", torch.float64)
    if not torch.isfinite(w).all():
        raise ScoresError(f"router weight of {layer!r} holds NaN/inf values")
    return w


def baseline_saliency(
    method: str, router_weights: dict[str, torch.Tensor], seed: int = 0
) -> dict[str, torch.Tensor]:
    """Calibration-free saliency per layer (float64 ``[E]``) from router weights.

    :param method: ``router_l1``, ``router_signed_sum`` or ``random``
    :param router_weights: layer (MoE block path) -> router weight ``[E, hidden]``
    :param seed: seed of ``random`` (ignored by the others)
    """
    if method not in BASELINE_METHODS:
        raise ScoresError(
            f"unknown baseline {method!r}; choose one of {', '.join(BASELINE_METHODS)}"
        )
    if not router_weights:
        raise ScoresError("no router weights given")
    out: dict[str, torch.Tensor] = {}
    for layer, weight in router_weights.items():
        if method == "random":
            if weight.ndim != 2:
                _check_router(layer, weight)
            gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + layer_number(layer))
            out[layer] = torch.rand(weight.shape[0], generator=gen, dtype=torch.float64)
            continue
        w = _check_router(layer, weight)
        out[layer] = w.abs().sum(dim=-1) if method == "router_l1" else w.sum(dim=-1)
    return out


def router_fingerprint(router_weights: dict[str, torch.Tensor]) -> str:
    """sha256 of the router values (as float64), in layer-number order.

    Independent of the storage dtype (bf16/fp32 values are exact in float64) and of
    the module path prefix, so the in-memory model and its checkpoint agree.
    """
    h = hashlib.sha256()
    for layer in sorted(router_weights, key=lambda n: (layer_number(n), n)):
        w = router_weights[layer].detach().to("cpu", torch.float64).contiguous()
        h.update(str(tuple(w.shape)).encode())
        h.update(w.numpy().tobytes())
    return h.hexdigest()


def model_fingerprint(router_weights: dict[str, torch.Tensor]) -> str:
    """The modifier's ``model_fingerprint``: sha256 of the first MoE layer's router weight
    as float32 bytes (first = lowest layer number), so weights files and calibrated files
    of the same model can be matched."""
    first = min(router_weights, key=lambda n: (layer_number(n), n))
    weight = router_weights[first].detach().to("cpu", torch.float32).contiguous()
    return hashlib.sha256(weight.numpy().tobytes()).hexdigest()


def baseline_scores(
    method: str,
    router_weights: dict[str, torch.Tensor],
    seed: int = 0,
    metadata: dict | None = None,
) -> ExpertScores:
    """A *weights* scores file for a baseline (one statistic per layer, named ``method``)."""
    sal = baseline_saliency(method, router_weights, seed)
    sizes = {t.numel() for t in sal.values()}
    if len(sizes) != 1:
        raise ScoresError(
            f"router weights disagree on the expert count: {sorted(sizes)} rows "
            "(one checkpoint, one expert count per MoE layer)"
        )
    meta = {
        "kind": KIND_WEIGHTS,
        "method": method,
        "num_experts": sizes.pop(),
        "num_moe_layers": len(sal),
        "router_fingerprint": router_fingerprint(router_weights),
        "model_fingerprint": model_fingerprint(router_weights),
    }
    if method == "random":
        meta["seed"] = int(seed)
    meta.update(metadata or {})
    return ExpertScores(
        layers={layer: {method: v} for layer, v in sal.items()}, metadata=meta
    ).validate()


# -- reading router tensors from a checkpoint -----------------------------------------


def _checkpoint_files(checkpoint: Path) -> list[Path]:
    if checkpoint.is_file():
        return [checkpoint]
    if not checkpoint.is_dir():
        raise ScoresError(f"checkpoint {checkpoint} does not exist")
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ScoresError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = [checkpoint / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ScoresError(
                f"{checkpoint}: shards listed in the index are missing: {missing[:4]}"
            )
        return files
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise ScoresError(f"{checkpoint} holds no .safetensors files")
    return files


def read_checkpoint_config(checkpoint: str | os.PathLike) -> dict:
    """MoE fields of ``config.json`` (:func:`reap_modifier.models.moe_fields.moe_fields`):
    num_experts, n_shared_experts, top_k, n_group, topk_group, model_class. Missing
    fields are ``None``."""
    checkpoint = Path(checkpoint)
    folder = checkpoint if checkpoint.is_dir() else checkpoint.parent
    path = folder / "config.json"
    if not path.is_file():
        config = {}
    else:
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ScoresError(f"{path} is not valid JSON: {exc}") from exc
    fields = moe_fields(config)
    archs = config.get("architectures") or [None]
    return {
        "num_experts": fields.num_experts,
        "n_shared_experts": fields.n_shared_experts,
        "top_k": fields.top_k,
        "n_group": fields.n_group,
        "topk_group": fields.topk_group,
        "model_class": archs[0],
    }


def _owns_experts(layer: str, rows: int, names: list[str], stacked: set[str]) -> bool:
    """Whether a router's block holds experts: ``<layer>.experts.*`` tensors, or a 3-D
    tensor under it with ``rows`` leading entries (a router of something else is not
    a MoE layer's)."""
    head = layer + "."
    return any(n.startswith(head + "experts.") for n in names) or any(
        s.startswith(head) and s.endswith(f":{rows}") for s in stacked
    )


def read_router_weights(
    checkpoint: str | os.PathLike, num_experts: int | None = None, extra_rows: int = 0
) -> dict[str, torch.Tensor]:
    """Router weights per MoE block, read from safetensors without loading the model.

    Only tensors named ``<block>.gate.weight`` / ``<block>.router.weight`` (or one module
    down: ``router.layer.weight``) with two dimensions, of blocks that hold experts, are
    read (one ``get_tensor`` each). ``num_experts`` (default: from
    ``config.json``, else the most common row count) filters out look-alike 2-D
    tensors of other shapes; with ``extra_rows`` (a router logit per shared expert after
    the routed experts', Inkling), routers of ``num_experts + extra_rows`` rows are read
    whole. Layers come back in checkpoint order of layer number.
    """
    checkpoint = Path(checkpoint)
    files = _checkpoint_files(checkpoint)
    if num_experts is None:
        num_experts = read_checkpoint_config(checkpoint)["num_experts"]
    found: dict[str, tuple[Path, str, list[int]]] = {}
    stacked: set[str] = set()  # 3-D tensors: stacked experts under another name (Granite)
    names: list[str] = []
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    names.append(name)
                    m = ROUTER_NAME_RE.match(name)
                    shape = list(f.get_slice(name).get_shape())
                    if len(shape) == 3:
                        stacked.add(f"{name}:{shape[0]}")
                    if m is not None and len(shape) == 2:
                        found[m.group("block")] = (file, name, shape)
        except ScoresError:
            raise
        except Exception as exc:
            raise ScoresError(f"cannot read safetensors shard {file}: {exc}") from exc
    found = {
        layer: v for layer, v in found.items() if _owns_experts(layer, v[2][0], names, stacked)
    }
    if not found:
        raise ScoresError(
            f"{checkpoint}: no router tensors (<block>.gate.weight / <block>.router.weight, "
            "2-D) found; is this a MoE checkpoint with an unquantized router?"
        )
    if num_experts is None:
        rows = [shape[0] for _, _, shape in found.values()]
        num_experts = max(set(rows), key=rows.count)
    layers = {k: v for k, v in found.items() if v[2][0] == num_experts}
    if not layers and extra_rows:
        layers = {k: v for k, v in found.items() if v[2][0] == num_experts + extra_rows}
    if not layers:
        raise ScoresError(
            f"{checkpoint}: no router tensor has {num_experts} rows (found shapes "
            f"{sorted({tuple(v[2]) for v in found.values()})[:4]})"
        )
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for layer, (file, name, _) in layers.items():
        by_file.setdefault(file, []).append((layer, name))
    weights: dict[str, torch.Tensor] = {}
    for file, items in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for layer, name in items:
                weights[layer] = f.get_tensor(name)
    order = sorted(weights, key=lambda n: (layer_number(n), n))
    return {layer: weights[layer] for layer in order}


def scores_from_weights(checkpoint: str | os.PathLike, method: str, seed: int = 0) -> ExpertScores:
    """``reap scores from-weights``: a baseline scores file for a safetensors checkpoint."""
    if method not in BASELINE_METHODS:
        raise ScoresError(
            f"unknown baseline {method!r}; choose one of {', '.join(BASELINE_METHODS)}"
        )
    config = read_checkpoint_config(checkpoint)
    E, shared = config["num_experts"], config["n_shared_experts"] or 0
    weights = read_router_weights(checkpoint, E, extra_rows=shared)
    meta = {
        k: v
        for k, v in config.items()
        if k not in ("num_experts", "n_shared_experts") and v is not None
    }
    meta["source_checkpoint"] = str(Path(checkpoint).resolve())
    if E is not None and any(w.shape[0] != E for w in weights.values()):
        # rows after the routed experts' are not experts: scored without them, the
        # fingerprints (of the whole router, as the modifier hashes it) with them
        meta["router_fingerprint"] = router_fingerprint(weights)
        meta["model_fingerprint"] = model_fingerprint(weights)
        weights = {layer: w[:E] for layer, w in weights.items()}
    return baseline_scores(method, weights, seed=seed, metadata=meta)
