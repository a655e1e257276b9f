"""``reap prune`` killed (SIGKILL), interrupted (SIGINT / SIGTERM) at chosen points, and
two runs into one output at once.

Each run is a real ``reap`` process stopped deterministically with the rewriter's test
hook (``REAP_TEST_PAUSE_AT`` / ``REAP_TEST_PAUSE_FILE``: at the point the process writes
a marker and waits).  After a kill: the source is byte-identical; the output is absent
or the previous output untouched (or, killed after the atomic swap, the new output,
complete); no directory there passes ``reap verify``; the same command then succeeds
without any cleanup by hand and says which leftover it removed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from badinput import snapshot
from mxfp4_fixtures import write_synthetic_mxfp4

from reap_modifier.checkpoint import rewrite_checkpoint, work_dir_kind
from reap_modifier.checkpoint.verify import verify_checkpoint
from reap_modifier.scores.plan import PruningPlan

HERE = Path(__file__).resolve().parent
KEEP_NEW = [0, 2, 3, 5, 8, 9, 12, 15]
KEEP_OLD = [1, 2, 4, 6, 7, 10, 11, 13]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A Kimi-K3-named MXFP4 checkpoint of 8 small shards, a plan file, its snapshot."""
    root = tmp_path_factory.mktemp("interrupt")
    info = write_synthetic_mxfp4(root / "src", num_layers=3, num_experts=16, shard_bytes=48 << 10)
    plan = PruningPlan(
        kept={b: KEEP_NEW for b in info["blocks"]}, num_experts=16, saliency="manual"
    )
    plan.save(root / "plan.json")
    old = PruningPlan(kept={b: KEEP_OLD for b in info["blocks"]}, num_experts=16, saliency="manual")
    return {
        "src": root / "src",
        "plan": root / "plan.json",
        "old_plan": old,
        "snap": snapshot(root / "src"),
        "shards": info["shards"],
    }


def _env(pause: str | None, marker: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE.parent / "src"), str(HERE / "helpers"), str(HERE / "oracles"), str(HERE)]
        + [env.get("PYTHONPATH", "")]
    )
    env["REAP_SHA256_CACHE"] = "0"
    env["REAP_CHUNK_MB"] = "0.01"  # ~10 KiB chunks: a shard takes several writes
    env.pop("REAP_TEST_PAUSE_AT", None)
    if pause:
        env["REAP_TEST_PAUSE_AT"] = pause
        env["REAP_TEST_PAUSE_FILE"] = str(marker)
    return env


def _default_signals() -> None:
    """In the child, SIGINT as a terminal delivers it.  A shell that runs the suite in the
    background (CI, ``cmd &``, ``nohup``) starts it with SIGINT ignored, every child inherits
    that, and Python then installs no KeyboardInterrupt handler: the test's Ctrl-C would be
    lost and the run would wait at its pause point for ever."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Run:
    """``reap prune SRC --plan PLAN --out DST -q [--force]`` in a new process."""

    def __init__(
        self, ckpt, dst: Path, *, pause: str | None = None, force: bool = False, name: str = "run"
    ):
        self.dst = dst
        self.marker = dst.parent / f"{name}.paused"
        self.log = dst.parent / f"{name}.log"
        args = [
            sys.executable,
            "-m",
            "reap_modifier.cli",
            "prune",
            str(ckpt["src"]),
            "--plan",
            str(ckpt["plan"]),
            "--out",
            str(dst),
            "-q",
        ] + (["--force"] if force else [])
        self._log = open(self.log, "w")
        self.proc = subprocess.Popen(
            args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=_env(pause, self.marker),
            preexec_fn=_default_signals,
        )

    def wait_paused(self) -> str:
        """The pause point the run stopped at.  No deadline: a paused run waits for the
        test however long it takes to get there (pytest-timeout bounds a hang)."""
        while True:
            if self.marker.exists():
                return self.marker.read_text().split()[1]
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"reap prune exited ({self.proc.returncode}) before pausing:\n{self.output()}"
                )
            time.sleep(0.02)

    def resume(self) -> None:
        Path(str(self.marker) + ".go").write_text("")

    def signal(self, sig) -> int:
        self.proc.send_signal(sig)
        return self.finish()

    def finish(self) -> int:
        try:
            rc = self.proc.wait()
        finally:
            self._log.close()
        return rc

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log.read_text()


def _work_dirs(dst: Path) -> list[Path]:
    return sorted(
        p for p in dst.parent.iterdir() if work_dir_kind(p) and p.name.startswith(f".{dst.name}.")
    )


def _accepted(path: Path) -> bool:
    return verify_checkpoint(path).ok


def _rerun_in_process(ckpt, dst: Path, *, force: bool) -> str:
    """The same command again, in this process (typer's runner); returns the log."""
    from badinput import cli
    from loguru import logger

    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="WARNING")
    try:
        res = cli(
            "prune",
            ckpt["src"],
            "--plan",
            ckpt["plan"],
            "--out",
            dst,
            "-q",
            *(["--force"] if force else []),
        )
    finally:
        logger.remove(sink)
    assert res.exit_code == 0, res.output
    return res.output + "".join(lines)


def _assert_new_output(ckpt, dst: Path) -> None:
    import json

    report = verify_checkpoint(dst, source=ckpt["src"])
    assert report.ok, report.summary()
    kept = json.loads((dst / "pruning_manifest.json").read_text())["checkpoint"]["block_kept"]
    assert set(map(tuple, kept.values())) == {tuple(KEEP_NEW)}


def _previous_output(ckpt, dst: Path) -> dict:
    rewrite_checkpoint(ckpt["src"], ckpt["old_plan"], dst, progress=False, hash_cache=False)
    assert _accepted(dst)
    return snapshot(dst)


#: runs stopped at a point: name -> (pause point, previous output present, --force)
PAUSED = {
    "kill-first-shard": ("first-shard", False),
    "kill-mid": ("mid", False),
    "kill-rename": ("rename", True),
    "kill-swapped": ("swapped", True),
    "int-first-shard": ("first-shard", False),
    "term-mid": ("mid", False),
    "int-rename": ("rename", True),
    "concurrent": ("first-shard", False),
}


@pytest.fixture(scope="module")
def paused(ckpt, tmp_path_factory):
    """Every paused run of this module, started together (a ``reap`` process spends a
    few CPU-seconds importing torch and compressed-tensors; two cores overlap them)."""
    runs, previous = {}, {}
    for name, (point, prev) in PAUSED.items():
        dst = tmp_path_factory.mktemp(name) / "out"
        previous[name] = _previous_output(ckpt, dst) if prev else None
        runs[name] = Run(ckpt, dst, pause=point, force=prev)
    yield {"runs": runs, "previous": previous}
    for run in runs.values():
        if run.proc.poll() is None:
            run.proc.kill()
        run.finish()


def _exchange_supported(d: Path) -> bool:
    from reap_modifier.checkpoint.destination import _rename_exchange

    a, b = d / "xa", d / "xb"
    a.mkdir(), b.mkdir()
    try:
        return _rename_exchange(a, b)
    finally:
        a.rmdir(), b.rmdir()


@pytest.mark.parametrize("name", [n for n in PAUSED if n.startswith("kill-")])
def test_sigkill_then_rerun(ckpt, paused, name):
    point, previous = PAUSED[name]
    if point == "swapped" and not _exchange_supported(paused["runs"][name].dst.parent):
        pytest.skip(
            "this filesystem has no renameat2(RENAME_EXCHANGE): two renames, no 'swapped' point"
        )
    run, before = paused["runs"][name], paused["previous"][name]
    dst = run.dst
    assert run.wait_paused() == point
    partial = _work_dirs(dst)
    assert len(partial) == 1 and work_dir_kind(partial[0]) == "tmp"  # the output being built
    assert run.signal(signal.SIGKILL) == -signal.SIGKILL

    assert snapshot(ckpt["src"]) == ckpt["snap"], "the source changed"
    if point == "swapped":  # killed after the atomic exchange: the new output is complete
        _assert_new_output(ckpt, dst)
    elif previous:
        assert snapshot(dst) == before, "the previous output changed"
    else:
        assert not dst.exists()
    leftovers = _work_dirs(dst)
    assert len(leftovers) == 1
    assert not any(_accepted(p) for p in leftovers), "a leftover passes reap verify"
    if point == "rename":  # complete, but refused by name (never mistaken for an output)
        assert (leftovers[0] / "pruning_manifest.json").is_file()

    log = _rerun_in_process(ckpt, dst, force=previous)
    assert leftovers[0].name in log and "interrupted reap prune" in log
    _assert_new_output(ckpt, dst)
    assert _work_dirs(dst) == [] and not (dst.parent / ".out.reap-lock").exists()
    assert snapshot(ckpt["src"]) == ckpt["snap"]


@pytest.mark.parametrize(
    "name, sig", [("int-first-shard", signal.SIGINT), ("term-mid", signal.SIGTERM)]
)
def test_interrupt_is_clean(ckpt, paused, name, sig):
    """Ctrl-C (SIGINT) or SIGTERM: one clear line, no traceback, exit 130, nothing left."""
    run = paused["runs"][name]
    dst = run.dst
    run.wait_paused()
    rc = run.signal(sig)
    out = run.output()
    assert rc == 130, out
    assert "Traceback" not in out and "Aborted" not in out, out
    assert f"interrupted: {dst} was not written" in out and "source is untouched" in out, out
    assert not dst.exists() and _work_dirs(dst) == []
    assert sorted(os.listdir(dst.parent)) == sorted(p.name for p in (run.log, run.marker))
    assert snapshot(ckpt["src"]) == ckpt["snap"]


def test_interrupt_keeps_previous_output(ckpt, paused):
    """Ctrl-C while replacing an existing output (--force): the previous output stays."""
    run, before = paused["runs"]["int-rename"], paused["previous"]["int-rename"]
    run.wait_paused()
    assert run.signal(signal.SIGINT) == 130, run.output()
    assert snapshot(run.dst) == before and _work_dirs(run.dst) == []


def test_concurrent_run_into_the_same_output_is_refused(ckpt, paused):
    """While one run writes DST, a second one fails at once naming the first (its pid);
    the first then completes and its output verifies."""
    from badinput import assert_clean_error, cli

    first = paused["runs"]["concurrent"]
    dst = first.dst
    first.wait_paused()
    second = cli("prune", ckpt["src"], "--plan", ckpt["plan"], "--out", dst, "-q")
    assert_clean_error(
        second, 2, ["another reap prune", f"pid {first.proc.pid}", str(dst), "rerun"]
    )
    forced = cli("prune", ckpt["src"], "--plan", ckpt["plan"], "--out", dst, "-q", "--force")
    assert_clean_error(
        forced, 2, ["another reap prune", f"pid {first.proc.pid}"]
    )  # --force does not break in
    first.resume()
    assert first.finish() == 0, first.output()
    _assert_new_output(ckpt, dst)
    # and once it is done, a third run is refused as usual (non-empty output without --force)
    assert_clean_error(
        cli("prune", ckpt["src"], "--plan", ckpt["plan"], "--out", dst, "-q"),
        2,
        ["exists and is a non-empty directory", "--force"],
    )


def test_two_simultaneous_runs(ckpt, tmp_path):
    """Two processes started together into the same DST: exactly one succeeds, the other
    fails with a clear message, and the winner's output verifies."""
    dst = tmp_path / "out"
    runs = [Run(ckpt, dst, name=f"run{i}") for i in range(2)]
    codes = [r.finish() for r in runs]
    outs = [r.output() for r in runs]
    assert sorted(codes) == [0, 2], outs
    loser = outs[codes.index(2)]
    assert "Traceback" not in loser
    assert ("another reap prune" in loser) or ("exists and is a non-empty directory" in loser), (
        loser
    )
    _assert_new_output(ckpt, dst)
    assert _work_dirs(dst) == []
    assert snapshot(ckpt["src"]) == ckpt["snap"]


def test_without_atomic_exchange_an_orphaned_previous_output_is_put_back(
    ckpt, tmp_path, monkeypatch
):
    """Where no atomic exchange exists, ``--force`` swaps with two renames; a run killed
    between them leaves DST absent and the previous output as ``.DST.reap-old-*``: the
    next run puts it back before writing (and then replaces it, as asked)."""
    import reap_modifier.checkpoint.destination as destination

    monkeypatch.setattr(destination, "_rename_exchange", lambda a, b: False)
    dst = tmp_path / "out"
    before = _previous_output(ckpt, dst)
    rewrite_checkpoint(
        ckpt["src"],
        PruningPlan.load(ckpt["plan"]),
        dst,
        force=True,
        progress=False,
        hash_cache=False,
    )
    _assert_new_output(ckpt, dst)  # the two-rename swap works
    orphan = destination.work_path(dst, "old")
    os.rename(dst, orphan)  # the state a kill between the two renames leaves
    claim = destination.DestinationClaim(dst).acquire()
    try:
        claim.clean_leftovers()
    finally:
        claim.release()
    assert dst.is_dir() and not orphan.exists()
    _assert_new_output(ckpt, dst)
    assert before != snapshot(dst)


def test_filesystem_without_locks(ckpt, tmp_path, monkeypatch):
    """flock unsupported (ENOLCK): the run proceeds with a warning, and leftovers (which
    may then belong to a live run) are named, not removed."""
    import errno
    import fcntl

    from loguru import logger

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    dst = tmp_path / "out"
    leftover = tmp_path / ".out.reap-tmp-0123abcd"
    leftover.mkdir()
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="WARNING")
    try:
        rewrite_checkpoint(
            ckpt["src"], PruningPlan.load(ckpt["plan"]), dst, progress=False, hash_cache=False
        )
    finally:
        logger.remove(sink)
    _assert_new_output(ckpt, dst)
    assert leftover.is_dir()
    log = "".join(lines)
    assert "cannot lock" in log and leftover.name in log and "remove it by hand" in log
