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
    # stdout is the markdown table alone: header, rule, one row per model and text
    lines = r.stdout.splitlines()
    assert len(lines) == 2 + 2 * 2 and all(
        x.startswith("| ") or x.startswith("|---") for x in lines
    )
    assert "greedy generation" in r.stderr and "wrote " in r.stderr  # progress and logs


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


# ----------------------------------------------------------------------------- outputs, stdout


@pytest.mark.parametrize("case", ["o_file", "o_under_file", "cache_file", "work_dir_under_file"])
def test_output_paths_are_checked_before_any_model_loads(case, env, tmp_path, no_model_loads):
    f = tmp_path / "a-file"
    f.write_text("keep me")
    flag, path, want = {
        "o_file": ("-o", f, f"{f} is a file, not a directory"),
        "o_under_file": ("-o", f / "out", f"{f} is a file, so {f / 'out'} cannot be"),
        "cache_file": ("--reference-cache", f, f"{f} is a file, not a directory"),
        "work_dir_under_file": ("--vllm-work-dir", f / "logs", f"{f} is a file, so"),
    }[case]
    r = run(env["src"], env["pruned"], "--text", f"en={env['en']}", *SMALL, flag, path)
    assert r.exit_code == 2, r.output
    line = " ".join(r.output.split())
    assert line.startswith(f"error: {flag} {path}: {want}"), line
    assert line.endswith(f"give {flag} a directory you can write"), line
    assert "Traceback" not in r.output and f.read_text() == "keep me"


def test_an_unwritable_o_is_refused_before_any_model_loads(env, no_model_loads):
    from badinput import unprivileged, world_scratch

    with world_scratch() as d:
        (d / "ro").mkdir()
        (d / "ro").chmod(0o555)
        with unprivileged():
            r = run(env["src"], env["pruned"], "--text", f"en={env['en']}", *SMALL,
                    "-o", d / "ro" / "eval")  # fmt: skip
        assert r.exit_code == 2, r.output
        assert f"error: -o {d / 'ro' / 'eval'}: {d / 'ro'} is not writable" in r.output
        assert list((d / "ro").iterdir()) == []


def test_a_cached_reference_kl_is_labelled_an_estimate_everywhere(env, tmp_path, monkeypatch):
    import matplotlib.axes

    titles = []
    real = matplotlib.axes.Axes.set_title
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "set_title",
        lambda ax, t, *a, **k: titles.append(t) or real(ax, t, *a, **k),
    )
    args = [env["src"], env["pruned"], "--text", f"en={env['en']}", *SMALL,
            "--reference-cache", tmp_path / "cache"]  # fmt: skip
    exact = run(*args, "-o", tmp_path / "exact")
    assert exact.exit_code == 0, exact.output
    assert "| top-1 | KL | repeat" in exact.stdout and "estimate" not in exact.stdout
    est = run(*args, "-o", tmp_path / "est")
    assert est.exit_code == 0, est.output
    label = "KL (top-20 estimate, lower bound)"
    assert f"| top-1 | {label} | repeat" in est.stdout
    res = json.loads((tmp_path / "est" / "eval.json").read_text())
    assert (
        res["kl_exact"] is False
        and json.loads((tmp_path / "exact" / "eval.json").read_text())["kl_exact"]
    )
    m = res["models"][env["pruned"]]["en"]
    cell = f"| {m['kl']:.4f} (tail {100 * m['kl_tail_mass']:.0f}%) |"
    assert cell in est.stdout and 0 < m["kl_tail_mass"] < 1
    md = (tmp_path / "est" / "eval.md").read_text()
    assert f"| {label} |" in md and cell in md
    assert any(
        label.replace("KL", "KL(reference || candidate) (nats/token)", 1) == t for t in titles
    )


def test_a_short_text_uses_the_windows_it_holds(env, tmp_path):
    # 5 paragraphs of 9 tokens + the end-of-text separator: 50 tokens, 3 windows of 16
    paras = [" ".join(f"t{2 + (7 * p + i) % 120}" for i in range(9)) for p in range(5)]
    (tmp_path / "short.txt").write_text("\n\n".join(paras) + "\n")
    r = run(env["src"], env["pruned"], "--text", f"en={tmp_path / 'short.txt'}",
            "--windows", "64", "--window-tokens", "16", "--prompts", "0", "--device", "cpu",
            "-o", tmp_path / "o")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "warning: en: " in r.stderr
    assert "holds 3 windows of 16 tokens; using 3 of the 64 windows asked" in r.stderr
    res = json.loads((tmp_path / "o" / "eval.json").read_text())
    assert res["texts"]["en"]["windows"] == 3 and res["texts"]["en"]["predicted_tokens"] == 45
    assert res["warnings"] == [
        f"en: {tmp_path / 'short.txt'} holds 3 windows of 16 tokens; using 3 of the 64 windows asked"
    ]
    assert "Warning: en:" in (tmp_path / "o" / "eval.md").read_text()


@pytest.mark.parametrize("device", ["tpu", "cuda", "cuda:x", "gpu:0", "cuda-vllm"])
def test_a_bad_device_is_refused_before_any_model_loads(device, env, no_model_loads):
    import torch

    extra = []
    if device == "cuda":
        if torch.cuda.is_available():
            device = f"cuda:{torch.cuda.device_count()}"
            want = f"--device {device}: this machine has {torch.cuda.device_count()} GPU(s)"
        else:
            want = "--device cuda: CUDA is not available"
    elif device == "cuda-vllm":
        device, extra = "cuda", ["--backend", "vllm"]
        want = "--device places the transformers backend; vLLM places the model itself"
    else:
        want = f"--device must be cpu, cuda, cuda:N or auto, got '{device}'"
    r = run(env["src"], env["pruned"], "--text", f"en={env['en']}", *SMALL, "--device", device,
            *extra)  # fmt: skip
    assert r.exit_code == 2, r.output
    assert " ".join(r.output.split()).startswith(f"error: {want}"), r.output


def test_files_are_written_with_the_umask(env, tmp_path):
    import os

    old = os.umask(0o027)
    try:
        r = run(env["src"], env["pruned"], "--text", f"en={env['en']}", *SMALL,
                "-o", tmp_path / "o", "--reference-cache", tmp_path / "c")  # fmt: skip
    finally:
        os.umask(old)
    assert r.exit_code == 0, r.output
    written = [*(tmp_path / "o").iterdir(), *(tmp_path / "c").iterdir()]
    assert sorted(p.name for p in written) == [
        "eval.json", "eval.md", "eval.png", "reference.json", "reference.safetensors"
    ]  # fmt: skip
    assert {oct(p.stat().st_mode & 0o777) for p in written} == {oct(0o640)}
