"""The compressed-tensors ``Converter`` that applies a bound plan to a checkpoint."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from loguru import logger

from ..pause_points import pause_point
from .binding import RewriteSpec, rewrite_quant_config
from .byte_copy import (
    COPY_ALIGN,
    ByteMover,
    copy_residue,
    default_output_checksum,
    merge_ranges,
    new_hasher,
)
from .errors import CheckpointError
from .layout import COUNT_KEY_CONTAINERS, preview, set_dotted
from .moe_blocks import PER_EXPERT_RE
from .quantization import QUANT_CONFIG_KEYS
from .safetensors_header import encode_header

__all__ = ["ExpertPlanPruner"]

try:  # the protocol class; a plain base when compressed-tensors lacks it
    from compressed_tensors.entrypoints.convert.converters import (
        Converter as _ConverterBase,
    )
except Exception:  # pragma: no cover - pinned stack has it
    _ConverterBase = object


class ExpertPlanPruner(_ConverterBase):
    """compressed-tensors ``Converter`` applying a bound plan (:class:`RewriteSpec`).

    ``process`` works on tensors (real or meta) and is what ``validate`` runs;
    :meth:`stream_shard` is the same rewrite done on bytes, straight from the source
    file (see :func:`upstream_gaps`), so kept tensors are verbatim and memory is a
    few buffers.  Both are driven by :meth:`RewriteSpec.action`, so they cannot
    disagree.  Records a checksum (``output_checksums``, kind ``output_checksum``) and
    the size of every shard it streams.  Call :meth:`close` when done.
    """

    def __init__(
        self,
        spec: RewriteSpec,
        *,
        progress: Callable[[int], None] | None = None,
        output_checksum: str | None = None,
    ):
        self.spec = spec
        self.progress = progress
        self.output_checksum = output_checksum or default_output_checksum()
        new_hasher(self.output_checksum)  # fail early on an unknown kind
        self.output_checksums: dict[str, str] = {}
        self.output_bytes: dict[str, int] = {}
        self.counts = {"copied": 0, "renamed": 0, "rows_selected": 0, "dropped": 0}
        self.quant_stats = {"renumbered": 0, "dropped": 0}
        self._lock = threading.Lock()
        self._mover: ByteMover | None = None

    def close(self) -> None:
        """Release the writer's buffer."""
        if self._mover is not None:
            self._mover.close()
            self._mover = None

    # -- Converter protocol ------------------------------------------------------

    def process(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            act = self.spec.action(name)
            if act is None:
                continue
            out_name, rows = act
            if rows is not None:
                idx = torch.tensor(rows, dtype=torch.long, device=tensor.device)
                tensor = tensor.index_select(self.spec.remap.dim(name), idx).contiguous()
            if out_name in out:
                raise CheckpointError(f"two tensors would be written as {out_name!r}")
            out[out_name] = tensor
        return out

    def validate(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = self.process(tensors)
        n = self.spec.new_count
        for name, _t in out.items():
            m = PER_EXPERT_RE.match(name)
            if m and m["block"] in self.spec.block_kept and int(m["idx"]) >= n:
                raise CheckpointError(f"{name}: expert index beyond the new count {n}")
        return out

    def update_config(self, config):
        # The quantization scheme does not change: packed bytes are copied as they are.
        # (The per-expert names in ``ignore`` are fixed in update_model_config, on the
        # source's raw dict - see upstream_gaps, gap 2.)
        return config

    def update_model_config(self, model_config: dict) -> dict:
        new = self.spec.new_count
        for key in self.spec.count_keys:
            set_dotted(model_config, key, new)
        # restore each quantization config exactly as the source had it, names fixed
        source = self.spec.layout.config
        for cname in ("", *COUNT_KEY_CONTAINERS):
            src_c = source if not cname else source.get(cname)
            dst_c = model_config if not cname else model_config.get(cname)
            if not isinstance(src_c, dict) or not isinstance(dst_c, dict):
                continue
            for key in QUANT_CONFIG_KEYS:
                if isinstance(src_c.get(key), dict):
                    dst_c[key], stats = rewrite_quant_config(src_c[key], self.spec.block_kept)
                    for k in stats:
                        self.quant_stats[k] += stats[k]
                elif key not in src_c and key in dst_c:
                    del dst_c[key]
        return model_config

    def get_dependencies(self, weight_name: str) -> set[str]:
        return set()

    # -- streaming writer ----------------------------------------------------------

    def stream_shard(
        self, inverse_weight_map: Mapping[str, list[str]], save_path: str | os.PathLike
    ) -> tuple[int, dict[str, str]]:
        """Write one output shard from source byte ranges (``convert_file``'s contract)."""
        if len(inverse_weight_map) != 1:
            raise CheckpointError(
                f"a shard job reads {len(inverse_weight_map)} files; expected one"
            )
        ((src_file, names),) = inverse_weight_map.items()
        src_file = Path(src_file)
        layout = self.spec.layout
        # the path as listed (a shard may be a symlink out of the folder, as in the
        # Hugging Face cache: snapshots/<rev>/x.safetensors -> ../../blobs/<sha>)
        shard = Path(
            os.path.relpath(os.path.abspath(src_file), os.path.abspath(layout.path))
        ).as_posix()
        if shard not in layout.shards:
            shard = Path(os.path.relpath(src_file.resolve(), layout.path.resolve())).as_posix()
        if shard not in layout.shards:
            raise CheckpointError(f"{src_file} is not a shard of {layout.path}")
        header = layout.shards[shard]
        unindexed = set(header.entries) - set(names)
        if unindexed:
            logger.warning(
                f"{shard}: {len(unindexed)} tensor(s) not in the index are not copied: {preview(sorted(unindexed))}"
            )
        plan = self.spec.output_plan(shard, names)
        out_entries, segments, pos = [], [], 0
        for out_name, entry, ranges, shape in plan:
            size = sum(e - b for b, e in ranges)
            out_entries.append((out_name, entry.dtype, list(shape), pos, pos + size))
            pos += size
            segments.extend(ranges)
            kind = (
                "rows_selected"
                if shape != entry.shape
                else ("renamed" if out_name != entry.name else "copied")
            )
            with self._lock:
                self.counts[kind] += 1
        with self._lock:
            self.counts["dropped"] += len(names) - len(plan)
        segments = merge_ranges(segments)
        # the data starts where most kept bytes keep their source offset modulo COPY_ALIGN
        residue = copy_residue(segments)
        head = encode_header(
            out_entries,
            header.metadata,
            align=None if residue is None else (residue, COPY_ALIGN),
        )
        if self._mover is None:
            self._mover = ByteMover(self.output_checksum)
        first = not self.output_bytes
        out_hash = self._mover.copy(
            src_file,
            Path(save_path),
            head,
            segments,
            progress=self.progress,
            after_first_chunk=(lambda: pause_point("first-shard")) if first else None,
        )
        expect = len(head) + pos
        if (got := Path(save_path).stat().st_size) != expect:
            raise CheckpointError(f"{save_path}: wrote {got} bytes, expected {expect}")
        name = Path(save_path).name
        with self._lock:
            self.output_checksums[name] = out_hash
            self.output_bytes[name] = expect
        if len(self.output_bytes) == max(1, len(layout.shards) // 2):
            pause_point("mid")
        return pos, {n: name for n, *_ in out_entries}
