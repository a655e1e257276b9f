"""The transformers side of the vLLM check: greedy tokens and their log-probabilities.

The reference is computed in this process (reap-modifier's environment, its pinned
transformers) from the same checkpoint directory vLLM serves.  Greedy decoding is a
plain loop over full forward passes (no KV cache, no ``generate`` logits processors:
EOS is an ordinary token, as with vLLM's ``ignore_eos``), so the only thing that can
differ between the two sides is how each reads and computes the checkpoint.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = [
    "Reference",
    "greedy_reference",
    "load_reference_model",
    "make_prompts",
    "sequence_logprobs",
]


@dataclass
class Reference:
    tokens: list[list[int]]
    #: log-probability of each greedy token under the reference
    logprobs: list[list[float]]
    #: top-1 minus top-2 log-probability at each greedy step (a small margin is a near tie)
    margins: list[list[float]]


def make_prompts(
    vocab_size: int, n: int = 4, seed: int = 0, lengths=(8, 13, 16, 11)
) -> list[list[int]]:
    """``n`` deterministic prompts of token ids in ``[3, vocab)`` (ids 0-2 are often special)."""
    import torch

    gen = torch.Generator().manual_seed(int(seed))
    lo = 3 if vocab_size > 8 else 0
    return [
        torch.randint(lo, vocab_size, (lengths[i % len(lengths)],), generator=gen).tolist()
        for i in range(n)
    ]


def load_reference_model(checkpoint: str | os.PathLike, dtype: str = "auto"):
    """The checkpoint through transformers (Kimi K3 via llm-compressor's class), eval mode,
    in ``dtype`` (compressed-tensors checkpoints decompressed)."""
    from ..models.loading import load_checkpoint_model

    return load_checkpoint_model(checkpoint, dtype=dtype)


def greedy_reference(model, prompts: list[list[int]], max_tokens: int) -> Reference:
    import torch

    tokens, logprobs, margins = [], [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], dtype=torch.long)
            toks, lps, mgs = [], [], []
            for _ in range(int(max_tokens)):
                logits = model(input_ids=ids, use_cache=False).logits[0, -1].float()
                lp = torch.log_softmax(logits, dim=-1)
                top = torch.topk(lp, 2)
                tok = int(top.indices[0])
                toks.append(tok)
                lps.append(float(top.values[0]))
                mgs.append(float(top.values[0] - top.values[1]))
                ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
            tokens.append(toks)
            logprobs.append(lps)
            margins.append(mgs)
    return Reference(tokens, logprobs, margins)


def sequence_logprobs(
    model, prompts: list[list[int]], continuations: list[list[int]]
) -> list[list[float]]:
    """Teacher-forced log-probability of each continuation token after its prompt."""
    import torch

    out = []
    with torch.no_grad():
        for prompt, cont in zip(prompts, continuations):
            ids = torch.tensor([prompt + cont], dtype=torch.long)
            lp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float(), dim=-1)
            out.append([float(lp[len(prompt) - 1 + j, tok]) for j, tok in enumerate(cont)])
    return out
