"""``reap verify X.gguf --llama-cpp --reference DIR``: the GGUF run in llama.cpp
(llama-cpp-python, in its own environment: ``scripts/llama_cpp_venv.sh``) against the
reference checkpoint in transformers, on the same token ids.

Every position's logits are compared: an all-f32 GGUF must agree within ``tolerance``
(max absolute difference; llama.cpp runs with an f32 KV cache); a quantized one must pick
the same top-1 token at ``min_top1`` of the positions, and the mean KL is reported."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["LlamaCppNotFound", "LlamaCppReport", "check_with_llama_cpp", "find_llama_cpp_python"]

PROBE = Path(__file__).with_name("llama_cpp_probe.py")
_F32 = 0


class LlamaCppNotFound(RuntimeError):
    """No Python with llama-cpp-python; says how to get one."""


@dataclass
class LlamaCppReport:
    max_abs_diff: float
    top1_agreement: float
    mean_kl: float
    all_f32: bool
    ok: bool
    failures: list[str] = field(default_factory=list)


def find_llama_cpp_python(python: str | os.PathLike | None) -> Path:
    """``python``, else ``$REAP_LLAMA_CPP_PYTHON``, else ``./.venv-llama-cpp/bin/python``;
    it must import ``llama_cpp``."""
    candidate = Path(
        python or os.environ.get("REAP_LLAMA_CPP_PYTHON") or ".venv-llama-cpp/bin/python"
    )
    ok = (
        candidate.is_file()
        and subprocess.run(
            [str(candidate), "-c", "import llama_cpp"], capture_output=True
        ).returncode
        == 0
    )
    if not ok:
        raise LlamaCppNotFound(
            f"no llama-cpp-python at {candidate}: run scripts/llama_cpp_venv.sh or pass "
            "--llama-cpp-python PATH"
        )
    return candidate


def check_with_llama_cpp(
    gguf: str | os.PathLike,
    reference: str | os.PathLike,
    *,
    python: str | os.PathLike | None = None,
    tolerance: float = 1e-4,
    min_top1: float = 0.9,
) -> LlamaCppReport:
    """Run ``gguf`` in llama.cpp and ``reference`` in transformers on the same prompts."""
    import numpy as np
    import torch

    from ..gguf.layout import inspect_gguf
    from .reference import load_reference_model, make_prompts

    py = find_llama_cpp_python(python)
    layout = inspect_gguf(gguf)
    all_f32 = all(t.ggml_type == _F32 for p in layout.parts for t in p.tensors)
    model = load_reference_model(reference, dtype="float32")
    prompts = make_prompts(int(model.config.get_text_config().vocab_size))
    with tempfile.TemporaryDirectory(prefix="reap-llama-cpp-") as tmp:
        (Path(tmp) / "prompts.json").write_text(json.dumps(prompts))
        out = Path(tmp) / "logits.npz"
        proc = subprocess.run(
            [
                str(py),
                str(PROBE),
                str(layout.parts[0].path),
                str(Path(tmp) / "prompts.json"),
                str(out),
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        if proc.returncode:
            raise RuntimeError(f"llama.cpp could not run {gguf}: {proc.stderr.strip()[-2000:]}")
        got = dict(np.load(out))
    diffs, agree, kls, n = [], 0, [], 0
    with torch.no_grad():
        for i, ids in enumerate(prompts):
            want = model(torch.tensor([ids])).logits[0].double()
            have = torch.from_numpy(got[f"p{i}"]).double()
            diffs.append(float((have - want).abs().max()))
            agree += int((have.argmax(-1) == want.argmax(-1)).sum())
            n += len(ids)
            lp, lq = want.log_softmax(-1), have.log_softmax(-1)
            kls.append(float((lp.exp() * (lp - lq)).sum(-1).mean()))
    report = LlamaCppReport(
        max_abs_diff=max(diffs), top1_agreement=agree / n, mean_kl=sum(kls) / len(kls),
        all_f32=all_f32, ok=True,
    )  # fmt: skip
    if all_f32 and report.max_abs_diff > tolerance:
        report.failures.append(
            f"max |logit difference| {report.max_abs_diff:.3g} > {tolerance:g} for an f32 GGUF"
        )
    if report.top1_agreement < min_top1:
        report.failures.append(f"top-1 agreement {report.top1_agreement:.3f} < {min_top1}")
    report.ok = not report.failures
    return report
