"""Stage 0 of the main job: the tokenizer, the corpora's held-out records, the calibration sets
per part, the evaluation windows and the generation prompts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import LANGS, PARTS, DemoConfig
from .workspace import ensure_corpora


@dataclass
class Inputs:
    """Stage 0: the tokenizer, the corpora's held-out records, the calibration sets per part, the
    evaluation windows and the generation prompts per language."""

    tokenizer: Any
    evals: dict[str, list]
    sets: dict[str, Any]
    windows: dict[str, Any]
    prompts: dict[str, list[dict]]


def load_inputs(cfg: DemoConfig, model_dir: Path, data_dir: Path, log) -> Inputs:
    """Stage 0: corpora (fetched on first run), tokenizer, calibration sets, windows, prompts."""
    from transformers import AutoTokenizer

    from . import data as D

    ensure_corpora(data_dir, default=cfg.data_dir is None, log=log)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    calib = {lang: D.load_split(data_dir, lang, "calib") for lang in LANGS}
    evals = {lang: D.load_split(data_dir, lang, "eval") for lang in LANGS}
    sets = calibration_sets(calib, tokenizer, cfg)
    windows = {lang: quality_windows(evals[lang], tokenizer, cfg) for lang in LANGS}
    prompts = {
        lang: pick_prompts(
            evals[lang], tokenizer, cfg.prompts_per_lang, cfg.prompt_tokens, cfg.seed + 7
        )
        for lang in LANGS
    }
    return Inputs(tokenizer, evals, sets, windows, prompts)


def quality_windows(records: list, tokenizer, cfg: DemoConfig):
    """The windows of one language the quality tables measure: the evaluation windows of the eval
    split ``records``, or with ``cfg.split == "dev"`` as many from the development split (the
    paragraphs those evaluation windows never read)."""
    from . import data as D

    if cfg.split == "eval":
        return D.eval_windows(
            records, tokenizer, cfg.eval_windows, seq_len=cfg.eval_seq_len, seed=cfg.eval_seed
        )
    if cfg.split == "dev":
        return D.dev_windows(
            records,
            tokenizer,
            cfg.eval_windows,
            seq_len=cfg.eval_seq_len,
            seed=cfg.dev_seed,
            exclude=(cfg.eval_windows, cfg.eval_seq_len, cfg.eval_seed),
        )
    raise ValueError(f"split must be 'eval' or 'dev', got {cfg.split!r}")


def calibration_sets(records: dict[str, list], tokenizer, cfg: DemoConfig) -> dict[str, Any]:
    """One ``datasets.Dataset`` per part. English calibration paragraphs are shuffled with the seed
    and dealt alternately into two disjoint halves (parts en1 / en2), each sampled across sources."""
    from .data import calibration_dataset, shuffled

    en = shuffled(records["en"], cfg.seed + 11)
    pools = {"en1": en[0::2], "en2": en[1::2], "zh": records["zh"], "code": records["code"]}
    out = {}
    for k, (part, lang) in enumerate(PARTS):
        out[part] = calibration_dataset(
            {lang: pools[part]},
            tokenizer,
            cfg.tokens_per_part,
            seq_len=cfg.calib_seq_len,
            seed=cfg.seed + 101 * k,
        )
    return out


def pick_prompts(records: list, tokenizer, n: int, prompt_tokens: int, seed: int) -> list[dict]:
    """``n`` prompts (the first ``prompt_tokens`` tokens of held-out paragraphs, sources taken in
    turn, seeded: :func:`reap_modifier.evaluation.texts.pick_prompts`) with their text."""
    from ..evaluation.texts import pick_prompts as pick

    out = pick(records, tokenizer, n, prompt_tokens, seed)
    if len(out) < n:
        raise ValueError(f"fewer than {n} held-out paragraphs hold {prompt_tokens + 4} tokens")
    return [{**p, "text": tokenizer.decode(p["ids"])} for p in out]
