"""Workarounds for compressed-tensors 0.19's ``convert_checkpoint``: all of them live here."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import threading
from pathlib import Path

import torch
from loguru import logger

from . import byte_copy
from .byte_copy import new_hasher
from .converter import ExpertPlanPruner

__all__ = ["convert", "upstream_gaps"]

_CONVERT_MODULE = "compressed_tensors.entrypoints.convert.convert_checkpoint"


@contextlib.contextmanager
def upstream_gaps(converter: ExpertPlanPruner):
    """Run ``convert_checkpoint`` with the workarounds this rewriter needs.

    compressed-tensors 0.19 gaps, and what is done about each:

    1. ``convert_file`` loads every tensor of a shard into memory and ``save_file``
       serialises copies of them (about 2x the shard in RAM), reads the dropped
       experts too, and hashes nothing.  For our converter the ``convert_file`` that
       ``convert_checkpoint`` calls is swapped, for the duration of the call, for
       :meth:`ExpertPlanPruner.stream_shard` (same signature and return value; other
       converters still get the stock function).  The swap is checked against the
       upstream signature and skipped with a warning if it ever changes (the stock
       path is still bit-exact, only heavier).
    2. ``write_checkpoint_quantization_config`` round-trips ``quantization_config``
       through pydantic (normalising fields; dropping it if it does not validate) and
       only passes the *parsed* config to ``update_config``.  The converter's
       ``update_model_config`` therefore writes back the source's raw dict, with
       per-expert names in ``ignore`` / ``targets`` renumbered or dropped (done on
       the raw dict, which ``MagnitudeExpertPruner`` never does).
    3. ``update_safetensors_index`` creates ``model.safetensors.index.json`` even for
       a single-file checkpoint; it is removed after the run when the source had none.
       ``convert_checkpoint`` also writes a shard file when every tensor of it was
       dropped (a shard of dropped experts only); such empty shards, which the new
       index does not reference, are removed.
    4. ``MagnitudeExpertPruner`` is not used: its ``from_pretrained`` scores routers
       itself (crashing when the router pattern also matches the 1-D bias), it pairs
       experts with routers by longest common name prefix, assumes one layout (2-D or
       3-D) for the whole checkpoint, does not touch ``quantization_config.ignore`` and
       sets the count key in one place only.  :class:`ExpertPlanPruner` takes the plan
       instead.  (llm-compressor's ``model_free_ptq(converter=...)`` never calls
       ``update_model_config``; ``convert_checkpoint`` does, so we call that.)
    5. ``validate_file`` builds each shard's meta tensors through
       ``load_tensors_from_inverse_weight_map``, which checks every name against the
       shard's key *list* (``name not in keys``): quadratic in the tensors of a shard.
       At K3's counts with small widths one 256 MB shard holds 495,905 tensors, and the
       check alone ran for over 15 minutes without finishing.  It is swapped, with
       ``convert_file``, for the same check against a set (same tensors, same error).
    """
    module = importlib.import_module(_CONVERT_MODULE)
    stock, stock_validate = module.convert_file, module.validate_file
    expected = ["inverse_weight_map", "save_path", "converters", "device"]
    if list(inspect.signature(stock).parameters) != expected or list(
        inspect.signature(stock_validate).parameters
    ) != ["inverse_weight_map", "converters"]:
        logger.warning(
            "compressed-tensors convert_file / validate_file changed their signatures; "
            "using the stock (in-memory, quadratic-check) shard writer"
        )
        yield
        return

    def convert_file(inverse_weight_map, save_path, converters, device=torch.device("cpu")):
        if len(converters) == 1 and converters[0] is converter:
            return converter.stream_shard(inverse_weight_map, save_path)
        return stock(inverse_weight_map, save_path, converters, device)

    def validate_file(inverse_weight_map, converters):
        if len(converters) == 1 and converters[0] is converter:
            return converter.validate(meta_tensors(inverse_weight_map))
        return stock_validate(inverse_weight_map, converters)

    module.convert_file, module.validate_file = convert_file, validate_file
    try:
        yield
    finally:
        module.convert_file, module.validate_file = stock, stock_validate


def meta_tensors(inverse_weight_map: dict[str, list[str] | None]) -> dict[str, torch.Tensor]:
    """``load_tensors_from_inverse_weight_map(..., device="meta")`` with the names checked
    against a set of the shard's keys (gap 5)."""
    from compressed_tensors.utils.safetensors_load import str_to_torch_dtype
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for source_file, names in inverse_weight_map.items():
        with safe_open(source_file, framework="pt") as file:
            keys = file.keys()
            present = set(keys)
            for name in names or keys:
                if name not in present:
                    raise ValueError(
                        f"Expected to find tensor {name} in {source_file}, "
                        "but tensor was not found."
                    )
                piece = file.get_slice(name)
                tensors[name] = torch.empty(
                    piece.get_shape(), dtype=str_to_torch_dtype[piece.get_dtype()], device="meta"
                )
    return tensors


#: the swap in upstream_gaps patches a module global: one conversion at a time
_CONVERT_LOCK = threading.Lock()


def convert(src: Path, tmp: Path, converter: ExpertPlanPruner, *, stream: bool = True) -> None:
    from compressed_tensors.entrypoints.convert import convert_checkpoint

    ctx = upstream_gaps(converter) if stream else contextlib.nullcontext()
    try:
        with (
            _CONVERT_LOCK,
            ctx,
            _quiet_upstream_logs(),
            _upstream_progress_bars(converter.progress is not None),
        ):
            convert_checkpoint(src, tmp, converter, device="cpu")
    finally:
        converter.close()
    # gap 3: empty shards, index file for a single-file source
    index_path = tmp / "model.safetensors.index.json"
    if index_path.is_file():
        referenced = set(json.loads(index_path.read_text())["weight_map"].values())
        for shard in converter.spec.layout.shards:
            if shard not in referenced and (tmp / shard).is_file():
                logger.info(f"REAP: {shard} held only dropped experts; not written")
                (tmp / shard).unlink()
                converter.output_bytes.pop(Path(shard).name, None)
                converter.output_checksums.pop(Path(shard).name, None)
    if converter.spec.layout.index_file is None:
        index_path.unlink(missing_ok=True)
    # shards written by the stock convert_file (gap 1 swap skipped): checksum them now
    for path in sorted(tmp.rglob("*.safetensors")):
        if path.name not in converter.output_bytes:
            h = new_hasher(converter.output_checksum)
            with open(path, "rb") as f:
                while block := f.read(byte_copy.CHUNK_BYTES):
                    h.update(block)
            converter.output_checksums[path.name] = h.hexdigest()
            converter.output_bytes[path.name] = path.stat().st_size


@contextlib.contextmanager
def _upstream_progress_bars(enabled: bool):
    """compressed-tensors' ``exec_jobs`` / ``exec_jobs_dynamic`` always draw their
    "Validating" / "Converting" tqdm bars; without progress output (``reap prune -q``,
    ``progress=False``) they are created disabled for the duration of the call."""
    if enabled:
        yield
        return
    import functools
    import types

    import tqdm as tqdm_module

    quiet = types.SimpleNamespace(tqdm=functools.partial(tqdm_module.tqdm, disable=True))
    modules = [
        importlib.import_module(_CONVERT_MODULE),
        importlib.import_module("compressed_tensors.entrypoints.convert.memory"),
    ]
    saved = [(m, m.__dict__.get("tqdm")) for m in modules if m.__dict__.get("tqdm") is tqdm_module]
    for m, _ in saved:
        m.tqdm = quiet
    try:
        yield
    finally:
        for m, original in saved:
            m.tqdm = original


@contextlib.contextmanager
def _quiet_upstream_logs():
    """compressed-tensors logs every file copy and warns that the existing
    quantization config "may be overwritten" (ours restores it): keep that quiet."""
    logger.disable("compressed_tensors.entrypoints")
    try:
        yield
    finally:
        logger.enable("compressed_tensors.entrypoints")
