"""``reap prune`` / ``reap verify`` on GGUF files through the CLI: exit codes, one-line
errors with nothing written, and verify's slab-by-slab comparison with the source, which
fails on one changed byte of a kept expert, a changed key, or a file from another source."""

from __future__ import annotations

import json

import pytest
from badinput import cli as run_cli
from gguf_oracle import field_values
from gguf_synth import write_imatrix, write_moe, write_plan


@pytest.fixture
def pruned(tmp_path):
    src = write_moe(tmp_path / "src.gguf", expert_type="Q4_K")
    plan = write_plan(tmp_path / "plan.json")
    out = tmp_path / "out.gguf"
    res = run_cli("prune", src, "--plan", plan, "-o", out, "-q")
    assert res.exit_code == 0, res.output
    assert res.stdout.strip().endswith("out.gguf")
    return src, out, plan


def test_verify_ok_against_the_source(pruned):
    src, out, _ = pruned
    res = run_cli("verify", out, "--source", src, "-q")
    assert res.exit_code == 0, res.output
    assert "OK (2 MoE layers x 4 experts" in res.stdout
    assert "sha256-equal to the source" in res.stdout
    res = run_cli("verify", out, "-q")
    assert res.exit_code == 0, res.output


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_verify_fails_on_a_changed_kept_slab(pruned):
    import gguf

    src, out, _ = pruned
    t = next(t for t in gguf.GGUFReader(out).tensors if t.name == "blk.1.ffn_down_exps.weight")
    _flip(out, int(t.data_offset) + int(t.n_bytes) - 1)  # the last kept expert's last byte
    res = run_cli("verify", out, "--source", src, "-q")
    assert res.exit_code == 1
    assert (
        "blk.1.ffn_down_exps.weight: sha256 differs from the source's (its kept experts' slabs)"
        in res.output
    )


def test_verify_fails_on_another_source(pruned, tmp_path):
    _, out, _ = pruned
    other = write_moe(tmp_path / "other.gguf", expert_type="Q4_K", seed=7)
    res = run_cli("verify", out, "--source", other, "-q")
    assert res.exit_code == 1
    assert "sha256 differs" in res.output


def test_verify_fails_on_a_changed_key(pruned, tmp_path):
    src, out, _ = pruned
    data = out.read_bytes()
    # the embedding length (256) written as 255: same size, another value
    key = b"deepseek2.embedding_length"
    at = data.index(key) + len(key) + 4
    assert data[at : at + 4] == (256).to_bytes(4, "little")
    out.write_bytes(data[:at] + (255).to_bytes(4, "little") + data[at + 4 :])
    res = run_cli("verify", out, "--source", src, "-q")
    assert res.exit_code == 1
    assert "key deepseek2.embedding_length differs from the source" in res.output


def test_verify_without_provenance_checks_shapes_only(tmp_path, pruned):
    src, _, plan = pruned
    bare = tmp_path / "bare.gguf"
    assert run_cli("prune", src, "--plan", plan, "-o", bare, "--no-provenance", "-q").exit_code == 0
    assert not any(k.startswith("reap.") for k in field_values(bare))
    res = run_cli("verify", bare, "-q")
    assert res.exit_code == 0 and "checked its shapes only" in res.output
    res = run_cli("verify", bare, "--source", src, "-q")
    assert res.exit_code == 1 and "cannot be compared" in res.output


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--keep", "4"], "--keep / --sparsity / --divisible-by cut a plan from --scores"),
        (["--no-hash-source"], "--no-hash-source apply to safetensors checkpoints"),
        (["--imatrix", "x.gguf"], "give both --imatrix"),
        (["--extra-layers", "nope"], "--extra-layers must be"),
    ],
)
def test_cli_bad_input_exits_2_and_writes_nothing(pruned, tmp_path, extra, message):
    src, _, plan = pruned
    before = sorted(p.name for p in tmp_path.iterdir())
    res = run_cli("prune", src, "--plan", plan, "-o", tmp_path / "new.gguf", *extra)
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_cli_refuses_keep_below_top_k_from_a_plan(tmp_path):
    src = write_moe(tmp_path / "src.gguf", used=4)
    kept = {"model.layers.0.mlp": [0, 1], "model.layers.1.mlp": [0, 1]}
    plan = write_plan(tmp_path / "plan.json", kept)
    res = run_cli("prune", src, "--plan", plan, "-o", tmp_path / "o.gguf")
    assert res.exit_code == 2
    assert "keep at least 4" in res.output
    assert not (tmp_path / "o.gguf").exists()


def test_cli_imatrix_and_output_name(pruned, tmp_path):
    src, _, plan = pruned
    imx = write_imatrix(tmp_path / "imatrix.gguf")
    res = run_cli("prune", src, "--plan", plan, "-o", tmp_path / "o.bin", "-q")
    assert res.exit_code == 2 and "give the output a .gguf name" in res.output
    res = run_cli(
        "prune", src, "--plan", plan, "-o", tmp_path / "p.gguf", "--imatrix", imx,
        "--imatrix-out", tmp_path / "p.imatrix.gguf", "-q",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert (tmp_path / "p.imatrix.gguf").is_file()
    assert not [p for p in tmp_path.iterdir() if ".reap-" in p.name]


def test_scores_cut_against_the_gguf(tmp_path):
    from scores_synth import from_saliency

    src = write_moe(tmp_path / "src.gguf", used=2, groups=(2, 1))
    saliency = {
        "model.layers.0.mlp": [8, 1, 7, 2, 6, 3, 5, 4],
        "model.layers.1.mlp": [1, 2, 3, 4, 5, 6, 7, 8],
    }
    scores = from_saliency(saliency, metadata={"top_k": 2}).save(tmp_path / "scores.safetensors")
    res = run_cli(
        "prune", src, "--scores", scores, "--keep", "4", "-o", tmp_path / "o.gguf",
        "--save-plan", tmp_path / "plan.json", "-q",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    values = field_values(tmp_path / "o.gguf")
    # two groups of 4 (expert_group_count = 2): the two best of each group
    assert values["reap.kept_experts.0"] == [0, 2, 4, 6]
    assert values["reap.kept_experts.1"] == [2, 3, 6, 7]
    assert json.loads((tmp_path / "plan.json").read_text())["kept"]["model.layers.1.mlp"] == [
        2,
        3,
        6,
        7,
    ]
    wrong = from_saliency({"model.layers.0.mlp": [1.0] * 16}, metadata={"top_k": 2})
    wrong.save(tmp_path / "wrong.safetensors")
    res = run_cli(
        "prune",
        src,
        "--scores",
        tmp_path / "wrong.safetensors",
        "--keep",
        "4",
        "-o",
        tmp_path / "w.gguf",
    )
    assert res.exit_code == 2 and "16" in res.output and not (tmp_path / "w.gguf").exists()


@pytest.mark.parametrize("where", ["mid-write", "before-rename"])
def test_interrupt_leaves_nothing_and_keeps_the_previous_output(
    pruned, tmp_path, monkeypatch, where
):
    """Ctrl-C while writing (or with the output complete, before the rename) exits 130;
    the previous output is untouched and no temporary file is left."""
    import reap_modifier.gguf.rewrite as rewrite

    src, _, plan = pruned
    dst = tmp_path / "again.gguf"
    dst.write_bytes(b"previous output")
    if where == "mid-write":
        real = rewrite.write_part  # the first kernel copy done, then Ctrl-C

        def write_part(out, source, version, fields, tensors, align, progress=None):
            return real(out, source, version, fields, tensors, align, _raise)

        monkeypatch.setattr(rewrite, "write_part", write_part)
    else:

        def pause_point(point, index=None):
            if point == "rename":
                raise KeyboardInterrupt

        monkeypatch.setattr(rewrite, "pause_point", pause_point)
    before = sorted(p.name for p in tmp_path.iterdir())
    res = run_cli("prune", src, "--plan", plan, "-o", dst, "--force", "-q")
    assert res.exit_code == 130, res.output
    assert "interrupted" in res.output
    assert dst.read_bytes() == b"previous output"
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def _raise(n):
    raise KeyboardInterrupt
