"""Shared fixtures: a word-level tokenizer, calibration datasets, saved tiny models."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
import paths  # noqa: E402,F401  (tests/helpers and tests/oracles importable by name)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("REAP_SHA256_CACHE", "0")  # tests never write the user's hash cache
torch.set_num_threads(1)

# Property tests judge behaviour, never speed: no per-example deadline (a loaded machine runs an
# example many times slower), and the same examples on every run (CI cannot fail by the draw).
from hypothesis import settings  # noqa: E402

settings.register_profile("reap", deadline=None, derandomize=True, print_blob=True)
settings.load_profile("reap")


def make_tokenizer(vocab: int = 128):
    """A word-level tokenizer over tokens ``t0..t{vocab-1}`` (oneshot needs a processor)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", pad_token="t0")


def make_dataset(samples: list[torch.Tensor], masks: list[torch.Tensor] | None = None):
    """A tokenized ``datasets.Dataset`` from 1-D id tensors (attention masks all ones
    unless ``masks`` gives one per sample)."""
    from datasets import Dataset

    ids = [s.tolist() for s in samples]
    mask = [m.tolist() for m in masks] if masks is not None else [[1] * len(i) for i in ids]
    return Dataset.from_dict({"input_ids": ids, "attention_mask": mask})


def calibrate(model, modifier, samples: list[torch.Tensor], vocab: int, masks=None, **kw) -> None:
    """``oneshot`` with one modifier over ``samples`` (with ``masks``: their attention
    masks) in order (the word-level tokenizer as the processor); ``kw`` goes to ``oneshot``
    (pipeline, batch size, ``shuffle_calibration_samples=True``, ...)."""
    from llmcompressor import oneshot

    kw.setdefault("shuffle_calibration_samples", False)
    oneshot(
        model=model,
        recipe=[modifier],
        processor=make_tokenizer(vocab),
        dataset=make_dataset(samples, masks),
        num_calibration_samples=len(samples),
        **kw,
    )


def calibration_samples(
    vocab: int = 128, n: int = 6, seq: int = 12, seed: int = 0
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (seq,), generator=gen) for _ in range(n)]


def save_and_reload(model, family: str, path: Path):
    """Save a tiny model and load it back, so ``name_or_path`` points at a directory
    (``oneshot`` re-reads the config from there)."""
    from tiny_models import reload_class

    model.save_pretrained(path)
    cls = reload_class(family)
    reloaded = cls.from_pretrained(path, dtype=model.dtype)
    return reloaded.eval()


@pytest.fixture(scope="session")
def corpora() -> Path:
    """The built corpora (``data/``, from ``scripts/build_corpora.py``): the test is skipped
    without them, and fails instead when ``REAP_REQUIRE_CORPORA=1`` (``scripts/test.sh``
    builds them first and sets it, so CI always runs the corpus checks)."""
    from reap_modifier.demo import data as D

    if not D.corpora_available():
        message = "corpora not built: run `python scripts/build_corpora.py`"
        if os.environ.get("REAP_REQUIRE_CORPORA") == "1":
            pytest.fail(f"{message} (REAP_REQUIRE_CORPORA=1)")
        pytest.skip(message)
    return D.default_data_dir()


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def sources(tmp_path_factory):
    """Tiny source checkpoints shared by the rewriter tests (built once per session;
    see ``mxfp4_fixtures.build_sources``).  Tests never modify them: copy first."""
    from mxfp4_fixtures import build_sources

    return build_sources(tmp_path_factory.mktemp("src"))


def fresh_process_logits(family: str, path: Path, ids: torch.Tensor, out: Path) -> torch.Tensor:
    """The logits on ``ids`` of the checkpoint at ``path`` reloaded in a fresh Python process
    (nothing of this process's state, registrations or patches carried over)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(Path(__file__).parent / "helpers")!r}); import paths
        from tiny_models import reload_class
        m = reload_class({family!r}).from_pretrained({str(path)!r}).eval()
        with torch.no_grad():
            torch.save(m(input_ids=torch.tensor({ids.tolist()}), use_cache=False).logits, {str(out)!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)
