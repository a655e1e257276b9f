"""HF -> GGUF export: llama.cpp's own converter, run with the MXFP4 expert repack of
:mod:`.mxfp4_repack` (compressed-tensors MXFP4 routed experts copied bit for bit into GGML's
MXFP4 blocks; every other checkpoint converted exactly as the stock converter does).

The converter runs in a fresh interpreter (it brings its own ``gguf`` package); its file is
written beside ``out`` and renamed into place when complete.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from loguru import logger

from ..fileio import atomic_path
from .errors import GGUFError

__all__ = ["OUTTYPES", "export_gguf"]

#: the converter's ``--outtype`` choices for the tensors that are not MXFP4 experts
OUTTYPES = ("auto", "f32", "f16", "bf16", "q8_0")
_SCRIPT = Path(__file__).with_name("mxfp4_repack.py")


def export_gguf(
    model: str | os.PathLike,
    out: str | os.PathLike,
    *,
    converter: str | os.PathLike | None,
    outtype: str = "auto",
    model_name: str | None = None,
    force: bool = False,
) -> Path:
    """Convert the checkpoint directory ``model`` to the GGUF file ``out`` with llama.cpp's
    converter in ``converter`` (the folder of ``convert_hf_to_gguf.py``); ``model_name`` is
    ``general.name`` (default: the converter's, from the folder's name). Raises
    :class:`GGUFError` (one line) on bad input or when the converter fails; nothing is left."""
    model, out = Path(model), Path(out)
    if converter is None:
        raise GGUFError(
            "give --converter DIR (or $REAP_GGUF_CONVERTER): the folder of llama.cpp's "
            "convert_hf_to_gguf.py (scripts/llama_cpp_converter.sh extracts it)"
        )
    converter = Path(converter)
    if not (converter / "convert_hf_to_gguf.py").is_file():
        raise GGUFError(
            f"{converter} has no convert_hf_to_gguf.py: give llama.cpp's converter folder "
            "(scripts/llama_cpp_converter.sh extracts it)"
        )
    if not (model / "config.json").is_file():
        raise GGUFError(f"{model} is no checkpoint directory (no config.json): give one")
    if out.suffix.lower() != ".gguf":
        raise GGUFError(f"{out}: name the output file .gguf")
    if out.exists() and not force:
        raise GGUFError(f"{out} exists: pass --force to replace it")
    if outtype not in OUTTYPES:
        raise GGUFError(f"--outtype {outtype!r}: use one of {', '.join(OUTTYPES)}")
    with atomic_path(out) as tmp:
        # -P: the script's folder (this package) must not shadow the converter's modules
        cmd = [sys.executable, "-P", str(_SCRIPT), str(converter), str(model)]
        cmd += ["--outtype", outtype, "--outfile", str(tmp)]
        cmd += ["--model-name", model_name] if model_name else []
        logger.info("converting {} -> {} with {}", model, out, converter)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            raise GGUFError(
                f"llama.cpp's converter failed on {model}: {lines[-1] if lines else proc.returncode}"
            )
    return out
