"""The main job's surroundings: logging and timing, library noise, loading the bundled
model, building the corpora when missing, the MXFP4 source checkpoint, the output folder."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from .config import REPO


class Clock:
    def __init__(self) -> None:
        self.t0 = time.time()
        self.stages: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str, log: Callable[[str], None]):
        log(f"== {name}")
        t = time.time()
        yield
        self.stages[name] = round(time.time() - t, 2)
        log(f"   {name}: {self.stages[name]:.1f} s")

    def total(self) -> float:
        return round(time.time() - self.t0, 2)


def log_line(msg: str) -> None:
    print(msg, flush=True)


_QUIET = False


def quiet_libraries() -> None:
    """Keep the console to our progress bars, oneshot's and stage lines (warnings still show;
    model loading runs with stderr muted)."""
    global _QUIET
    _QUIET = True
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except Exception:  # pragma: no cover
        pass
    try:
        import llmcompressor  # noqa: F401  (configures its loguru handler on import: replace it)
        from loguru import logger

        logger.remove()
        logger.add(
            sys.stderr,
            level="WARNING",
            filter=lambda r: (
                "No accelerator" not in r["message"]
                and "limited support for models already quantized" not in r["message"]
            ),
        )
    except Exception:  # pragma: no cover
        pass
    import warnings

    warnings.filterwarnings("ignore", message=".*TypedStorage.*")
    warnings.filterwarnings("ignore", category=FutureWarning)


def environment_versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("reap-modifier", "torch", "transformers", "llmcompressor", "compressed-tensors"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def load_model(path: str | os.PathLike, *, packed: bool = False, dtype: str = "bfloat16"):
    """A checkpoint from its directory with transformers, eval mode, floating weights in ``dtype``
    (:func:`reap_modifier.models.loading.load_checkpoint_model`). compressed-tensors checkpoints (MXFP4
    experts) are decompressed on load: the weights are the exact MXFP4 values, the forward is the
    same as the compressed module's. With ``packed`` they stay packed (``weight_packed`` /
    ``weight_scale``): REAP calibration then dequantizes one MoE layer at a time
    (:mod:`reap_modifier.calibration.packed`), in the dtype the experts are called with."""
    from ..models.loading import load_checkpoint_model

    if _QUIET:  # transformers' and compressed-tensors' per-load progress bars
        import contextlib
        import io

        with contextlib.redirect_stderr(io.StringIO()):
            return load_checkpoint_model(path, dtype=dtype, packed=packed)
    return load_checkpoint_model(path, dtype=dtype, packed=packed)


def relative_to(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path)


def ensure_corpora(data_dir: Path, default: bool, log: Callable[[str], None] = log_line) -> None:
    from .data import corpora_available

    if corpora_available(data_dir):
        return
    if not default:
        raise SystemExit(
            f"corpora not found in {data_dir} (data/<lang>/<split>.jsonl); build them with "
            f"`python scripts/build_corpora.py --data-dir {data_dir}`"
        )
    script = REPO / "scripts" / "build_corpora.py"
    log(
        f"corpora not found in {data_dir}: building them with {script.relative_to(REPO)} (a few minutes)"
    )
    subprocess.run([sys.executable, str(script), "--data-dir", str(data_dir)], check=True)
    if not corpora_available(data_dir):
        raise SystemExit(f"{script} ran but {data_dir} is still incomplete")


def checkpoint_source(
    model_dir: Path, out: Path, log: Callable[[str], None] = log_line
) -> tuple[Path, list[str]]:
    """The directory the checkpoint rewriter reads. Normally ``model_dir`` itself. The rewriter
    refuses a directory holding safetensors files that are not weight shards (e.g. an evaluation
    slice saved next to a single ``model.safetensors``); then the job reads the checkpoint through
    ``out/source``: copies of every file of ``model_dir`` except those extra safetensors files
    (same bytes, so hashes and the bit-exact checks are unaffected; copies, not symlinks, because
    the rewriter resolves shard paths). Returns the directory and the files left out."""
    from ..checkpoint import CheckpointError, inspect_checkpoint

    try:
        layout = inspect_checkpoint(model_dir)
        extra = list(layout.unindexed_files)
    except CheckpointError:
        index = model_dir / "model.safetensors.index.json"
        if index.is_file() or not (model_dir / "model.safetensors").is_file():
            raise
        extra = sorted(
            p.relative_to(model_dir).as_posix()
            for p in model_dir.rglob("*.safetensors")
            if p.name != "model.safetensors" or p.parent != model_dir
        )
    if not extra:
        return model_dir, []
    view = out / "source"
    view.mkdir(parents=True)
    for f in sorted(model_dir.iterdir()):
        if f.relative_to(model_dir).as_posix() in extra or (
            f.is_dir() and any(e.startswith(f.name + "/") for e in extra)
        ):
            continue
        if f.is_dir():
            shutil.copytree(f, view / f.name)
        else:
            shutil.copy2(f, view / f.name)
    log(
        f"   {model_dir} also holds {', '.join(extra)} (not weight shards; the checkpoint rewriter refuses"
        f" those): reading the checkpoint through {view} (a copy of every other file)"
    )
    return view, extra


OUT_MARKER = ".reap-demo"
OUT_ENTRIES = (
    "source",
    "scores",
    "plans",
    "pruned",
    "compare",
    "tiers",
    "report.md",
    "results.json",
    "quality.png",
    "nll_per_language.png",
)


def prepare_out_dir(out: Path) -> None:
    """Create ``out`` or clear the previous demo run in it. A non-empty folder that holds no earlier
    run (no ``.reap-demo`` marker) is refused, so ``--out`` can never delete unrelated files."""
    if out.exists() and any(out.iterdir()) and not (out / OUT_MARKER).is_file():
        raise SystemExit(
            f"refusing to write into {out}: it is not empty and holds no earlier demo run "
            f"(no {OUT_MARKER} marker); choose another --out"
        )
    out.mkdir(parents=True, exist_ok=True)
    for name in OUT_ENTRIES:
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    (out / OUT_MARKER).write_text(
        "written by python -m reap_modifier.demo; the folder is replaced on rerun\n"
    )
