"""``reap eval`` on the command line: the main table on stdout, eval.json / eval.md / eval.png
under -o, and bad input refused with exit code 2 and one line saying what to change -- before
any model loads."""

from __future__ import annotations

import json
import shutil

import pytest
from eval_models import KEPT, prune, save_tiny, write_text
from typer.testing import CliRunner

from reap_modifier.cli import app

SMALL = ["--windows", "3", "--window-tokens", "16", "--prompts", "1", "--prompt-tokens", "4",
         "--gen-tokens", "5"]  # fmt: skip


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_cli")
    src = save_tiny("qwen3_moe", root / "src")
    pruned = prune(src, root / "pruned", KEPT["qwen3_moe"])
    return {
        "root": root,
        "src": str(src),
        "pruned": str(pruned),
        "en": str(write_text(root / "en.txt", seed=1)),
        "zh": str(write_text(root / "zh.jsonl", seed=2, kind="jsonl")),
    }


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if any model loads (bad input must be refused before)."""
    import reap_modifier.evaluation.run as R

    def boom(path, *args):
        raise AssertionError(f"a model loaded: {path}")

    monkeypatch.setattr(R, "_load_model", boom)


def run(*args):
    """``reap eval ARGS``; ``.stdout`` and ``.stderr`` apart, ``.output`` both."""
    return CliRunner().invoke(app, ["eval", *map(str, args)], env={"COLUMNS": "240"})


def test_table_on_stdout_and_files_under_out(env, tmp_path):
    r = run(env["src"], env["pruned"], "--text", f"en={env['en']}", "--text", f"zh={env['zh']}",
            *SMALL, "--dtype", "float32", "-o", tmp_path / "o")  # fmt: skip
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "o" / "eval.json").read_text())
    for label in ("en", "zh"):
        m = res["models"][env["pruned"]][label]  # keyed by the path as given
        assert f"| {env['pruned']} | {label} | {m['nll']:.4f} ± {m['nll_se']:.4f}" in r.stdout
        assert 0 <= m["top1"] <= 1 and m["kl"] > 0 and m["repeat_run_max"] >= 1
    assert res["models"][env["src"]]["en"]["kl"] is None
    assert res["dtype"] == "float32" and res["backend"] == "transformers"
    assert (tmp_path / "o" / "eval.md").is_file() and (tmp_path / "o" / "eval.png").is_file()
    assert res["command"].startswith("reap ")


def test_without_out_nothing_is_written(env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = run(env["src"], env["pruned"], "--text", f"en={env['en']}", *SMALL)
    assert r.exit_code == 0, r.output
    assert "| model | text | NLL ± se |" in r.stdout
    assert list(tmp_path.iterdir()) == []


def _other_tokenizer(env, tmp_path):
    """Same vocabulary size, other tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    dst = tmp_path / "other_tok"
    shutil.copytree(env["pruned"], dst)
    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0", eos_token="w1").save_pretrained(
        dst
    )
    return dst


@pytest.mark.parametrize(
    "case",
    ["tokenizer", "vocab", "empty", "short", "twice", "missing_ckpt", "no_config", "bad_text_arg",
     "unknown_ext", "no_field", "dup_ckpt", "backend", "dtype"],
)  # fmt: skip
def test_bad_input_exits_2_before_any_model_loads(case, env, tmp_path, no_model_loads):
    text = ["--text", f"en={env['en']}"]
    cands = [env["pruned"]]
    want = None
    if case == "tokenizer":
        cands, want = [_other_tokenizer(env, tmp_path)], "tokenizer differs from the reference's"
    elif case == "vocab":
        dst = tmp_path / "v"
        shutil.copytree(env["pruned"], dst)
        cfg = json.loads((dst / "config.json").read_text())
        cfg["vocab_size"] = 256
        (dst / "config.json").write_text(json.dumps(cfg))
        cands, want = [dst], "vocabulary size 256 differs"
    elif case == "empty":
        (tmp_path / "e.txt").write_text("\n\n  \n")
        text, want = ["--text", f"en={tmp_path / 'e.txt'}"], "holds no text"
    elif case == "short":
        (tmp_path / "s.txt").write_text("t2 t3 t4 t5\n")
        text, want = ["--text", f"en={tmp_path / 's.txt'}"], "fewer than one window x 16"
    elif case == "twice":
        text += ["--text", f"en={env['zh']}"]
        want = "label 'en' is given twice"
    elif case == "missing_ckpt":
        cands, want = [tmp_path / "nope"], f"{tmp_path / 'nope'}: not a checkpoint directory"
    elif case == "no_config":
        (tmp_path / "d").mkdir()
        cands, want = [tmp_path / "d"], f"{tmp_path / 'd'}: no config.json"
    elif case == "bad_text_arg":
        text, want = ["--text", env["en"]], "--text expects LABEL=PATH"
    elif case == "unknown_ext":
        (tmp_path / "x.docx").write_text("t2")
        text, want = ["--text", f"en={tmp_path / 'x.docx'}"], "unknown text format '.docx'"
    elif case == "no_field":
        text, want = ["--text", f"en={env['zh']}", "--text-field", "body"], "no 'body' field"
    elif case == "dup_ckpt":
        cands, want = [env["src"]], "is given twice"
    elif case == "backend":  # a usage error: click names the choices
        text, want = text + ["--backend", "tgi"], "'tgi' is not one of 'transformers', 'vllm'"
    elif case == "dtype":
        text, want = text + ["--dtype", "fp8"], "'fp8' is not one of 'auto', 'float32'"
    r = run(env["src"], *cands, *text, *SMALL)
    assert r.exit_code == 2, r.output
    assert want in " ".join(r.output.split()), r.output
    usage = case in ("backend", "dtype")
    assert r.output.strip().startswith("Usage:" if usage else "error:"), r.output
    assert "Traceback" not in r.output


def test_a_checkpoint_that_does_not_load_is_named(env, tmp_path):
    dst = tmp_path / "torn"
    shutil.copytree(env["pruned"], dst)
    (dst / "model.safetensors").write_bytes(b"not safetensors")
    r = run(env["src"], dst, "--text", f"en={env['en']}", *SMALL)
    assert r.exit_code == 2, r.output
    assert f"{dst}: transformers could not load the checkpoint" in " ".join(r.output.split())


def test_vllm_missing_exits_2_and_says_how_to_get_it(env, tmp_path, no_model_loads):
    r = run(env["src"], env["pruned"], "--text", f"en={env['en']}", *SMALL, "--backend", "vllm",
            "--vllm-python", tmp_path / "no-python")  # fmt: skip
    assert r.exit_code == 2, r.output
    out = " ".join(r.output.split())
    assert "no Python with vLLM" in out and "scripts/vllm_venv.sh" in out


def test_lm_eval_unknown_task_exits_2(env, tmp_path, no_model_loads):
    pytest.importorskip("lm_eval")
    r = run(env["src"], env["pruned"], "--text", f"en={env['en']}", *SMALL, "--lm-eval",
            "no_such_task_xyz")  # fmt: skip
    assert r.exit_code == 2, r.output
    assert "unknown lm-eval task 'no_such_task_xyz'" in r.output
