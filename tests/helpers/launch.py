"""Launch a script as one process or as ``torchrun --nproc-per-node N`` ranks (gloo, CPU),
one torch thread each: the data-parallel tests and ``benchmarks/post_cut_ranks.py``.

MKL's reproducibility mode is pinned (``MKL_CBWR=AVX2`` unless set): otherwise MKL rounds a
matrix product by its operands' memory alignment, and two processes computing the same sample
can differ in the last bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["launch"]


def launch(script: Path, args: list[str], ranks: int, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``script args`` alone (``ranks == 1``: no process group) or under ``torchrun``
    with ``ranks`` processes, ``OMP_NUM_THREADS=1`` (and ``MKL_CBWR``); returns the finished process (its
    output captured).

    :raises AssertionError: it exited non-zero (the output's tail is the message)
    """
    env = {"MKL_CBWR": "AVX2", **os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(script), *args]
    if ranks > 1:
        port = str(29500 + os.getpid() % 1000)
        run = ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", port]
        cmd = [sys.executable, *run, *cmd[1:]]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc
