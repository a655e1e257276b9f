"""Corpora helpers for the main job: paragraph extraction / filtering, the deterministic
train / calib / eval split, loading the built splits, and turning them into calibration
``datasets.Dataset`` objects and evaluation windows.

Everything here is a pure function over in-memory records (``{"text", "source", "doc"}`` dicts) so
it is testable on small fixtures; ``scripts/build_corpora.py`` uses the extraction side and writes
``data/<lang>/<split>.jsonl``, the main job uses the loading / sampling side.

Tokenizers: anything accepted by :func:`encode` -- a ``tokenizers.Tokenizer``, a transformers
tokenizer, or a plain callable ``text -> list[int]``.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterable, Iterator, Mapping, Sequence
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from ..evaluation.texts import encode, eos_id, sample_windows, shuffled

LANGS: tuple[str, ...] = ("en", "zh", "code")
SPLITS: tuple[str, ...] = ("train", "calib", "eval")

Record = dict[str, str]

# ----------------------------------------------------------------------------- character classes

_CJK_IDEO = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_CJK_ANY = _CJK_IDEO + "\u3000-\u303f\uff00-\uffef\u2014\u2026\u201c\u201d\u2018\u2019"
_RE_CJK_IDEO = re.compile(f"[{_CJK_IDEO}]")
_RE_JOIN_CJK = re.compile(f"(?<=[{_CJK_ANY}])[ \t]*\n\\s*(?=[{_CJK_ANY}])")
_RE_WS = re.compile(r"\s+")


def cjk_fraction(text: str) -> float:
    """Fraction of characters (ignoring whitespace) that are CJK ideographs."""
    chars = [c for c in text if not c.isspace()]
    if not chars:
        return 0.0
    return sum(1 for c in chars if _RE_CJK_IDEO.match(c)) / len(chars)


def ascii_fraction(text: str) -> float:
    return sum(1 for c in text if ord(c) < 128) / max(1, len(text))


def normalize_ws(text: str) -> str:
    """Join wrapped lines (without a space between CJK characters) and collapse whitespace."""
    text = unicodedata.normalize("NFC", text)
    text = _RE_JOIN_CJK.sub("", text)
    return _RE_WS.sub(" ", text).strip()


# ----------------------------------------------------------------------------- filters

EN_MIN_CHARS = 60
ZH_MIN_CHARS = 20
ZH_MIN_CJK = 0.30
CODE_MIN_CHARS = 64


def keep_paragraph(text: str, lang: str) -> bool:
    """The corpus filter.

    en: mostly-ASCII prose of 60+ characters (>= 97% ASCII, >= 75% letters/spaces, >= 8 words,
    no CJK); zh: 20+ characters with >= 30% CJK ideographs; code: 64+ characters.
    """
    if lang == "en":
        if len(text) < EN_MIN_CHARS or ascii_fraction(text) < 0.97:
            return False
        letters = sum(1 for c in text if c.isalpha() or c == " ")
        if letters / len(text) < 0.75 or len(text.split()) < 8:
            return False
        return cjk_fraction(text) == 0.0
    if lang == "zh":
        return len(text) >= ZH_MIN_CHARS and cjk_fraction(text) >= ZH_MIN_CJK
    if lang == "code":
        return len(text.strip()) >= CODE_MIN_CHARS
    raise ValueError(f"unknown language {lang!r} (expected one of {LANGS})")


# ----------------------------------------------------------------------------- extraction


class _HTMLText(HTMLParser):
    BLOCK = {
        "p",
        "div",
        "li",
        "dd",
        "dt",
        "td",
        "th",
        "tr",
        "table",
        "ul",
        "ol",
        "dl",
        "section",
        "article",
        "blockquote",
        "h1",
        "h2",
        "h3",
        "h4",
        "h5",
        "h6",
        "br",
        "hr",
        "header",
        "footer",
        "nav",
        "caption",
        "figcaption",
        "body",
    }
    SKIP = {"script", "style", "pre", "head", "title", "noscript", "svg", "math"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.paras: list[str] = []
        self.buf: list[str] = []
        self.skip = 0

    def flush(self) -> None:
        if self.buf:
            s = normalize_ws("".join(self.buf))
            if s:
                self.paras.append(s)
            self.buf = []

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.flush()
            self.skip += 1
        elif tag in self.BLOCK:
            self.flush()

    def handle_endtag(self, tag):
        if tag in self.SKIP:
            self.skip = max(0, self.skip - 1)
            self.flush()
        elif tag in self.BLOCK:
            self.flush()

    def handle_data(self, data):
        if not self.skip:
            self.buf.append(data)


def html_paragraphs(html: str) -> list[str]:
    """Text of the block elements of an HTML page; scripts, styles, ``<pre>`` and ``<head>`` dropped."""
    p = _HTMLText()
    p.feed(html)
    p.close()
    p.flush()
    return p.paras


def text_paragraphs(text: str, blank_line_separated: bool = True) -> list[str]:
    """Paragraphs of plain text (e.g. a rendered man page): blocks separated by blank lines, or the
    whole text as one paragraph; wrapped lines are joined."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    blocks = re.split(r"\n[ \t]*\n", text) if blank_line_separated else [text]
    return [s for s in (normalize_ws(b) for b in blocks) if s]


_RE_PKU_ID = re.compile(r"^\d{8}-\d{2}-\d{3}-\d{3}/m$")


def clean_zh_tagged(line: str) -> str:
    """People's Daily ``word/tag`` line -> plain text: tags, ``[...]nt`` brackets and the PKU line ids
    are removed and the words are joined without spaces (``迈向/v  充满/v`` -> ``迈向充满``)."""
    words = []
    for tok in line.split():
        if _RE_PKU_ID.match(tok):
            continue
        tok = tok.lstrip("[")
        tok = re.sub(r"\][A-Za-z]+$", "", tok)
        word = tok.rsplit("/", 1)[0] if "/" in tok else tok
        if word:
            words.append(word)
    return unicodedata.normalize("NFC", "".join(words))


def chunk_code(source: str, max_chars: int = 3000) -> list[str]:
    """Split a Python file into chunks of whole top-level blocks (defs, classes, statement runs),
    greedily merged up to ``max_chars``; oversized blocks are split at blank lines, then at lines."""
    source = source.replace("\r\n", "\n").strip("\n")
    if not source.strip():
        return []
    blocks = re.split(r"\n\s*\n(?=\S)", source)

    def split_big(block: str) -> list[str]:
        if len(block) <= max_chars:
            return [block]
        parts = re.split(r"\n[ \t]*\n", block)
        if len(parts) == 1:
            parts = block.split("\n")
            sep = "\n"
        else:
            sep = "\n\n"
        out, cur = [], ""
        for p in parts:
            if len(p) > max_chars and sep == "\n\n":
                if cur:
                    out.append(cur)
                    cur = ""
                out.extend(split_big_lines(p))
                continue
            cand = p if not cur else cur + sep + p
            if len(cand) > max_chars and cur:
                out.append(cur)
                cur = p
            else:
                cur = cand
        if cur:
            out.append(cur)
        return out

    def split_big_lines(block: str) -> list[str]:
        out, cur = [], ""
        for line in block.split("\n"):
            cand = line if not cur else cur + "\n" + line
            if len(cand) > max_chars and cur:
                out.append(cur)
                cur = line
            else:
                cur = cand
        if cur:
            out.append(cur)
        return out

    pieces: list[str] = []
    for b in blocks:
        pieces.extend(split_big(b))
    chunks, cur = [], ""
    for p in pieces:
        cand = p if not cur else cur + "\n\n" + p
        if len(cand) > max_chars and cur:
            chunks.append(cur)
            cur = p
        else:
            cur = cand
    if cur:
        chunks.append(cur)
    return [c.rstrip() for c in chunks if c.strip()]


# ----------------------------------------------------------------------------- split


def split_of_chunk(chunk_index: int, modulus: int = 20) -> str:
    """chunk index % modulus: 0 -> eval, 1 -> calib, anything else -> train."""
    r = chunk_index % modulus
    return "eval" if r == 0 else "calib" if r == 1 else "train"


def split_records(
    records: Sequence[Record], chunk_size: int = 8, modulus: int = 20
) -> Iterator[tuple[str, Record]]:
    """Assign the (ordered) paragraphs of ONE source to splits: consecutive runs of ``chunk_size``
    paragraphs form a chunk, and the chunk index decides the split (:func:`split_of_chunk`). So eval
    text is never trained on, and every source of reasonable size contributes to every split."""
    if chunk_size < 1 or modulus < 3:
        raise ValueError("chunk_size must be >= 1 and modulus >= 3")
    for i, rec in enumerate(records):
        yield split_of_chunk(i // chunk_size, modulus), rec


# ----------------------------------------------------------------------------- loading


def default_data_dir() -> Path:
    return Path(__file__).resolve().parents[3] / "data"


def split_path(data_dir: str | Path, lang: str, split: str) -> Path:
    if lang not in LANGS:
        raise ValueError(f"unknown language {lang!r} (expected one of {LANGS})")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} (expected one of {SPLITS})")
    return Path(data_dir) / lang / f"{split}.jsonl"


def corpora_available(data_dir: str | Path | None = None) -> bool:
    d = Path(data_dir) if data_dir is not None else default_data_dir()
    return all(split_path(d, lang, s).exists() for lang in LANGS for s in SPLITS)


def load_split(
    data_dir: str | Path | None, lang: str, split: str, limit: int | None = None
) -> list[Record]:
    """Records of ``data/<lang>/<split>.jsonl`` in file order (optionally only the first ``limit``)."""
    path = split_path(data_dir if data_dir is not None else default_data_dir(), lang, split)
    if not path.exists():
        raise FileNotFoundError(
            f"{path} not found: build the corpora first with `python scripts/build_corpora.py`"
        )
    out: list[Record] = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            if line.strip():
                out.append(json.loads(line))
    return out


def source_counts(records: Iterable[Record]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        out[r["source"]] = out.get(r["source"], 0) + 1
    return dict(sorted(out.items()))


# ----------------------------------------------------------------------------- tokenisation


def packed_token_stream(
    records: Sequence[Record],
    tokenizer: Any,
    n_tokens: int,
    seed: int = 0,
    mix: str = "proportional",
    separator: int | None = None,
) -> tuple[list[int], dict[str, int]]:
    """Seeded sample of paragraphs across sources, tokenised and concatenated (``separator`` between
    paragraphs, defaults to the tokenizer's EOS) until ``n_tokens`` tokens. Returns the ids and the
    number of tokens taken from each source. Raises if the records hold fewer tokens."""
    if n_tokens <= 0:
        raise ValueError("n_tokens must be positive")
    sep = eos_id(tokenizer) if separator is None else separator
    ids: list[int] = []
    per_src: dict[str, int] = {}
    for r in shuffled(records, seed, mix):
        toks = encode(tokenizer, r["text"])
        if sep is not None:
            toks = toks + [sep]
        take = toks[: n_tokens - len(ids)]
        ids.extend(take)
        per_src[r["source"]] = per_src.get(r["source"], 0) + len(take)
        if len(ids) >= n_tokens:
            return ids, dict(sorted(per_src.items()))
    raise ValueError(f"records hold only {len(ids)} tokens, {n_tokens} requested")


def windows(ids: Sequence[int], seq_len: int, drop_last: bool = False) -> list[list[int]]:
    """Cut a token stream into consecutive windows of ``seq_len`` (the last may be shorter)."""
    if seq_len < 2:
        raise ValueError("seq_len must be >= 2")
    out = [list(ids[i : i + seq_len]) for i in range(0, len(ids), seq_len)]
    if out and (drop_last and len(out[-1]) < seq_len or len(out[-1]) < 2):
        out.pop()
    return out


def calibration_dataset(
    records_by_lang: Mapping[str, Sequence[Record]],
    tokenizer: Any,
    tokens_per_lang: int | Mapping[str, int],
    seq_len: int = 256,
    seed: int = 0,
    mix: str = "proportional",
    with_meta: bool = False,
):
    """A ``datasets.Dataset`` of ``input_ids`` / ``attention_mask`` windows (``seq_len`` tokens each,
    the last of a language possibly shorter) holding ``tokens_per_lang`` tokens per language, sampled
    with ``seed`` across every source of that language (not the first N tokens of the file).

    Windows never mix languages; rows are ordered by language in the mapping's order. With
    ``with_meta`` the rows also carry ``lang`` and ``source_tokens`` (JSON) columns -- drop them
    before handing the set to ``oneshot``. ``dataset.info.description`` records the per-source token
    counts either way.
    """
    from datasets import Dataset

    rows: dict[str, list] = {"input_ids": [], "attention_mask": []}
    if with_meta:
        rows["lang"] = []
        rows["source_tokens"] = []
    meta: dict[str, dict[str, int]] = {}
    for k, (lang, recs) in enumerate(records_by_lang.items()):
        n = tokens_per_lang[lang] if isinstance(tokens_per_lang, Mapping) else tokens_per_lang
        ids, per_src = packed_token_stream(recs, tokenizer, n, seed=seed + 1009 * k, mix=mix)
        meta[lang] = per_src
        for w in windows(ids, seq_len):
            rows["input_ids"].append(w)
            rows["attention_mask"].append([1] * len(w))
            if with_meta:
                rows["lang"].append(lang)
                rows["source_tokens"].append(json.dumps(per_src))
    ds = Dataset.from_dict(rows)
    ds.info.description = json.dumps({"seed": seed, "seq_len": seq_len, "source_tokens": meta})
    return ds


def eval_windows(
    records: Sequence[Record], tokenizer: Any, n_windows: int, seq_len: int = 256, seed: int = 1234
):
    """``n_windows`` full windows of ``seq_len`` token ids (a ``torch.LongTensor`` [n, seq_len]) from a
    seeded sample of paragraphs across sources, for held-out NLL / perplexity: the windows
    ``reap eval`` samples (:func:`reap_modifier.evaluation.texts.sample_windows`)."""
    return sample_windows(records, tokenizer, n_windows, seq_len, seed)


def development_records(
    records: Sequence[Record],
    tokenizer: Any,
    exclude_windows: int = 64,
    exclude_seq_len: int = 256,
    exclude_seed: int = 1234,
) -> list[Record]:
    """The development split: the paragraphs of the eval split that the evaluation windows
    (:func:`eval_windows` of ``exclude_windows`` x ``exclude_seq_len`` tokens, seed
    ``exclude_seed``: the main job's and the model card's) never read. In the windows' seeded
    paragraph order, the windows read a prefix (the last paragraph of it perhaps in part); the
    development split is every paragraph after that prefix, so no paragraph lends text to both.
    Raises when the evaluation windows read every paragraph."""
    need = exclude_windows * exclude_seq_len
    sep = eos_id(tokenizer)
    order = shuffled(records, exclude_seed)
    n = 0
    for i, r in enumerate(order):
        n += len(encode(tokenizer, r["text"])) + (sep is not None)
        if n >= need:
            if i + 1 == len(order):
                break
            return order[i + 1 :]
    raise ValueError(
        f"the evaluation windows ({exclude_windows} x {exclude_seq_len} tokens) read every"
        " paragraph of the eval split: no development split is left"
    )


def dev_windows(
    records: Sequence[Record],
    tokenizer: Any,
    n_windows: int,
    seq_len: int = 256,
    seed: int = 4242,
    *,
    exclude: tuple[int, int, int] = (64, 256, 1234),
):
    """``n_windows`` windows of ``seq_len`` token ids from the development split
    (:func:`development_records` of the eval split ``records``, the evaluation windows
    ``exclude`` = (windows, tokens, seed) left out), seeded like :func:`eval_windows`: the
    windows that choose methods and settings, disjoint from the windows the final tables
    report."""
    return sample_windows(
        development_records(records, tokenizer, *exclude), tokenizer, n_windows, seq_len, seed
    )


def tokenize_all(
    records: Sequence[Record], tokenizer: Any, separator: int | None = None, batch_size: int = 2048
) -> list[int]:
    """All records concatenated in order (``separator`` after each), for training streams.
    Uses batch encoding when the tokenizer is a ``tokenizers.Tokenizer``."""
    sep = eos_id(tokenizer) if separator is None else separator
    out: list[int] = []
    fast = getattr(tokenizer, "encode_batch", None)
    texts = [r["text"] for r in records]
    if fast is not None and hasattr(tokenizer, "token_to_id"):
        for i in range(0, len(texts), batch_size):
            for enc in tokenizer.encode_batch(texts[i : i + batch_size], add_special_tokens=False):
                out.extend(enc.ids)
                if sep is not None:
                    out.append(sep)
        return out
    for t in texts:
        out.extend(encode(tokenizer, t))
        if sep is not None:
            out.append(sep)
    return out


__all__ = [
    "LANGS",
    "SPLITS",
    "Record",
    "ascii_fraction",
    "calibration_dataset",
    "chunk_code",
    "cjk_fraction",
    "clean_zh_tagged",
    "corpora_available",
    "default_data_dir",
    "dev_windows",
    "development_records",
    "encode",
    "eos_id",
    "eval_windows",
    "html_paragraphs",
    "keep_paragraph",
    "load_split",
    "normalize_ws",
    "packed_token_stream",
    "shuffled",
    "source_counts",
    "split_of_chunk",
    "split_path",
    "split_records",
    "text_paragraphs",
    "tokenize_all",
    "windows",
]
