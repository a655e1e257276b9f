"""The checkpoint rewriter: a :class:`PruningPlan` applied to a safetensors checkpoint.

No model is loaded and nothing is dequantized.  The rewrite runs on the
compressed-tensors ``Converter`` protocol (``convert_checkpoint`` drives it: file
copies, per-shard jobs, meta-tensor validation, config and index rewrite), with the
per-shard work done by a *streaming byte-range writer*: every output tensor is a
run of bytes of the source file (a whole tensor, or the kept rows of a tensor whose
first dimension is the expert dimension), so kept experts' ``weight_packed`` /
``weight_scale`` / any ``weight_*`` are copied verbatim and memory stays at a few
I/O buffers whatever the shard size.

What is rewritten (per MoE block, i.e. a module prefix that owns ``.experts.``):

- per-expert tensors ``{block}.experts.{e}.{rest}``: dropped, or renamed ``e -> new``
  (every parameter: ``weight``, ``weight_packed``, ``weight_scale``, ...);
- fused expert tensors ``{block}.experts.{param}`` (first dim = experts, e.g. GPT-OSS
  ``gate_up_proj`` / ``gate_up_proj_bias`` / ``*_blocks``): kept rows selected;
- router tensors ``{block}.gate.*`` / ``{block}.router.*`` (weight, bias,
  ``e_score_correction_bias``): kept rows selected;
- ``config.json``: every expert-count key (top level and the nested text configs of
  :mod:`reap_modifier.models.moe_fields`) that holds the old count, and per-expert
  module names in ``quantization_config`` (``ignore``, group ``targets``) renumbered
  or dropped;
- ``model.safetensors.index.json``; all other files are copied unchanged.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

from ..fileio import sha256_file, write_json_atomic
from ..pause_points import pause_point
from ..scores.plan import PruningPlan
from .binding import ExtraLayers, RewriteSpec, bind_plan
from .converter import ExpertPlanPruner
from .destination import DestinationClaim, check_destination, swap_into_place, work_path
from .errors import CheckpointError, DestinationError, NotWholeError
from .layout import CheckpointLayout, inspect_checkpoint
from .manifest import MANIFEST_NAME, build_manifest
from .replaced_tensors import bind_replacements, replacement_record, write_replacements
from .safetensors_header import read_safetensors_header
from .scores_cut import ScoresCut
from .source_hashes import SourceHasher, default_hash_cache
from .upstream import convert

__all__ = [
    "DEFAULT_METHOD",
    "RewriteJob",
    "inspect_source",
    "prepare_rewrite",
    "rewrite_checkpoint",
]

DEFAULT_METHOD = "REAP (checkpoint rewrite)"


def inspect_source(src: str | os.PathLike) -> CheckpointLayout:
    """The source checkpoint's layout; refuses safetensors files the weight index does
    not name (they would be neither pruned nor copied consistently)."""
    layout = inspect_checkpoint(src)
    if layout.unindexed_files:
        raise CheckpointError(
            f"{src}: safetensors file(s) {layout.unindexed_files} are not in the weight "
            "index; remove them or add them to the index"
        )
    return layout


def prepare_rewrite(
    src: str | os.PathLike,
    plan: PruningPlan | ScoresCut,
    dst: str | os.PathLike,
    *,
    scores_path: str | os.PathLike | None = None,
    force: bool = False,
    method: str = DEFAULT_METHOD,
    extra_layers: ExtraLayers = "error",
    progress: bool = True,
    hash_source: bool = True,
    hash_cache: str | os.PathLike | None | bool = None,
    output_checksum: str | None = None,
    manifest_extra: dict | None = None,
    replace_tensors: dict | None = None,
    replace_reason: str = "written from memory",
) -> RewriteJob:
    """Check everything that can be checked before any byte is written, once: the source
    (:func:`inspect_source`), the destination (:func:`check_destination`), the plan (a
    :class:`ScoresCut` is cut here, against the source's layout) and its binding to the
    checkpoint (:func:`bind_plan`), the scores file. Returns the job; nothing is written.

    :param plan: kept original ids per MoE layer (model module paths), or the cut that
        makes them from a scores file
    :param scores_path: the scores file the plan was cut from (hashed into the manifest)
    :param force: replace an existing non-empty ``dst`` (never ``src``)
    :param method: recorded in the manifest
    :param extra_layers: what to do with MoE blocks the plan does not name:
        ``"error"`` (default), ``"like-last"`` or ``{checkpoint_prefix: plan_layer}``
    :param progress: a progress bar over the bytes copied and hashed
    :param hash_source: sha256 every source shard (in a pool beside the writer)
    :param hash_cache: cache file for source shard hashes, keyed by file identity;
        ``None`` = :func:`default_hash_cache`, ``False`` = no cache
    :param output_checksum: checksum recorded per output shard: ``"xxh3_128"``
        (default when ``xxhash`` is installed) or ``"sha256"``
    :param manifest_extra: merged into the manifest (e.g. the caller's parameters)
    :param replace_tensors: ``{plan layer: {relative name: tensor}}`` written from memory
        instead of the source bytes (e.g. fitted router rows; never an expert tensor,
        see :mod:`.replaced_tensors`); recorded with ``replace_reason`` in the manifest
    """
    src = Path(src)
    layout = inspect_source(src)
    dst = check_destination(src, dst, force=force)
    if isinstance(plan, ScoresCut):
        plan = plan.plan_for(layout)
    spec = bind_plan(layout, plan, extra_layers=extra_layers)
    replacements = bind_replacements(spec, replace_tensors or {}, replace_reason)
    scores = None
    if scores_path is not None:
        scores_path = Path(scores_path)
        if not scores_path.is_file():
            raise CheckpointError(f"scores file {scores_path} does not exist")
        scores = {"path": str(scores_path.resolve()), "sha256": sha256_file(scores_path)}
    cache = (
        default_hash_cache()
        if hash_cache is None or hash_cache is True
        else (Path(hash_cache) if hash_cache else None)
    )
    return RewriteJob(
        src=src,
        dst=dst,
        plan=plan,
        layout=layout,
        spec=spec,
        scores=scores,
        force=force,
        method=method,
        progress=progress,
        hash_source=hash_source,
        hash_cache=cache,
        output_checksum=output_checksum,
        manifest_extra=manifest_extra,
        replacements=replacements,
    )


@dataclass
class RewriteJob:
    """A checked rewrite of ``src`` into ``dst`` (made by :func:`prepare_rewrite`)."""

    src: Path
    dst: Path
    plan: PruningPlan
    layout: CheckpointLayout
    spec: RewriteSpec
    scores: dict | None
    force: bool
    method: str
    progress: bool
    hash_source: bool
    hash_cache: Path | None
    output_checksum: str | None
    manifest_extra: dict | None
    replacements: dict | None = None

    def summary(self) -> str:
        """One line: what will be written."""
        extra = self.spec.extra
        cut_like = sorted({v["kept_from"] for v in extra.values()})
        return (
            f"pruning {self.src} -> {self.dst}: {self.plan.num_experts} -> {self.plan.num_kept} "
            f"experts in {len(self.spec.block_kept)} MoE layers"
            + (f" ({len(extra)} cut like {cut_like})" if extra else "")
        )

    def run(self) -> Path:
        """Write ``dst``: the source with the plan applied, bit-exact.

        The run claims ``dst`` (one run at a time; leftovers of killed runs are removed,
        see :mod:`.destination`), builds the output in a temporary directory next to it
        and swaps it into place when complete; on any error (or interrupt) the temporary
        directory is removed and ``dst`` is left as it was. ``src`` is only read.
        ``dst/pruning_manifest.json`` records the plan, the sha256 of every source shard
        (unless ``hash_source=False``) and of the scores file, the layer map, and the size
        and checksum of every output shard. Returns the destination path.
        """
        hasher = None
        if self.hash_source:
            layout = self.layout
            hasher = SourceHasher(
                {shard: layout.path / shard for shard in layout.shards}, cache=self.hash_cache
            )
        bar = None
        tmp = work_path(self.dst, "tmp")
        with DestinationClaim(self.dst) as claim:
            try:
                # again: another run may have finished meanwhile
                check_destination(self.src, self.dst, force=self.force)
                claim.clean_leftovers()
                _make_work_dir(tmp)
                if hasher is not None:
                    hasher.prepare()
                if self.progress:
                    bar = self._progress_bar(hasher)
                if hasher is not None:
                    hasher.start()
                converter = ExpertPlanPruner(
                    self.spec,
                    progress=bar.update if bar else None,
                    output_checksum=self.output_checksum,
                )
                convert(self.layout.path, tmp, converter)
                source_shards = hasher.result() if hasher is not None else None
                if bar is not None:
                    bar.close()
                _check_written(tmp, converter)
                _check_whole(tmp, self.spec)
                if self.replacements:
                    converter.output_checksums.update(
                        write_replacements(tmp, self.replacements, converter.output_checksum)
                    )
                manifest = self._manifest(converter, source_shards, hasher)
                write_json_atomic(tmp / MANIFEST_NAME, manifest)
                pause_point("rename")
                swap_into_place(tmp, self.dst)
            except BaseException:
                if hasher is not None:
                    hasher.cancel()
                if bar is not None:
                    bar.close()
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        logger.info(
            f"REAP: wrote {self.dst} ({self.plan.num_experts} -> {self.plan.num_kept} experts "
            f"in {len(self.spec.block_kept)} MoE layers; {converter.counts})"
        )
        return self.dst

    def _progress_bar(self, hasher: SourceHasher | None):
        from tqdm.auto import tqdm

        layout = self.layout
        kept = sum(
            r[1] - r[0]
            for shard in layout.shards
            for _, _, ranges, _ in self.spec.output_plan(
                shard, [n for n, s in layout.weight_map.items() if s == shard]
            )
            for r in ranges
        )
        total = kept + (hasher.bytes_to_hash if hasher is not None else 0)
        bar = tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc="reap prune",
            dynamic_ncols=True,
        )
        if hasher is not None:
            hasher.progress = bar.update
        return bar

    def _manifest(self, converter: ExpertPlanPruner, source_shards, hasher) -> dict:
        layout, spec = self.layout, self.spec
        extra = {
            "checkpoint": {
                "source_format": layout.quantization_formats,
                "layer_map": spec.layer_map,
                "extra_layers": spec.extra,
                "block_kept": spec.block_kept,
                "count_keys": spec.count_keys,
                "cut_tensors": spec.cut_tensors(),
                "index_file": layout.index_file,
                "output_shards": {
                    name: {
                        "bytes": converter.output_bytes[name],
                        converter.output_checksum: converter.output_checksums.get(name),
                    }
                    for name in sorted(converter.output_bytes)
                },
                "output_checksum": converter.output_checksum,
                "tensors": dict(converter.counts),
                "quantization_config_names": dict(converter.quant_stats),
                **(
                    {"replaced_tensors": replacement_record(self.replacements)}
                    if self.replacements
                    else {}
                ),
            }
        }
        if self.manifest_extra:
            extra.update(self.manifest_extra)
        source = {"path": str(layout.path.resolve()), "shards": source_shards}
        if hasher is not None:
            source["sha256_from_cache"] = sorted(hasher.cached)
        return build_manifest(
            self.plan,
            method=self.method,
            model_class=layout.model_class,
            count_key=spec.count_keys[0]
            if len(spec.count_keys) == 1
            else ",".join(spec.count_keys),
            source=source,
            scores=self.scores,
            extra=extra,
        )


def _make_work_dir(tmp: Path) -> None:
    try:
        os.mkdir(tmp)
    except OSError as exc:
        raise DestinationError(
            f"cannot create {tmp} ({exc.strerror}); choose an --out in a folder you can write"
        ) from exc


def _check_written(tmp: Path, converter: ExpertPlanPruner) -> None:
    written = {p.relative_to(tmp).as_posix() for p in tmp.rglob("*.safetensors")}
    if written != set(converter.output_bytes):
        raise CheckpointError(
            f"internal error: shards written {sorted(written)} != recorded {sorted(converter.output_bytes)}"
        )


def _check_whole(tmp: Path, spec: RewriteSpec) -> None:
    """The wholeness rule on the written headers, before the output is swapped into place
    (the rules :func:`bind_plan` applied make a failure here an internal error)."""
    shapes = {}
    for shard in tmp.rglob("*.safetensors"):
        header = read_safetensors_header(shard, strict=False)
        shapes.update({name: e.shape for name, e in header.entries.items()})
    problems = spec.left_behind(shapes)
    if problems:
        raise NotWholeError(
            f"internal error: the written checkpoint is not whole ({'; '.join(problems[:8])}); "
            "it was not kept"
        )


def rewrite_checkpoint(
    src: str | os.PathLike, plan: PruningPlan | ScoresCut, dst: str | os.PathLike, **options
) -> Path:
    """Write ``dst``: the checkpoint at ``src`` with ``plan`` applied, bit-exact;
    ``prepare_rewrite(src, plan, dst, **options).run()`` (the options are
    :func:`prepare_rewrite`'s). Returns the destination path."""
    return prepare_rewrite(src, plan, dst, **options).run()
