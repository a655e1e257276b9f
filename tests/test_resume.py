"""Resumable calibration (``checkpoint_dir``): a run killed (SIGKILL) while a layer
calibrates, while its checkpoint is written, or between layers, then rerun, gives the
same statistics (bit for bit) and kept experts as a run never interrupted, and resumes
after the last committed layer; another model, recipe, dataset or world size is refused.

The kills are deterministic: the run is a forked child that stops at a named point
(``REAP_TEST_PAUSE_AT=layer-saving:2``: it writes a marker and waits) and is killed
there. Reruns run in the test process. The tiny Qwen3-MoE has 4 decoder layers: the
sequential pipeline traces 5 subgraphs (layers), the last one the head.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import socket
import time
from pathlib import Path

import pytest
import torch
from conftest import calibrate, calibration_samples
from loguru import logger
from tiny_models import build_tiny, reload_class

from reap_modifier import REAPPruningModifier
from reap_modifier.calibration.checkpointing import CheckpointMismatch, unmatched_batches
from reap_modifier.scores import ExpertScores

FAMILY = "qwen3_moe"
LAYERS = 5  # subgraphs: 4 decoder layers and the head
FORK = multiprocessing.get_context("fork")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    model, info = build_tiny(FAMILY, seed=3, num_hidden_layers=4)
    model.save_pretrained(root / "src")
    other, _ = build_tiny(FAMILY, seed=4, num_hidden_layers=4)  # other weights
    other.save_pretrained(root / "other")
    config, _ = build_tiny(FAMILY, seed=3, num_hidden_layers=4, rms_norm_eps=1e-5)
    config.save_pretrained(root / "config")  # the same weights, another config
    samples = calibration_samples(info.vocab_size, n=4, seq=12)
    _run(root / "src", root / "reference", None, samples, info.vocab_size)
    return {"root": root, "info": info, "samples": samples}


def _run(
    src, out, checkpoint_dir, samples, vocab, family=FAMILY, pipeline_kw=None, **recipe
) -> dict:
    """One oneshot; the kept ids, the scores and the log lines about resuming."""
    out = Path(out)
    model = reload_class(family).from_pretrained(src).eval()
    recipe.setdefault("num_experts_to_keep", 4)
    modifier = REAPPruningModifier(
        scores_path=str(out / "scores.safetensors"),
        checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None,
        **recipe,
    )
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="INFO")
    try:
        calibrate(model, modifier, samples, vocab, pipeline="sequential", **(pipeline_kw or {}))
    finally:
        try:
            logger.remove(sink)
        except ValueError:  # data parallel: llm-compressor reconfigured the logger
            pass
    result = {"kept": modifier.plan.kept, "resumed": [x for x in lines if "resuming" in x]}
    (out / "result.json").write_text(json.dumps(result))
    if modifier.router_fit is not None:  # the post-cut step's record and kept tensors
        torch.save((modifier.router_fit, modifier._fitted_tensors), out / "post_cut.pt")
    return result


def _assert_same(out: Path, reference: Path) -> None:
    """Scores (every statistic, bit for bit) and kept ids equal those of the run written
    to ``reference``."""
    got = ExpertScores.load(out / "scores.safetensors")
    ref = ExpertScores.load(reference / "scores.safetensors")
    assert got.layer_names == ref.layer_names
    assert got.metadata["tokens"] == ref.metadata["tokens"]
    for layer, stats in ref.layers.items():
        assert set(got.layers[layer]) == set(stats)
        for stat, tensor in stats.items():
            assert torch.equal(got.layers[layer][stat], tensor), f"{layer}::{stat}"
    kept = json.loads((reference / "result.json").read_text())["kept"]
    assert json.loads((out / "result.json").read_text())["kept"] == kept


def _paused_child(target, args, pause: str, marker: Path, env: dict | None = None):
    """Start ``target(*args)`` in a forked child that stops at ``pause``; return it
    once it is there."""

    def child():
        os.environ.update(env or {})
        os.environ["REAP_TEST_PAUSE_AT"] = pause
        os.environ["REAP_TEST_PAUSE_FILE"] = str(marker)
        target(*args)

    proc = FORK.Process(target=child)
    proc.start()
    return proc


def _wait_for(markers: list[Path], procs) -> None:
    """Until every marker exists (a child that ends first fails the test)."""
    while not all(m.exists() for m in markers):
        dead = [p for p in procs if not p.is_alive()]
        assert not dead, f"a run ended (exit {dead[0].exitcode}) before its pause point"
        time.sleep(0.01)


def _kill(procs) -> None:
    for proc in procs:
        os.kill(proc.pid, signal.SIGKILL)
    for proc in procs:
        proc.join()
        assert proc.exitcode == -signal.SIGKILL


# -- kill, rerun, same result ------------------------------------------------------------


@pytest.mark.parametrize(
    ("pause", "resumed"),
    [
        ("layer-calibrating:1", 0),  # nothing committed: the rerun starts over
        ("layer-calibrating:3", 2),
        ("layer-saving:2", 1),  # layer 2's file written, not committed
        ("layer-saving:5", 4),  # the last layer's statistics, not committed
        ("between-layers:1", 1),
        ("between-layers:3", 3),
    ],
)
def test_killed_run_resumes_to_identical_scores(setup, tmp_path, capfd, pause, resumed):
    root, info, samples = setup["root"], setup["info"], setup["samples"]
    ckpt = tmp_path / "ckpt"
    marker = tmp_path / "paused"
    args = (root / "src", tmp_path / "killed", ckpt, samples, info.vocab_size)
    proc = _paused_child(_run, args, pause, marker)
    _wait_for([marker], [proc])
    _kill([proc])
    assert not (tmp_path / "killed" / "scores.safetensors").exists()
    capfd.readouterr()  # the killed run's output
    # a file cut short by a kill during the write never counts
    ckpt.mkdir(exist_ok=True)
    (ckpt / f".rank0-layer{resumed + 1}.pt.x1y2z3.tmp").write_bytes(b"PK\x03\x04 cut short")
    (ckpt / ".state.json.a1b2c3.tmp").write_text('{"format": 1, "done"')

    rerun = _run(root / "src", tmp_path / "rerun", ckpt, samples, info.vocab_size)
    _assert_same(tmp_path / "rerun", root / "reference")
    if resumed:
        (line,) = rerun["resumed"]
        print(line)  # the time saved: layers skipped
        assert f"resuming after layer {resumed} of {LAYERS} from {ckpt}" in line
        assert f"({resumed} layers skipped" in line
    else:
        assert rerun["resumed"] == []
    assert _progress(capfd) == [(k, resumed) for k in range(resumed + 1, LAYERS + 1)]
    # committed: the last layer's statistics only; no temp file, no older layer
    assert sorted(p.name for p in ckpt.iterdir()) == [f"rank0-layer{LAYERS}.pt", "state.json"]
    assert json.loads((ckpt / "state.json").read_text())["done"] == LAYERS


# -- the same script rerun unseeded: the same samples in another order -------------------


@pytest.fixture(scope="module")
def shuffled(setup, tmp_path_factory):
    """6 samples, each with its own padding (right-padded by 0 to 5 positions, so every
    batch's attention mask differs), calibrated by uninterrupted runs that shuffle them
    (``shuffle_calibration_samples=True``, batch size 1) with torch's global generator in
    two states (seeds 1 and 2: an unseeded script's state differs from run to run)."""
    root, info = setup["root"], setup["info"]
    base = tmp_path_factory.mktemp("shuffled")
    samples = calibration_samples(info.vocab_size, n=6, seq=12, seed=7)
    masks = [torch.tensor([1] * (12 - p) + [0] * p) for p in range(6)]
    kw = {"vocab": info.vocab_size, "pipeline_kw": {"shuffle_calibration_samples": True}}
    kw["pipeline_kw"]["masks"] = masks
    for seed in (1, 2):
        _seeded_run(seed, root / "src", base / f"seed{seed}", base / f"ckpt{seed}", samples, **kw)
    return {"base": base, "samples": samples, "kw": kw}


def _seeded_run(seed: int, src, out, ckpt, samples, **kw) -> dict:
    """``_run`` with torch's global generator at ``seed`` (the script itself seeds nothing)."""
    torch.manual_seed(seed)
    return _run(src, out, ckpt, samples, **kw)


def _recorded_order(ckpt: Path) -> list[list[str]]:
    return json.loads((ckpt / "state.json").read_text())["batches"]


def test_unseeded_rerun_resumes_in_the_recorded_order(setup, shuffled, tmp_path):
    """Killed (SIGKILL) while layer 3 calibrates and rerun by the same script, whose shuffle
    now deals the same 6 samples in another order: the rerun resumes after layer 2 and its
    scores equal, bit for bit, those of the uninterrupted run in the killed run's order
    (not those of the rerun's order, which differ in their bits)."""
    root, base, samples, kw = setup["root"], shuffled["base"], shuffled["samples"], shuffled["kw"]
    ckpt, marker = tmp_path / "ckpt", tmp_path / "paused"
    args = (1, root / "src", tmp_path / "killed", ckpt, samples)
    proc = _paused_child(lambda: _seeded_run(*args, **kw), (), "layer-calibrating:3", marker)
    _wait_for([marker], [proc])
    _kill([proc])

    rerun = _seeded_run(2, root / "src", tmp_path / "rerun", ckpt, samples, **kw)
    (line,) = rerun["resumed"]
    assert f"resuming after layer 2 of {LAYERS} from {ckpt} (2 layers skipped" in line
    assert "gave the same batches in another order, so they are calibrated in the " in line
    _assert_same(tmp_path / "rerun", base / "seed1")
    first, other = _recorded_order(base / "ckpt1"), _recorded_order(base / "ckpt2")
    assert _recorded_order(ckpt) == first  # the killed run's order, kept
    assert first != other and sorted(first[0]) == sorted(other[0])  # same batches, reordered
    one, two = (ExpertScores.load(base / f"seed{s}" / "scores.safetensors") for s in (1, 2))
    assert any(  # the order of the float64 additions shows in the scores' bits
        not torch.equal(one.layers[layer][stat], two.layers[layer][stat])
        for layer in one.layers
        for stat in one.layers[layer]
    )


def _progress(capfd) -> list[tuple[int, int]]:
    """``(layer, resumed)`` of each ``REAP-PROGRESS`` line on stderr since the last read
    (each says ``tokens=48``: 4 samples x 12 tokens, and has every field)."""
    found = []
    for line in capfd.readouterr().err.splitlines():
        if line.startswith("REAP-PROGRESS "):
            fields = dict(item.split("=") for item in line.split()[1:])
            assert set(fields) == {"layer", "resumed", "tokens", "seconds", "tok_s"} | {
                "elapsed_s",
                "eta_s",
            }
            assert fields["tokens"] == "48"
            done, total = fields["layer"].split("/")
            assert total == str(LAYERS)
            found.append((int(done), int(fields["resumed"])))
    return found


def test_kimi_k3_resumes_to_identical_scores(tmp_path):
    """Kimi K3 (routed ``moe_infer`` blocks, a dense first layer; 3 decoder layers: 4
    subgraphs): killed between layers 2 and 3, resumed, the same scores and kept ids."""
    model, info = build_tiny("kimi_k3", seed=5)
    model.save_pretrained(tmp_path / "src")
    samples = calibration_samples(info.vocab_size, n=3, seq=10)
    keep = {"family": "kimi_k3", "num_experts_to_keep": info.num_experts // 2}
    args = (tmp_path / "src", tmp_path / "reference", None, samples, info.vocab_size)
    _run(*args, **keep)
    ckpt, marker = tmp_path / "ckpt", tmp_path / "paused"
    killed = (tmp_path / "src", tmp_path / "killed", ckpt, samples, info.vocab_size)
    proc = _paused_child(lambda: _run(*killed, **keep), (), "between-layers:2", marker)
    _wait_for([marker], [proc])
    _kill([proc])
    rerun = _run(tmp_path / "src", tmp_path / "rerun", ckpt, samples, info.vocab_size, **keep)
    assert "resuming after layer 2 of 4" in rerun["resumed"][0]
    _assert_same(tmp_path / "rerun", tmp_path / "reference")


def test_complete_checkpoint_skips_calibration(setup, tmp_path, capfd):
    """A rerun of a finished calibration (e.g. another keep count) runs no layer."""
    root, info, samples = setup["root"], setup["info"], setup["samples"]
    capfd.readouterr()
    first = _run(root / "src", tmp_path / "a", tmp_path / "ckpt", samples, info.vocab_size)
    assert first["resumed"] == []
    assert _progress(capfd) == [(k, 0) for k in range(1, LAYERS + 1)]
    again = _run(root / "src", tmp_path / "b", tmp_path / "ckpt", samples, info.vocab_size)
    assert f"resuming after layer {LAYERS} of {LAYERS}" in again["resumed"][0]
    assert _progress(capfd) == []  # no layer ran
    _assert_same(tmp_path / "b", root / "reference")


# -- refusals --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished(setup, tmp_path_factory):
    """A complete checkpoint of the reference setup."""
    root, info, samples = setup["root"], setup["info"], setup["samples"]
    ckpt = tmp_path_factory.mktemp("finished") / "ckpt"
    _run(root / "src", ckpt.parent / "out", ckpt, samples, info.vocab_size)
    return ckpt


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("other", r"another model \(model_fingerprint '[0-9a-f]{64}' there, '[0-9a-f]{64}' now\)"),
        ("config", r"another model \(config_sha256 '[0-9a-f]{64}' there, '[0-9a-f]{64}' now\)"),
        ("recipe", r"another recipe \(calibration_source 'default' there, 'web' now\)"),
        (
            "dataset",  # the last sample reversed
            r"on other data: 1 of this run's 4 calibration batches are not among the 4 it "
            r"calibrated \(batch 3, numbered in this run's order\) and 1 of those are missing "
            r"from this run \(batch 3, numbered in the order calibrated\)\. ",
        ),
        (
            "fewer",  # the last sample left out
            r"on other data: 0 of this run's 3 calibration batches are not among the 4 it "
            r"calibrated \(none\) and 1 of those are missing from this run \(batch 3, "
            r"numbered in the order calibrated\)\. ",
        ),
        ("pipeline", r"another sequential trace \(subgraph count; .*\(5 there, 3 now\)"),
    ],
)
def test_other_model_recipe_data_or_trace_is_refused(setup, finished, tmp_path, change, message):
    root, info, samples = setup["root"], setup["info"], setup["samples"]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(finished, ckpt)
    before = _files(ckpt)
    src = root / (change if change in ("other", "config") else "src")
    recipe = {"calibration_source": "web"} if change == "recipe" else {}
    if change == "dataset":
        samples = samples[:3] + [samples[3].flip(0)]
    if change == "fewer":
        samples = samples[:3]
    if change == "pipeline":  # two decoder layers per subgraph
        recipe["pipeline_kw"] = {"sequential_targets_per_subgraph": 2}
    with pytest.raises(CheckpointMismatch, match=message) as err:
        _run(src, tmp_path / "out", ckpt, samples, info.vocab_size, **recipe)
    assert f"pass another checkpoint_dir, or delete {ckpt} to start over" in str(err.value)
    assert "\n" not in str(err.value)
    assert _files(ckpt) == before  # refused before anything was written


def test_batches_are_matched_by_content_over_all_ranks():
    """Per rank, digests: the same batches dealt to other ranks in another order match; a
    batch occurring once more than recorded is new, and the one it displaced is missing."""
    recorded = [["a", "b"], ["c", "a"]]
    assert unmatched_batches(recorded, [["a", "c"], ["a", "b"]]) == ([], [])
    assert unmatched_batches(recorded, [["a", "a"], ["a", "b"]]) == ([(1, 0)], [(1, 0)])
    assert unmatched_batches(recorded, [["b"], ["a", "c"]]) == ([], [(0, 0)])  # first "a"


@pytest.mark.parametrize(
    "recipe",
    [
        {"propagate_pruned": True},
        {"calibrate_router": True, "fit_spill_dir": "spill"},  # rows go to checkpoint_dir
        {"saliency": "router_l1"},  # a weight baseline: nothing is calibrated
    ],
)
def test_runs_that_cannot_resume_are_refused(tmp_path, recipe):
    with pytest.raises(ValueError, match="checkpoint_dir cannot resume this run: .*; remove one"):
        REAPPruningModifier(num_experts_to_keep=4, checkpoint_dir=str(tmp_path), **recipe)


def _untimed(record):
    """A post-cut record without its wall-clock fields, its floats as ``pytest.approx`` to
    1e-6 (the block-error search's float32 contributions carry last-bit noise from run to
    run; the kept ids, the decisions and the fitted tensors are compared exactly)."""
    if isinstance(record, dict):
        return {k: _untimed(v) for k, v in record.items() if k not in ("seconds", "setup_seconds")}
    if isinstance(record, list):
        return [_untimed(v) for v in record]
    if isinstance(record, float):
        return pytest.approx(record, rel=1e-6)
    return record


def test_post_cut_step_resumes_after_a_kill_in_its_fits(setup, shuffled, tmp_path, monkeypatch):
    """Block-error selection and router fit with ``checkpoint_dir``: killed (SIGKILL) after
    the router fit of the second MoE layer was written, rerun by the same unseeded script
    (its shuffle deals the samples in another order): the calibration resumes after its last
    layer, the rows come back from the checkpoint, the selections and the two fitted layers
    are taken from disk (only the other layers are fitted), and the plan, the record and
    every fitted tensor equal, bit for bit, an uninterrupted run's in the killed run's order."""
    from dataclasses import replace

    from reap_modifier.post_cut.components import COMPONENT

    root, samples, kw = setup["root"], shuffled["samples"], shuffled["kw"]
    recipe = {"selection": "block_error", "calibrate_router": True, "router_fit_steps": 15}
    _seeded_run(1, root / "src", tmp_path / "whole", None, samples, **kw, **recipe)
    ckpt, marker = tmp_path / "ckpt", tmp_path / "paused"
    args = (1, root / "src", tmp_path / "killed", ckpt, samples)
    proc = _paused_child(
        lambda: _seeded_run(*args, **kw, **recipe), (), "post-cut-router:2", marker
    )
    _wait_for([marker], [proc])
    _kill([proc])
    assert len(list((ckpt / "post_cut" / "stages" / "router").glob("*.pt"))) == 2

    fitted = []
    real = COMPONENT["router"].fit

    def counted(layer, x, y, settings):
        fitted.append(layer.name)
        return real(layer, x, y, settings)

    monkeypatch.setitem(COMPONENT, "router", replace(COMPONENT["router"], fit=counted))
    rerun = _seeded_run(2, root / "src", tmp_path / "rerun", ckpt, samples, **kw, **recipe)
    (line,) = rerun["resumed"]
    assert f"resuming after layer {LAYERS} of {LAYERS}" in line
    layers = list(rerun["kept"])
    assert fitted == layers[2:]  # the first two were taken from the killed run's files
    whole = json.loads((tmp_path / "whole" / "result.json").read_text())
    assert rerun["kept"] == whole["kept"]
    (record, tensors), (ref_record, ref_tensors) = (
        torch.load(tmp_path / d / "post_cut.pt", weights_only=False) for d in ("rerun", "whole")
    )
    assert _untimed(record) == _untimed(ref_record)
    assert tensors.keys() == ref_tensors.keys() and tensors
    for layer, named in ref_tensors.items():
        for name, tensor in named.items():
            assert torch.equal(tensors[layer][name], tensor), (layer, name)


# -- data parallel -----------------------------------------------------------------------


def _rank(rank: int, port: int, src, out, ckpt, samples, vocab, seed=None, kw=None) -> None:
    """One rank's run; with ``seed``, torch's global generator at ``seed`` first."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    # data parallel: llm-compressor reconfigures loguru per rank; its log file stays
    os.environ["LLM_COMPRESSOR_LOG_FILE"] = str(Path(out) / f"rank{rank}.log")
    Path(out).mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if seed is not None:
        torch.manual_seed(seed)
    try:
        _run(src, Path(out) / f"rank{rank}", ckpt, samples, vocab, **(kw or {}))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(tmp_path, setup, out, ckpt, pause=None, samples=None, seed=None, kw=None):
    root, info = setup["root"], setup["info"]
    samples = setup["samples"] if samples is None else samples
    port = _free_port()
    procs, markers = [], []
    for rank in (0, 1):
        args = (rank, port, root / "src", out, ckpt, samples, info.vocab_size, seed, kw)
        if pause:
            marker = tmp_path / f"paused{rank}"
            markers.append(marker)
            procs.append(_paused_child(_rank, args, pause, marker))
        else:
            procs.append(FORK.Process(target=_rank, args=args))
            procs[-1].start()
    if pause:
        _wait_for(markers, procs)
        _kill(procs)
        return
    for proc in procs:
        proc.join()
        assert proc.exitcode == 0


def test_data_parallel_run_resumes_on_every_rank(setup, tmp_path):
    """2 CPU ranks (gloo): killed between layers 2 and 3 on both ranks, rerun on both:
    every rank resumes after layer 2 and the scores equal an uninterrupted 2-rank run's;
    the checkpoint is refused to a single process (another world size)."""
    _two_ranks(tmp_path, setup, tmp_path / "reference", tmp_path / "ref_ckpt")
    ckpt = tmp_path / "ckpt"
    _two_ranks(tmp_path, setup, tmp_path / "killed", ckpt, pause="between-layers:2")
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "rank0-layer2.pt",
        "rank1-layer2.pt",
        "state.json",
    ]
    _two_ranks(tmp_path, setup, tmp_path / "rerun", ckpt)
    reference = tmp_path / "reference" / "rank0"
    ref = json.loads((reference / "result.json").read_text())
    _assert_same_dp(tmp_path / "rerun", reference, ref)
    log = (tmp_path / "rerun" / "rank0.log").read_text()
    assert f"resuming after layer 2 of {LAYERS} from {ckpt} (2 layers skipped" in log

    info, samples = setup["info"], setup["samples"]
    with pytest.raises(CheckpointMismatch, match=r"another world size \(2 there, 1 now\)"):
        _run(setup["root"] / "src", tmp_path / "alone", ckpt, samples, info.vocab_size)


def test_data_parallel_unseeded_rerun_resumes_with_batches_dealt_to_other_ranks(
    setup, shuffled, tmp_path
):
    """2 CPU ranks given the same dataset, shuffled (rank 0 draws the order, each rank
    takes every second sample): killed between layers 2 and 3, rerun with the generator
    in another state, so the ranks are dealt other samples: every rank resumes after
    layer 2 from its own file and the scores equal the killed order's uninterrupted run's."""
    samples, kw = shuffled["samples"], {"pipeline_kw": shuffled["kw"]["pipeline_kw"]}
    runs = {"samples": samples, "kw": kw}
    for seed in (1, 2):
        out, ckpt = tmp_path / f"seed{seed}", tmp_path / f"ckpt{seed}"
        _two_ranks(tmp_path, setup, out, ckpt, seed=seed, **runs)
    ckpt = tmp_path / "ckpt"
    _two_ranks(tmp_path, setup, tmp_path / "killed", ckpt, "between-layers:2", seed=1, **runs)
    _two_ranks(tmp_path, setup, tmp_path / "rerun", ckpt, seed=2, **runs)
    log = (tmp_path / "rerun" / "rank0.log").read_text()
    assert f"resuming after layer 2 of {LAYERS} from {ckpt} (2 layers skipped" in log
    assert "gave the same batches in another order" in log
    reference = tmp_path / "seed1" / "rank0"
    ref = json.loads((reference / "result.json").read_text())
    _assert_same_dp(tmp_path / "rerun", reference, ref)
    first, other = _recorded_order(tmp_path / "ckpt1"), _recorded_order(tmp_path / "ckpt2")
    assert _recorded_order(ckpt) == first
    assert set(first[0]) != set(other[0])  # rank 0 was dealt other samples
    assert sorted(first[0] + first[1]) == sorted(other[0] + other[1])


def _assert_same_dp(rerun: Path, reference: Path, ref: dict) -> None:
    got = ExpertScores.load(rerun / "rank0" / "scores.safetensors")
    want = ExpertScores.load(reference / "scores.safetensors")
    for layer, stats in want.layers.items():
        for stat, tensor in stats.items():
            assert torch.equal(got.layers[layer][stat], tensor), f"{layer}::{stat}"
    for rank in (0, 1):
        kept = json.loads((rerun / f"rank{rank}" / "result.json").read_text())["kept"]
        assert kept == ref["kept"]
