"""What is checked of the checkpoints before any model loads: each is a directory with a
readable ``config.json``, every candidate has the reference's vocabulary size, and every
candidate's tokenizer is the reference's (same vocabulary files, or the same vocabulary)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..models.moe_fields import config_value

__all__ = ["CheckpointInputError", "check_checkpoints", "load_tokenizer", "vocab_size"]

#: files that define a tokenizer's vocabulary (compared byte for byte first)
VOCAB_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tiktoken.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)


class CheckpointInputError(ValueError):
    """A checkpoint that cannot be evaluated as given; the message names it."""


def _config(path: Path) -> dict:
    if not path.is_dir():
        raise CheckpointInputError(f"{path}: not a checkpoint directory")
    cfg = path / "config.json"
    if not cfg.is_file():
        raise CheckpointInputError(f"{path}: no config.json (not a checkpoint directory)")
    try:
        return json.loads(cfg.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointInputError(f"{cfg}: unreadable ({exc})") from None


def vocab_size(cfg: dict) -> int | None:
    """The vocabulary size of a ``config.json`` (top level or a nested text config)."""
    size = config_value(cfg, ("vocab_size",))
    return int(size) if size else None


def _vocab_hashes(path: Path) -> dict[str, str]:
    return {
        f: hashlib.sha256((path / f).read_bytes()).hexdigest()
        for f in VOCAB_FILES
        if (path / f).is_file()
    }


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer (transformers ``AutoTokenizer``); names the checkpoint when it
    has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=True)
    except Exception as exc:  # noqa: BLE001 - any failure means: no usable tokenizer there
        raise CheckpointInputError(
            f"{path}: no tokenizer could be loaded ({type(exc).__name__}: {exc}); the reference "
            "checkpoint must hold its tokenizer files"
        ) from None


def check_checkpoints(reference: Path, candidates: list[Path]) -> list[str]:
    """Raise :class:`CheckpointInputError` for a checkpoint that is not one, a vocabulary size
    that differs, or a tokenizer that differs from the reference's. Returns notes (a candidate
    without tokenizer files is taken to share the reference's)."""
    notes: list[str] = []
    ref_cfg = _config(reference)
    ref_vocab = vocab_size(ref_cfg)
    ref_files = _vocab_hashes(reference)
    ref_tok = None
    for cand in candidates:
        cfg = _config(cand)
        v = vocab_size(cfg)
        if ref_vocab is not None and v is not None and v != ref_vocab:
            raise CheckpointInputError(
                f"{cand}: vocabulary size {v} differs from the reference's {ref_vocab}; "
                "compare checkpoints of one model family and tokenizer"
            )
        files = _vocab_hashes(cand)
        if not files:
            notes.append(f"{cand}: no tokenizer files; taken to use the reference's tokenizer")
            continue
        if files == ref_files:
            continue
        if ref_tok is None:
            ref_tok = load_tokenizer(reference)
        tok = load_tokenizer(cand)
        if tok.get_vocab() != ref_tok.get_vocab() or tok.all_special_ids != ref_tok.all_special_ids:
            raise CheckpointInputError(
                f"{cand}: its tokenizer differs from the reference's ({reference}); "
                "the windows are tokenized once with the reference's tokenizer, so every "
                "candidate must use the same one"
            )
    return notes
