"""The GGUF oracle: what pruning a GGUF must give, made without the product. A saved
transformers model is pruned in its safetensors (kept experts renumbered, router rows and
routing bias sliced, every count key set) and converted by llama.cpp's own converter
(``scripts/llama_cpp_converter.sh`` puts it in ``build/llama-cpp/converter``); tensors are
read back with the ``gguf`` package's reader."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
CONVERTER = Path(os.environ.get("REAP_GGUF_CONVERTER", ROOT / "build/llama-cpp/converter"))
#: every config key a transformers MoE config may hold the routed-expert count in
COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_EXPERT_RE = re.compile(r"^(?P<head>.*\.experts\.)(?P<e>\d+)(?P<tail>\..*)$")
_PER_EXPERT_TAILS = ("mlp.gate.weight", "e_score_correction_bias")

#: runs the converter with the tiny word-level tokenizer's pre-tokenizer named: its hash is
#: in no table of llama.cpp's; only the tokenizer keys depend on it, the same on both sides
_RUN = """
import runpy, sys
conv = sys.argv[1]
sys.path.insert(0, conv)
sys.path.insert(1, conv + "/gguf-py")
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tok: "default"
sys.argv = [conv + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def converter_available() -> bool:
    return (CONVERTER / "convert_hf_to_gguf.py").is_file()


def require_converter() -> None:
    """Skip the calling test without the converter (fail where CI requires it)."""
    import pytest

    if converter_available():
        return
    why = "llama.cpp's converter is missing: run scripts/llama_cpp_converter.sh"
    if os.environ.get("REAP_REQUIRE_GGUF_CONVERTER"):
        pytest.fail(why)
    pytest.skip(why)


def bpe_tokenizer(vocab: int = 128):
    """A BPE tokenizer of ``vocab`` tokens with merges (llama.cpp refuses a BPE vocabulary
    without them): half single characters, half the pairs of neighbours merged."""
    import string

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list((string.ascii_letters + string.digits + "+/")[: vocab // 2])
    merges = [(chars[i], chars[(i + 1) % len(chars)]) for i in range(vocab - len(chars))]
    tokens = chars + [a + b for a, b in merges]
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token=tokens[0], pad_token=tokens[0])


def prune_safetensors(src: Path, dst: Path, kept: dict[int, list[int]]) -> None:
    """Copy the saved model ``src`` to ``dst`` keeping, in layer ``L``, the experts
    ``kept[L]`` (ascending; new id = position)."""
    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    n = next(cfg[k] for k in COUNT_KEYS if k in cfg)
    keep = len(next(iter(kept.values())))
    for k in COUNT_KEYS:
        if cfg.get(k) == n:
            cfg[k] = keep
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    out = {}
    for name, t in load_file(src / "model.safetensors").items():
        layer = re.search(r"layers\.(\d+)\.", name)
        ids = kept.get(int(layer[1])) if layer else None
        m = _EXPERT_RE.match(name)
        if ids is not None and m:
            if int(m["e"]) in ids:
                out[f"{m['head']}{ids.index(int(m['e']))}{m['tail']}"] = t.contiguous()
            continue
        if ids is not None and (".experts." in name or name.endswith(_PER_EXPERT_TAILS)):
            assert t.shape[0] == n, name
            t = t.index_select(0, torch.tensor(ids)).contiguous()
        out[name] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors") and f.is_file():
            shutil.copy(f, dst / f.name)


def convert(model: Path, out: Path, outtype: str, *extra: str) -> Path:
    """llama.cpp's converter on ``model`` -> ``out`` (a file; a split writes its parts
    beside it)."""
    cmd = [sys.executable, "-c", _RUN, str(CONVERTER), str(model), "--outtype", outtype]
    cmd += ["--model-name", "tiny", "--outfile", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_LOCAL_GGUF": ""}
    env.pop("NO_LOCAL_GGUF")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def tensor_bytes(path: Path) -> dict[str, tuple[tuple[int, ...], int, bytes]]:
    """Every tensor of a GGUF file: (dims, ggml type, data bytes)."""
    import gguf

    r = gguf.GGUFReader(path)
    return {
        t.name: (
            tuple(int(d) for d in t.shape),
            int(t.tensor_type),
            np.asarray(r.data[t.data_offset : t.data_offset + t.n_bytes]).tobytes(),
        )
        for t in r.tensors
    }


def field_values(path: Path) -> dict[str, object]:
    """Every key of a GGUF file with its value (arrays as lists)."""
    import gguf

    r = gguf.GGUFReader(path)
    return {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("GGUF.")}


def q8_0_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """``x`` (last dim a multiple of 32) as llama.cpp's CPU kernels see it when they multiply
    it by an MXFP4 weight: quantized to q8_0 (blocks of 32, ``d = amax / 127`` stored as
    fp16, ``q = round(x / d)``; ``vec_dot_type`` of MXFP4 is Q8_0) and read back."""
    blocks = x.float().reshape(-1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inv) * d.half().float()).reshape(x.shape).to(x.dtype)
