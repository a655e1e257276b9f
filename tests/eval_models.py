"""Tiny checkpoints and texts for the ``reap eval`` tests: a random tiny MoE model saved with a
word-level tokenizer (tokens ``t0..t127``), a pruned copy made by the checkpoint rewriter, and
text files of space-separated tokens."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

#: what vLLM 0.32's CPU backend needs of a tiny model (as in test_vllm_serving)
VLLM_CPU_OVERRIDES = {"qwen3_moe": dict(head_dim=32), "olmoe": dict(hidden_size=64)}
KEPT = {"qwen3_moe": [[1, 2, 5, 7], [0, 3, 4, 6]], "olmoe": [[2, 3, 5, 6], [0, 1, 4, 7]]}


def make_eval_tokenizer(vocab: int = 128):
    """Word-level tokens ``t0..t{vocab-1}`` with ``t1`` as end-of-text (a separator between
    paragraphs, as real tokenizers have)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="t0", pad_token="t0", eos_token="t1"
    )


def save_tiny(
    family: str, path: Path, *, dtype=torch.float32, seed: int = 0, vllm: bool = False, **kw
) -> Path:
    from tiny_models import build_tiny

    overrides = {**(VLLM_CPU_OVERRIDES.get(family, {}) if vllm else {}), **kw}
    model, _ = build_tiny(family, seed=seed, dtype=dtype, **overrides)
    model.save_pretrained(path)
    make_eval_tokenizer().save_pretrained(path)
    return path


def prune(src: Path, dst: Path, kept: list[list[int]]) -> Path:
    from reap_modifier.checkpoint import inspect_checkpoint, rewrite_checkpoint
    from reap_modifier.scores.plan import PruningPlan

    layout = inspect_checkpoint(src)
    blocks = sorted(layout.blocks, key=lambda b: int(b.split("layers.")[1].split(".")[0]))
    plan = PruningPlan(kept=dict(zip(blocks, kept)), num_experts=layout.num_experts)
    rewrite_checkpoint(src, plan, dst, progress=False, hash_source=False, hash_cache=False)
    for f in src.iterdir():  # the rewriter copies what it knows; make sure the tokenizer is there
        if f.name.startswith(("tokenizer", "special_tokens")) and not (dst / f.name).exists():
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def write_text(
    path: Path, paragraphs: int = 30, words: int = 40, seed: int = 0, kind="txt"
) -> Path:
    """Paragraphs of random tokens ``t2..t127`` (``t0``/``t1`` are unk/eos)."""
    rng = random.Random(seed)
    paras = [
        " ".join(f"t{rng.randrange(2, 128)}" for _ in range(rng.randrange(words // 2, words)))
        for _ in range(paragraphs)
    ]
    if kind == "txt":
        path.write_text("\n\n".join(paras) + "\n")
    else:
        path.write_text(
            "".join(
                json.dumps({"text": p, "source": f"s{i % 3}"}) + "\n" for i, p in enumerate(paras)
            )
        )
    return path
