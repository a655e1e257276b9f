"""``reap prune`` on a GGUF model: inspect, bind, check the destination once
(:func:`prepare_gguf_rewrite`); then run (:meth:`GGUFRewriteJob.run`).

The output is the source with the plan applied: each kept expert's slab copied verbatim
(whatever its quantization), the router rows and routing bias of the kept experts,
``{arch}.expert_count`` set, ``general.size_label`` re-derived where the converter derived
it, and the provenance keys (:mod:`.provenance`). Every other key, its order and the
tensor order are the source's, so the file is byte-identical to converting the pruned
safetensors with llama.cpp's converter (with ``provenance=False``; the keys are appended
last otherwise). A split model (``name-00001-of-0000n.gguf``) is written as the same parts,
into the directory ``dst``. The output is built beside ``dst`` and renamed into place
(:mod:`reap_modifier.checkpoint.destination`): on any error or Ctrl-C nothing is left.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from ..checkpoint.destination import (
    DestinationClaim,
    check_destination,
    swap_into_place,
    work_path,
)
from ..pause_points import pause_point
from ..scores.plan import PruningPlan
from .binding import GGUFSpec, bind_gguf_plan
from .errors import GGUFError
from .imatrix import ImatrixJob, prepare_imatrix
from .layout import GGUFLayout, GGUFPart, inspect_gguf
from .provenance import PROVENANCE_PREFIX, provenance_fields, size_label
from .scores_cut import plan_from_scores
from .writer import OutTensor, encode_field, write_part

__all__ = ["DEFAULT_METHOD", "GGUFRewriteJob", "prepare_gguf_rewrite"]

DEFAULT_METHOD = "REAP (GGUF rewrite)"
_SIZE_LABEL = "general.size_label"


def prepare_gguf_rewrite(
    src: str | os.PathLike,
    plan: PruningPlan | dict,
    dst: str | os.PathLike,
    *,
    force: bool = False,
    extra_layers: str = "error",
    method: str = DEFAULT_METHOD,
    provenance: bool = True,
    imatrix: str | os.PathLike | None = None,
    imatrix_out: str | os.PathLike | None = None,
    progress: bool = True,
) -> GGUFRewriteJob:
    """Check everything before any byte is written: the source (:func:`inspect_gguf`), the
    destination, the plan (a dict of :func:`plan_from_scores` options is cut here against
    the file) and its binding (:func:`bind_gguf_plan`), and the imatrix to slice.
    Returns the job; nothing is written.

    :param plan: kept original ids per MoE layer, or ``{"scores_path", "keep", ...}``
    :param dst: the output ``.gguf`` file; a directory for a split source
    :param force: replace an existing output (never the source)
    :param extra_layers: MoE layers the plan does not name (MTP / next-token layers):
        ``"error"`` or ``"like-last"``
    :param provenance: append the ``reap.*`` keys (source count, kept ids per layer)
    :param imatrix: an importance matrix (GGUF) of the source to slice into ``imatrix_out``
    """
    src = Path(src)
    layout = inspect_gguf(src)
    dst = _check_output(src, dst, layout, force)
    if isinstance(plan, dict):
        plan = plan_from_scores(layout, **plan)
    spec = bind_gguf_plan(layout, plan, extra_layers=extra_layers)
    imx = None
    if (imatrix is None) != (imatrix_out is None):
        raise GGUFError("give both --imatrix (the source's) and --imatrix-out, or neither")
    if imatrix is not None:
        imx = prepare_imatrix(imatrix, imatrix_out, spec, force=force, model_dst=dst)
    return GGUFRewriteJob(
        src=src,
        dst=dst,
        plan=plan,
        layout=layout,
        spec=spec,
        force=force,
        method=method,
        provenance=provenance,
        imatrix=imx,
        progress=progress,
    )


def _check_output(src: Path, dst, layout: GGUFLayout, force: bool) -> Path:
    dst = Path(dst)
    if layout.split:
        if dst.suffix.lower() == ".gguf":
            raise GGUFError(
                f"{src} is a split model: give --out a directory (its parts are written there "
                "under their source names)"
            )
    elif dst.suffix.lower() != ".gguf":
        raise GGUFError(f"--out {dst}: give the output a .gguf name (llama.cpp loads by it)")
    for part in layout.parts:
        check_destination(part.path, dst, force=force)
    return check_destination(src, dst, force=force)


@dataclass
class GGUFRewriteJob:
    """A checked rewrite of ``src`` into ``dst`` (made by :func:`prepare_gguf_rewrite`)."""

    src: Path
    dst: Path
    plan: PruningPlan
    layout: GGUFLayout
    spec: GGUFSpec
    force: bool
    method: str
    provenance: bool
    imatrix: ImatrixJob | None
    progress: bool
    written: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        """One line: what will be written."""
        extra = self.spec.extra
        return (
            f"pruning {self.src} -> {self.dst}: {self.spec.num_experts} -> {self.spec.num_kept} "
            f"experts in {len(self.spec.block_kept)} MoE layers"
            + (
                f" ({len(extra)} cut like blk.{max(v['kept_from'] for v in extra.values())})"
                if extra
                else ""
            )
        )

    def out_tensors(self, part: GGUFPart) -> list[OutTensor]:
        """The tensors of one output part, in the source's order."""
        out = []
        for t in part.tensors:
            dims, ranges = self.spec.output_tensor(t)
            out.append(OutTensor(t.name, tuple(dims), t.ggml_type, ranges))
        return out

    def out_fields(self, part: GGUFPart, index: int) -> list[bytes]:
        """The key/value fields of one output part (see the module docstring)."""
        layout, spec = self.layout, self.spec
        count_key = layout.key("expert_count")
        label = self._size_label()
        fields = []
        for f in part.fields:
            if f.key.startswith(PROVENANCE_PREFIX):
                continue  # a pruned source's own provenance: replaced below
            if f.key == count_key:
                fields.append(encode_field(f.key, spec.num_kept, f.types[0]))
            elif f.key == _SIZE_LABEL and label is not None:
                fields.append(encode_field(f.key, label, f.types[0]))
            else:
                fields.append(f.raw)
        if self.provenance and index == 0:
            fields += [
                encode_field(k, v, t)
                for k, v, t in provenance_fields(spec.num_experts, spec.block_kept, self.method)
            ]
        return fields

    def _size_label(self) -> str | None:
        """The re-derived size label, where the source's is the converter's derived one."""
        source = self.layout.values.get(_SIZE_LABEL)
        tensors = [t for p in self.layout.parts for t in p.tensors]
        if source is None or source != size_label((t.name, t.dims) for t in tensors):
            return None
        return size_label((t.name, self.spec.output_tensor(t)[0]) for t in tensors)

    def run(self) -> Path:
        """Write ``dst`` (and the sliced imatrix); returns ``dst``. Nothing is left behind
        on an error or an interrupt; ``src`` is only read."""
        tmp = work_path(self.dst, "tmp")
        bar = None
        with DestinationClaim(self.dst) as claim:
            try:
                for part in self.layout.parts:  # again: another run may have finished meanwhile
                    check_destination(part.path, self.dst, force=self.force)
                claim.clean_leftovers()
                bar = self._progress_bar()
                if self.imatrix is not None:
                    self.imatrix.write()
                self._write(tmp, bar.update if bar else None)
                if bar is not None:
                    bar.close()
                pause_point("rename")
                swap_into_place(tmp, self.dst)
            except BaseException:
                if bar is not None:
                    bar.close()
                if self.imatrix is not None:
                    self.imatrix.discard()
                _remove(tmp)
                raise
        if self.imatrix is not None:
            self.imatrix.commit()
        logger.info(
            f"REAP: wrote {self.dst} ({self.spec.num_experts} -> {self.spec.num_kept} experts in "
            f"{len(self.spec.block_kept)} MoE layers, {sum(self.written.values())} bytes)"
        )
        return self.dst

    def _write(self, tmp: Path, progress) -> None:
        parts = self.layout.parts
        if self.layout.split:
            _make_dir(tmp)
        for i, part in enumerate(parts):
            out = tmp / part.path.name if self.layout.split else tmp
            self.written[out.name] = write_part(
                out,
                part.path,
                part.version,
                self.out_fields(part, i),
                self.out_tensors(part),
                part.alignment,
                progress,
            )

    def _progress_bar(self):
        if not self.progress:
            return None
        from ..checkpoint.range_hashes import progress_bar

        total = sum(t.nbytes for p in self.layout.parts for t in self.out_tensors(p))
        return progress_bar(True, total, "reap prune")


def _make_dir(tmp: Path) -> None:
    try:
        os.mkdir(tmp)
    except OSError as exc:
        raise GGUFError(
            f"cannot create {tmp} ({exc.strerror}); choose an --out in a folder you can write"
        ) from exc


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
