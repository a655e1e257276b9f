"""Synthetic GGUF files for the GGUF tests that need no converter: a MoE model whose expert
tensors have any ggml type (a k-quant, MXFP4: random bytes of the type's block size), with
groups, next-token layers or a hash-routing table, an importance matrix of it, and a plan for
it. Written with the ``gguf`` package's writer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ARCH = "deepseek2"

#: half of :func:`write_moe`'s 8 experts kept in each of its two layers
HALF_KEPT = {"model.layers.0.mlp": [0, 3, 5, 6], "model.layers.1.mlp": [1, 2, 4, 7]}


def write_plan(path: Path, kept: dict[str, list[int]] = HALF_KEPT, num_experts: int = 8) -> Path:
    """A ``reap-plan`` file keeping ``kept`` (block name -> expert ids) of ``num_experts``."""
    path.write_text(
        json.dumps({"format": "reap-plan", "version": 1, "num_experts": num_experts, "kept": kept})
    )
    return path


def _raw(rng, ggml_type, dims: tuple[int, ...]) -> tuple[np.ndarray, object]:
    """Random data for a tensor of GGUF ``dims`` (innermost first) and ``ggml_type``."""
    import gguf

    qt = gguf.GGMLQuantizationType(ggml_type)
    shape = tuple(reversed(dims))
    if qt == gguf.GGMLQuantizationType.F32:
        return rng.standard_normal(shape).astype(np.float32), None
    block, size = gguf.GGML_QUANT_SIZES[qt]
    byte_shape = (*shape[:-1], shape[-1] // block * size)
    return rng.integers(0, 256, byte_shape, dtype=np.uint8), qt


def write_moe(
    path: Path,
    *,
    n_expert: int = 8,
    used: int = 2,
    layers: int = 2,
    embd: int = 256,
    ff: int = 256,
    expert_type: str = "Q4_K",
    groups: tuple[int, int] | None = None,
    nextn: int = 0,
    hash_routed: bool = False,
    seed: int = 0,
) -> Path:
    """A MoE model: ``layers`` blocks with a router, stacked experts of ``expert_type``,
    a routing bias (``exp_probs_b``) and a shared expert; the last ``nextn`` are next-token
    layers."""
    import gguf

    rng = np.random.default_rng(seed)
    qt = int(gguf.GGMLQuantizationType[expert_type])
    w = gguf.GGUFWriter(path, ARCH)
    w.add_block_count(layers)
    w.add_embedding_length(embd)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(used)
    w.add_expert_shared_count(1)
    w.add_string("general.size_label", "custom")
    if groups:
        w.add_uint32(f"{ARCH}.expert_group_count", groups[0])
        w.add_uint32(f"{ARCH}.expert_group_used_count", groups[1])
    if nextn:
        w.add_uint32(f"{ARCH}.nextn_predict_layers", nextn)
    tensors = {"token_embd.weight": ((embd, 16), 0)}
    for L in range(layers):
        b = f"blk.{L}."
        tensors[b + "attn_norm.weight"] = ((embd,), 0)
        tensors[b + "ffn_gate_inp.weight"] = ((embd, n_expert), 0)
        tensors[b + "exp_probs_b.bias"] = ((n_expert,), 0)
        tensors[b + "ffn_gate_exps.weight"] = ((embd, ff, n_expert), qt)
        tensors[b + "ffn_up_exps.weight"] = ((embd, ff, n_expert), qt)
        tensors[b + "ffn_down_exps.weight"] = ((ff, embd, n_expert), qt)
        tensors[b + "ffn_gate_inp_shexp.weight"] = ((embd,), 0)
        if hash_routed and L == 0:
            tensors[b + "ffn_gate_tid2eid.weight"] = ((used, 16), 0)
    for name, (dims, t) in tensors.items():
        data, raw = _raw(rng, t, dims)
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_imatrix(
    path: Path, *, n_expert: int = 8, layers: int = 2, embd: int = 256, ff: int = 256, seed: int = 1
) -> Path:
    """An importance matrix (``llama-imatrix``'s GGUF format) of :func:`write_moe`'s model."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "imatrix")
    w.add_type("imatrix")
    w.add_uint32("imatrix.chunk_count", 3)
    for L in range(layers):
        for name, ne0 in (("ffn_gate_exps", embd), ("ffn_up_exps", embd), ("ffn_down_exps", ff)):
            base = f"blk.{L}.{name}.weight"
            w.add_tensor(base + ".in_sum2", rng.random((n_expert, ne0), dtype=np.float32))
            w.add_tensor(base + ".counts", rng.integers(0, 9, (n_expert, 1)).astype(np.float32))
        w.add_tensor(f"blk.{L}.attn_q.weight.in_sum2", rng.random((1, embd), dtype=np.float32))
        w.add_tensor(f"blk.{L}.attn_q.weight.counts", np.ones((1, 1), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
