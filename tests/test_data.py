"""Corpus helpers: filters, extraction, the deterministic split, loading, calibration
sampling across sources and evaluation windows -- on small in-memory fixtures; plus a few checks of
the real built corpora when ``data/`` exists (skipped otherwise)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from eval_helpers import load_texts

from reap_modifier.demo import data as D

REPO = Path(__file__).resolve().parents[1]


def char_tok(text: str) -> list[int]:
    """A toy tokenizer: one id per character (ids 2..251; 0 is the separator below)."""
    return [2 + ord(c) % 250 for c in text]


def fixture_records(n_per_source: int = 40) -> list[dict]:
    """Three sources, in file order: all of A, then B, then C (like a corpus built source by source)."""
    recs = []
    for src, word in (("A", "alpha"), ("B", "bravo"), ("C", "charlie")):
        for i in range(n_per_source):
            recs.append(
                {
                    "text": f"{word} paragraph {i} " + "x" * (i % 7),
                    "source": src,
                    "doc": f"{src}:{i}",
                }
            )
    return recs


# ----------------------------------------------------------------------------- filters


EN_PROSE = "The quick brown fox jumps over the lazy dog while the farmer watches from the porch."


def test_english_filter():
    assert D.keep_paragraph(EN_PROSE, "en")
    assert not D.keep_paragraph("Too short to count as prose.", "en")  # < 60 chars
    assert not D.keep_paragraph(EN_PROSE + " 这是中文。", "en")  # not mostly ASCII / has CJK
    assert not D.keep_paragraph(
        "x = [1, 2, 3]; y = {k: v for k, v in z.items()}; f(x, y) == 0 or -1 >>> 2", "en"
    )
    assert not D.keep_paragraph("a" * 80, "en")  # one 'word'


def test_chinese_filter():
    assert D.keep_paragraph("今天天气很好，我们一起去公园散步吧，然后回家吃饭。", "zh")
    assert not D.keep_paragraph("今天天气很好。", "zh")  # < 20 chars
    # 20+ chars but < 30% CJK ideographs
    assert not D.keep_paragraph("use the option --verbose to see 更多 output here", "zh")
    # mixed but >= 30% CJK is kept (man pages mix commands into Chinese prose)
    assert D.keep_paragraph("使用 apt-get install 命令来安装软件包，这是最常用的方法。", "zh")


def test_code_filter_and_unknown_language():
    assert D.keep_paragraph("def f(x):\n    return x + 1\n\n\nclass A:\n    pass\n" * 2, "code")
    assert not D.keep_paragraph("pass", "code")
    with pytest.raises(ValueError):
        D.keep_paragraph("text", "fr")


def test_cjk_fraction():
    assert D.cjk_fraction("中文") == 1.0
    assert D.cjk_fraction("ab中文") == 0.5
    assert D.cjk_fraction("") == 0.0


# ----------------------------------------------------------------------------- extraction


def test_clean_peoples_daily_line():
    line = "19980101-01-001-001/m  迈向/v  充满/v  希望/n  的/u  [中央/n  电视台/n]nt  。/w"
    assert D.clean_zh_tagged(line) == "迈向充满希望的中央电视台。"
    assert D.clean_zh_tagged("") == ""


def test_html_paragraphs_drop_scripts_pre_and_join_cjk_lines():
    html = """<html><head><title>T</title><style>p {}</style></head><body>
    <h1>Heading</h1><p>First <b>bold</b>
       paragraph.</p><pre>code = 1</pre><script>var x;</script>
    <ul><li>item one</li><li>item two</li></ul>
    <p>中文段落
    第二行</p><div>a &amp; b</div></body></html>"""
    paras = D.html_paragraphs(html)
    assert paras == [
        "Heading",
        "First bold paragraph.",
        "item one",
        "item two",
        "中文段落第二行",
        "a & b",
    ]


def test_text_paragraphs():
    txt = "NAME\n   ls - list\n\nDESCRIPTION\n   List   information\n   about files.\n\n\n中文\n说明\n"
    assert D.text_paragraphs(txt) == [
        "NAME ls - list",
        "DESCRIPTION List information about files.",
        "中文说明",
    ]
    assert D.text_paragraphs("a\n\nb", blank_line_separated=False) == ["a b"]


def test_chunk_code_keeps_every_line_in_order_and_respects_size():
    src = "\n\n".join(
        f"def f{i}(x):\n"
        + "\n".join(f"    y{j} = x + {j}" for j in range(i % 9 + 1))
        + "\n    return x"
        for i in range(60)
    )
    chunks = D.chunk_code(src, max_chars=400)
    assert len(chunks) > 5
    assert all(len(c) <= 400 for c in chunks)
    lines = [ln for ln in src.split("\n") if ln.strip()]
    got = [ln for c in chunks for ln in c.split("\n") if ln.strip()]
    assert got == lines
    # a chunk starts at a top-level statement
    assert all(c.startswith("def ") for c in chunks)
    assert D.chunk_code("   \n\n") == []


# ----------------------------------------------------------------------------- split


def test_split_of_chunk():
    assert [D.split_of_chunk(i, 20) for i in (0, 1, 2, 19, 20, 21, 40)] == [
        "eval",
        "calib",
        "train",
        "train",
        "eval",
        "calib",
        "eval",
    ]


def test_split_records_by_chunks_is_deterministic_and_disjoint():
    recs = [{"text": f"p{i}", "source": "s", "doc": "d"} for i in range(100)]
    a = list(D.split_records(recs, chunk_size=3, modulus=5))
    b = list(D.split_records(recs, chunk_size=3, modulus=5))
    assert a == b
    assert [r["text"] for _, r in a] == [r["text"] for r in recs]  # every paragraph once, in order
    by = {s: [int(r["text"][1:]) for sp, r in a if sp == s] for s in D.SPLITS}
    assert by["eval"][:6] == [0, 1, 2, 15, 16, 17]  # chunks 0, 5, ... of 3 paragraphs
    assert by["calib"][:3] == [3, 4, 5]
    assert len(by["train"]) == 100 - len(by["eval"]) - len(by["calib"])
    with pytest.raises(ValueError):
        list(D.split_records(recs, chunk_size=0))


# ----------------------------------------------------------------------------- loading


def write_fixture_corpus(root: Path, recs_by_lang: dict[str, list[dict]]) -> Path:
    for lang in D.LANGS:
        (root / lang).mkdir(parents=True, exist_ok=True)
        recs = recs_by_lang.get(lang, [])
        splits = {s: [] for s in D.SPLITS}
        for sp, r in D.split_records(recs, chunk_size=2, modulus=20):
            splits[sp].append(r)
        for s in D.SPLITS:
            (root / lang / f"{s}.jsonl").write_text(
                "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in splits[s]),
                encoding="utf-8",
            )
    return root


def test_load_split_roundtrip_and_missing(tmp_path):
    write_fixture_corpus(tmp_path, {"en": fixture_records(20)})
    assert D.corpora_available(tmp_path)
    ev = D.load_split(tmp_path, "en", "eval")
    tr = D.load_split(tmp_path, "en", "train")
    assert ev and tr and not ({r["text"] for r in ev} & {r["text"] for r in tr})
    assert D.load_split(tmp_path, "en", "train", limit=3) == tr[:3]
    assert load_texts(tmp_path, "en", "eval") == [r["text"] for r in ev]
    with pytest.raises(FileNotFoundError, match="build_corpora"):
        D.load_split(tmp_path / "nope", "en", "train")
    with pytest.raises(ValueError):
        D.load_split(tmp_path, "en", "test")


# ----------------------------------------------------------------------------- sampling


def test_packed_stream_samples_across_sources_not_the_first_tokens():
    recs = fixture_records(40)
    ids, per_src = D.packed_token_stream(recs, char_tok, 600, seed=0, separator=0)
    assert len(ids) == 600
    assert sum(per_src.values()) == 600
    assert set(per_src) == {"A", "B", "C"}  # the first 600 tokens in file order are all source A
    first = []
    for r in recs:
        first += char_tok(r["text"]) + [0]
    assert ids != first[:600]


def test_packed_stream_determinism_and_errors():
    recs = fixture_records(40)
    a, _ = D.packed_token_stream(recs, char_tok, 500, seed=3, separator=0)
    b, _ = D.packed_token_stream(recs, char_tok, 500, seed=3, separator=0)
    c, _ = D.packed_token_stream(recs, char_tok, 500, seed=4, separator=0)
    assert a == b and a != c
    with pytest.raises(ValueError, match="only"):
        D.packed_token_stream(recs[:2], char_tok, 10_000, separator=0)


def test_balanced_mix_represents_small_sources():
    recs = fixture_records(60)[: 60 + 60 + 5]  # A: 60, B: 60, C: only 5 paragraphs
    _, prop = D.packed_token_stream(recs, char_tok, 400, seed=0, mix="proportional", separator=0)
    _, bal = D.packed_token_stream(recs, char_tok, 400, seed=0, mix="balanced", separator=0)
    assert bal.get("C", 0) > prop.get("C", 0)
    assert abs(bal["A"] - bal["B"]) < 60
    with pytest.raises(ValueError):
        D.shuffled(recs, 0, mix="nope")


def test_calibration_dataset_tokens_per_language_and_determinism():
    recs = {
        "en": fixture_records(40),
        "zh": [
            {
                "text": f"中文段落第{i}号，用来测试按来源抽样的校准数据。",
                "source": f"z{i % 3}",
                "doc": "d",
            }
            for i in range(60)
        ],
    }
    ds = D.calibration_dataset(
        recs, char_tok, tokens_per_lang=300, seq_len=64, seed=0, with_meta=True
    )
    assert set(ds.column_names) == {"input_ids", "attention_mask", "lang", "source_tokens"}
    for lang in recs:
        rows = [r for r in ds if r["lang"] == lang]
        assert sum(len(r["input_ids"]) for r in rows) == 300
        assert all(len(r["input_ids"]) <= 64 for r in rows)
        assert all(len(r["input_ids"]) == len(r["attention_mask"]) for r in rows)
        assert len(json.loads(rows[0]["source_tokens"])) == 3  # all three sources contribute
    meta = json.loads(ds.info.description)
    assert meta["seed"] == 0 and sum(meta["source_tokens"]["zh"].values()) == 300
    again = D.calibration_dataset(recs, char_tok, tokens_per_lang=300, seq_len=64, seed=0)
    other = D.calibration_dataset(recs, char_tok, tokens_per_lang=300, seq_len=64, seed=1)
    assert again.column_names == ["input_ids", "attention_mask"]
    assert again["input_ids"] == ds["input_ids"]
    assert other["input_ids"] != ds["input_ids"]
    per_lang = D.calibration_dataset(
        recs, char_tok, tokens_per_lang={"en": 100, "zh": 200}, seq_len=64
    )
    assert sum(len(x) for x in per_lang["input_ids"]) == 300


def test_eval_windows_shape_and_determinism():
    torch = pytest.importorskip("torch")
    recs = fixture_records(40)
    w = D.eval_windows(recs, char_tok, n_windows=5, seq_len=32, seed=1)
    assert tuple(w.shape) == (5, 32) and w.dtype == torch.long
    assert torch.equal(w, D.eval_windows(recs, char_tok, n_windows=5, seq_len=32, seed=1))
    assert D.windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert D.windows(list(range(10)), 4, drop_last=True) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_development_split_is_the_paragraphs_the_evaluation_windows_never_read():
    """The evaluation windows read a prefix of their seeded paragraph order; the development
    split is the rest of that order, and its windows are drawn from it alone."""
    from itertools import accumulate

    torch = pytest.importorskip("torch")
    recs = fixture_records(40)
    order = D.shuffled(recs, 1)
    ends = list(accumulate(len(r["text"]) for r in order))  # char_tok: one id per character
    k = next(i for i, e in enumerate(ends) if e >= 5 * 32) + 1  # paragraphs the windows read
    dev = D.development_records(recs, char_tok, 5, 32, 1)
    assert dev == order[k:] and len(dev) == len(recs) - k > 0
    read = [t for r in order[:k] for t in char_tok(r["text"])]
    assert D.eval_windows(recs, char_tok, 5, 32, seed=1).flatten().tolist() == read[: 5 * 32]
    w = D.dev_windows(recs, char_tok, 3, 16, seed=7, exclude=(5, 32, 1))
    dev_ids = [t for r in D.shuffled(dev, 7) for t in char_tok(r["text"])]
    assert w.flatten().tolist() == dev_ids[: 3 * 16]
    assert not {r["doc"] for r in order[:k]} & {r["doc"] for r in dev}
    with pytest.raises(ValueError, match="no development split is left"):
        D.development_records(recs, char_tok, 1000, 32, 1)
    assert torch.equal(w, D.dev_windows(recs, char_tok, 3, 16, seed=7, exclude=(5, 32, 1)))


def test_encode_accepts_tokenizers_and_transformers_tokenizers():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({"<eos>": 0, "a": 1, "b": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    assert D.encode(tk, "a b a") == [1, 2, 1]
    assert D.eos_id(tk) == 0
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="[UNK]")
    assert D.encode(fast, "b a") == [2, 1] and D.eos_id(fast) == 0
    assert D.tokenize_all([{"text": "a"}, {"text": "b b"}], tk) == [1, 0, 2, 2, 0]
    with pytest.raises(TypeError):
        D.encode(42, "a")


# ----------------------------------------------------------------------------- the build script


def _load_build_script():
    spec = importlib.util.spec_from_file_location(
        "build_corpora", REPO / "scripts" / "build_corpora.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["build_corpora"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_build_script_is_idempotent_without_network(tmp_path, capsys):
    mod = _load_build_script()
    for p in mod.outputs(tmp_path):
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("")
    assert mod.build(tmp_path) is False  # everything exists: no apt-get, no pip
    assert "already built" in capsys.readouterr().out


def test_build_script_reports_a_failing_command(tmp_path):
    mod = _load_build_script()
    with pytest.raises(mod.BuildError, match="failed"):
        mod.run([sys.executable, "-c", "import sys; sys.exit(3)"], what="probe")
    with pytest.raises(mod.BuildError, match="not found"):
        mod.run(["/nonexistent/apt-get-xyz"], what="probe")


# ----------------------------------------------------------------------------- the real corpora


def test_real_corpora_splits_are_disjoint_and_filtered(corpora):
    for lang in D.LANGS:
        ev = D.load_split(None, lang, "eval", limit=3000)
        cal = D.load_split(None, lang, "calib", limit=3000)
        tr = D.load_split(None, lang, "train", limit=20000)
        assert ev and cal and tr
        assert not ({r["text"] for r in ev} & {r["text"] for r in tr})
        assert not ({r["text"] for r in cal} & {r["text"] for r in tr})
        assert all(D.keep_paragraph(r["text"], lang) for r in ev[:500])
        if lang != "code":
            assert len(D.source_counts(ev)) >= 3  # several sources in the held-out split


def test_the_main_jobs_split_option_picks_evaluation_or_development_windows():
    """``DemoConfig.split``: ``eval`` gives :func:`eval_windows`, ``dev`` as many windows of the
    development split that leaves out exactly those evaluation windows."""
    torch = pytest.importorskip("torch")
    from reap_modifier.demo.config import DemoConfig
    from reap_modifier.demo.inputs import quality_windows

    recs = fixture_records(40)
    sizes = dict(eval_windows=4, eval_seq_len=16, eval_seed=3, dev_seed=5)
    ev = quality_windows(recs, char_tok, DemoConfig(**sizes))
    dev = quality_windows(recs, char_tok, DemoConfig(**sizes, split="dev"))
    assert torch.equal(ev, D.eval_windows(recs, char_tok, 4, 16, seed=3))
    assert torch.equal(dev, D.dev_windows(recs, char_tok, 4, 16, seed=5, exclude=(4, 16, 3)))
    with pytest.raises(ValueError, match="split must be"):
        quality_windows(recs, char_tok, DemoConfig(**sizes, split="test"))
