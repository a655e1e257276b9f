"""Evaluation texts: a file read into paragraphs, seeded windows of token ids, held-out prompts.

- :func:`load_records`: ``.txt`` (paragraphs: blocks separated by blank lines), ``.jsonl`` (one
  object per line, the text in ``text_field``; a ``source`` field, when present, is kept), or
  anything else ``datasets.load_dataset`` reads from a local file (``.json``, ``.csv``,
  ``.parquet``).
- :func:`sample_windows`: paragraphs shuffled with a seed, tokenized with the reference's
  tokenizer, concatenated with its end-of-text token between them, cut into full windows of
  ``window_tokens`` -- so the windows are spread across the file, not its first tokens (or, for
  ``reap eval``, as many full windows as a short file holds). The main job's held-out windows
  are these, on its evaluation splits.
- :func:`pick_prompts`: the first ``prompt_tokens`` tokens of seeded paragraphs (sources taken in
  turn) that hold at least 4 more tokens, for greedy continuations.
- :func:`ids_sha256`: the hash the report and the reference cache record for windows / prompts.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "TextError",
    "encode",
    "eos_id",
    "ids_sha256",
    "load_records",
    "pick_prompts",
    "sample_windows",
    "shuffled",
]


class TextError(ValueError):
    """An evaluation text that cannot be used (missing, empty, too short); says what to change."""


def load_records(path: str | Path, text_field: str = "text") -> list[dict]:
    """The file's paragraphs as ``{"text": ...[, "source": ...]}`` records (empty ones dropped)."""
    path = Path(path)
    if not path.is_file():
        raise TextError(f"{path}: no such file")
    suffix = path.suffix.lower()
    out: list[dict] = []
    if suffix in (".txt", ".md", ""):
        raw = path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
        out = [{"text": p.strip()} for p in raw.split("\n\n") if p.strip()]
    elif suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for k, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TextError(f"{path}:{k}: not JSON ({exc.msg})") from None
                if not isinstance(row, dict) or text_field not in row:
                    raise TextError(
                        f"{path}:{k}: no {text_field!r} field; name the text field with --text-field"
                    )
                out.append(_record(row, text_field))
    else:
        kind = {".json": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}.get(
            suffix
        )
        if kind is None:
            raise TextError(
                f"{path}: unknown text format {suffix!r}; use .txt, .jsonl, .json, .csv or .parquet"
            )
        from datasets import load_dataset

        ds = load_dataset(kind, data_files=str(path), split="train")
        if text_field not in ds.column_names:
            raise TextError(
                f"{path}: no {text_field!r} column (columns: {ds.column_names}); name it with --text-field"
            )
        out = [_record(row, text_field) for row in ds]
    out = [r for r in out if r["text"].strip()]
    if not out:
        raise TextError(f"{path}: holds no text")
    return out


def _record(row: dict, field: str) -> dict:
    r = {"text": str(row[field] or "")}
    if "source" in row:
        r["source"] = str(row["source"])
    return r


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens, for a ``tokenizers.Tokenizer``, a transformers
    tokenizer or a callable."""
    try:  # tokenizers.Tokenizer
        from tokenizers import Tokenizer

        if isinstance(tokenizer, Tokenizer):
            return list(tokenizer.encode(text, add_special_tokens=False).ids)
    except ImportError:  # pragma: no cover
        pass
    if hasattr(tokenizer, "encode") and hasattr(tokenizer, "convert_ids_to_tokens"):
        # verbose=False: paragraphs longer than model_max_length are fine here (they get packed)
        return list(tokenizer.encode(text, add_special_tokens=False, verbose=False))
    if callable(tokenizer):
        return list(tokenizer(text))
    raise TypeError(f"cannot encode with {type(tokenizer).__name__}")


def eos_id(tokenizer: Any, default: int | None = None) -> int | None:
    for attr in ("eos_token_id",):
        v = getattr(tokenizer, attr, None)
        if isinstance(v, int):
            return v
    if hasattr(tokenizer, "token_to_id"):
        for t in ("<|endoftext|>", "</s>", "<eos>"):
            v = tokenizer.token_to_id(t)
            if v is not None:
                return v
    return default


def shuffled(records: Sequence[dict], seed: int, mix: str = "proportional") -> list[dict]:
    """A seeded order over all records. ``proportional``: one global shuffle, so every source
    contributes in proportion to its size; ``balanced``: sources are shuffled separately and
    interleaved round-robin, so small sources are represented as much as large ones."""
    rng = random.Random(seed)
    if mix == "proportional":
        out = list(records)
        rng.shuffle(out)
        return out
    if mix != "balanced":
        raise ValueError("mix must be 'proportional' or 'balanced'")
    by_src: dict[str, list[dict]] = {}
    for r in records:
        by_src.setdefault(r.get("source", ""), []).append(r)
    queues = []
    for src in sorted(by_src):
        q = list(by_src[src])
        rng.shuffle(q)
        queues.append(q)
    out = []
    i = 0
    while any(queues):
        q = queues[i % len(queues)]
        if q:
            out.append(q.pop())
        i += 1
    return out


def sample_windows(
    records: Sequence[dict],
    tokenizer: Any,
    n_windows: int,
    window_tokens: int,
    seed: int,
    *,
    allow_fewer: bool = False,
):
    """``n_windows`` windows of ``window_tokens`` ids (``torch.LongTensor [n, T]``) from the seeded
    paragraph order. When the text holds fewer tokens: raises :class:`TextError`, or with
    ``allow_fewer`` returns the full windows it holds (at least one; the caller says so)."""
    import torch

    if window_tokens < 2:
        raise TextError(f"--window-tokens must be at least 2, got {window_tokens}")
    if n_windows < 1:
        raise TextError(f"--windows must be at least 1, got {n_windows}")
    need = n_windows * window_tokens
    sep = eos_id(tokenizer)
    ids: list[int] = []
    for r in shuffled(records, seed):
        toks = encode(tokenizer, r["text"]) + ([sep] if sep is not None else [])
        ids.extend(toks[: need - len(ids)])
        if len(ids) >= need:
            break
    n = len(ids) // window_tokens
    if n < n_windows and not (allow_fewer and n >= 1):
        least = "one window" if allow_fewer else f"{n_windows} windows"
        raise TextError(
            f"holds {len(ids)} tokens, fewer than {least} x {window_tokens}"
            + ("" if allow_fewer else f" = {need}")
            + "; give a longer text or lower "
            + ("--window-tokens" if allow_fewer else "--windows / --window-tokens")
        )
    return torch.tensor(ids[: n * window_tokens], dtype=torch.long).view(n, window_tokens)


def pick_prompts(
    records: Sequence[dict], tokenizer: Any, n: int, prompt_tokens: int, seed: int
) -> list[dict]:
    """``n`` prompts: the first ``prompt_tokens`` tokens of paragraphs holding at least
    ``prompt_tokens + 4``, in the seeded ``balanced`` order. Fewer when fewer qualify."""
    out = []
    if n <= 0:
        return out
    for r in shuffled(records, seed, mix="balanced"):
        ids = encode(tokenizer, r["text"])
        if len(ids) >= prompt_tokens + 4:
            out.append({"source": r.get("source"), "ids": ids[:prompt_tokens]})
            if len(out) == n:
                break
    return out


def ids_sha256(ids) -> str:
    """sha256 of token ids (a tensor or nested lists) as little-endian int64, with their shape."""
    import torch

    t = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.long)
    t = t.to(torch.int64).contiguous()
    h = hashlib.sha256(json.dumps(list(t.shape)).encode())
    h.update(t.numpy().astype("<i8").tobytes())
    return h.hexdigest()
