"""A vLLM OpenAI-compatible server started, queried and stopped by us, on 127.0.0.1.

:class:`VllmServer` starts ``python -m vllm.entrypoints.openai.api_server`` with the
given interpreter in its own process group (``start_new_session``), waits for
``/health`` with a bounded wait (and stops waiting at once if the process exits),
sends ``/v1/completions`` requests of token ids (no tokenizer needed:
``--skip-tokenizer-init``), and stops the process group it started: SIGTERM, a
bounded wait, then SIGKILL.  Only the standard library is used on this side.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

__all__ = ["ServerError", "VllmServer", "free_port", "live_group_members", "vllm_env"]

SERVED_NAME = "reap-check"

#: CPU-backend settings vLLM needs on a small machine; a value already set wins
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache (the default is 4+)
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # do not pin threads to cores other jobs use
    "VLLM_KIMI_K3_GEMM_AR": "0",  # K3's GEMM-AR needs NVLink multicast
}

#: options a user's ``--vllm-arg`` list may carry that rule out the single-process executor
_PARALLEL_FLAGS = (
    "--tensor-parallel-size",
    "-tp",
    "--pipeline-parallel-size",
    "-pp",
    "--data-parallel-size",
    "-dp",
)


class ServerError(RuntimeError):
    """The server did not start, died, or answered with an error; ``log_tail`` says why."""

    def __init__(self, msg: str, log_tail: str = ""):
        super().__init__(
            msg + (f"\n--- server log (last lines) ---\n{log_tail}" if log_tail else "")
        )
        self.log_tail = log_tail


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def live_group_members(pgid: int) -> list[int]:
    """Pids of processes in group ``pgid`` that are not zombies (Linux ``/proc``; [] elsewhere)."""
    out = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            stat = entry.read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()  # after "pid (comm)": state ppid pgrp ...
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            out.append(int(entry.parent.name))
    return out


def vllm_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    for k, v in CPU_ENV.items():
        env.setdefault(k, v)
    env.update(extra or {})
    return env


class VllmServer:
    """``with VllmServer(python, model_dir, log_path=...) as srv: srv.complete(...)``."""

    def __init__(
        self,
        python: str | os.PathLike,
        model_dir: str | os.PathLike,
        *,
        log_path: str | os.PathLike,
        dtype: str = "auto",
        max_model_len: int = 256,
        extra_args: list[str] | None = None,
        port: int | None = None,
        startup_timeout: float = 600.0,
        request_timeout: float = 300.0,
        env: dict | None = None,
        skip_tokenizer_init: bool = True,
    ):
        self.python = str(python)
        self.model_dir = str(model_dir)
        self.log_path = Path(log_path)
        self.dtype = dtype
        self.max_model_len = int(max_model_len)
        self.extra_args = list(extra_args or [])
        self.port = int(port) if port else free_port()
        self.startup_timeout = float(startup_timeout)
        self.request_timeout = float(request_timeout)
        self.env = vllm_env(env)
        self.skip_tokenizer_init = bool(skip_tokenizer_init)
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model_dir,
            "--served-model-name", SERVED_NAME,
            "--max-model-len", str(self.max_model_len),
            "--enforce-eager",
            "--dtype", self.dtype,
            "--host", "127.0.0.1",
            "--port", str(self.port),
        ]  # fmt: skip
        if self.skip_tokenizer_init:  # token ids in and out; text requests need the tokenizer
            cmd.append("--skip-tokenizer-init")
        if not any(a.split("=", 1)[0] in _PARALLEL_FLAGS for a in self.extra_args):
            # one process for engine core and worker: ~20 s less start-up on a small CPU box
            cmd += ["--distributed-executor-backend", "uni"]
        return cmd + self.extra_args

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def start(self) -> VllmServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        t0 = time.monotonic()
        try:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, start_new_session=True,
            )  # fmt: skip
        finally:
            log.close()
        deadline = t0 + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"vLLM server exited with code {self.proc.returncode} before it was healthy",
                    self.log_tail(),
                )
            if self._healthy():
                self.startup_seconds = time.monotonic() - t0
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(
                    f"vLLM server not healthy after {self.startup_timeout:.0f} s", self.log_tail()
                )
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the process group we started, wait up to ``timeout``, then SIGKILL it."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # the group may still hold the engine process after the server exited
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass
        deadline = time.monotonic() + 10
        while live_group_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def complete(self, prompts: list[list[int]], **params) -> list[dict]:
        """POST ``/v1/completions`` with token-id prompts; the choices in prompt order."""
        body = {
            "model": SERVED_NAME,
            "prompt": prompts,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        body.update(params)
        req = urllib.request.Request(
            self.url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=self.request_timeout) as r:
                reply = json.load(r)
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            raise ServerError(
                f"/v1/completions answered HTTP {exc.code}: {detail}", self.log_tail()
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            raise ServerError(f"/v1/completions failed: {exc}", self.log_tail()) from None
        return sorted(reply["choices"], key=lambda c: c["index"])
