"""Tiny checkpoints and texts for the ``reap eval`` tests: a random tiny MoE model saved with a
word-level tokenizer (tokens ``t0..t127``), a pruned copy made by the checkpoint rewriter, and
text files of space-separated tokens."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

#: what vLLM 0.32's CPU backend needs of a tiny model (as in test_vllm_serving)
VLLM_CPU_OVERRIDES = {"qwen3_moe": dict(head_dim=32), "olmoe": dict(hidden_size=64)}
KEPT = {"qwen3_moe": [[1, 2, 5, 7], [0, 3, 4, 6]], "olmoe": [[2, 3, 5, 6], [0, 1, 4, 7]]}


def make_eval_tokenizer(vocab: int = 128):
    """Word-level tokens ``t2..t{vocab-1}`` plus ``<unk>`` (0) and ``<eos>`` (1), the end-of-text
    separator between paragraphs (special tokens must not be prefixes of words: added tokens
    are matched inside words)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, vocab)}}
    tk = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="<unk>", pad_token="<unk>", eos_token="<eos>"
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


LOCAL_TASK = """task: reap_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{query}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_local_task(root: Path, docs: int = 24, seed: int = 0) -> tuple[Path, list[dict]]:
    """An lm-eval multiple-choice task (YAML + JSON data) in ``root``: a query of 8 random
    tokens, 4 one-token choices, a random label. Returns the directory and the documents."""
    rng = random.Random(seed)
    rows = [
        {
            "query": " ".join(f"t{rng.randrange(2, 128)}" for _ in range(8)),
            "choices": [f"t{c}" for c in rng.sample(range(2, 128), 4)],
            "label": rng.randrange(4),
        }
        for _ in range(docs)
    ]
    root.mkdir(parents=True, exist_ok=True)
    data = root / "reap_tiny_mc.json"
    data.write_text(json.dumps(rows))
    (root / "reap_tiny_mc.yaml").write_text(LOCAL_TASK.format(data=data))
    return root, rows


def mc_accuracy(model, rows: list[dict]) -> float:
    """The oracle: pick the choice whose token is likeliest after the query (float32)."""
    tok = make_eval_tokenizer()
    hits = 0
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([tok.encode(r["query"], add_special_tokens=False)])
            lp = torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), -1)
            ll = [float(lp[tok.convert_tokens_to_ids(c)]) for c in r["choices"]]
            hits += int(max(range(4), key=lambda i: ll[i]) == r["label"])
    return hits / len(rows)
