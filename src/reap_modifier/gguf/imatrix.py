"""An importance matrix sliced like its model: ``llama-quantize --imatrix`` refuses an
unpruned imatrix on a pruned model (``imatrix size ... is different from tensor size``).

The imatrix GGUF format (``llama-imatrix``'s default) holds ``<tensor>.in_sum2`` and
``<tensor>.counts`` per weight; for an expert tensor their outermost dimension is the
expert, so the kept experts' rows are byte ranges, cut with the model's plan. The legacy
``.dat`` format is refused: convert it first (``llama-imatrix --in-file x.dat -o x.gguf``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.destination import check_destination, work_path
from .binding import GGUFSpec, slab_ranges
from .errors import GGUFError
from .layout import GGUFPart, read_part
from .writer import OutTensor, write_part

__all__ = ["ImatrixJob", "prepare_imatrix", "sliced_tensors"]

_SUFFIXES = (".in_sum2", ".counts")


def sliced_tensors(part: GGUFPart, spec: GGUFSpec) -> list[OutTensor]:
    """The imatrix's tensors with the kept experts' rows of every expert tensor's entries."""
    out = []
    for t in part.tensors:
        base = next((t.name[: -len(s)] for s in _SUFFIXES if t.name.endswith(s)), None)
        layer = spec.per_expert.get(base) if base else None
        if layer is None:
            out.append(OutTensor(t.name, t.dims, t.ggml_type, [(t.offset, t.offset + t.nbytes)]))
            continue
        if t.dims[-1] != spec.num_experts:
            raise GGUFError(
                f"imatrix entry {t.name} has {t.dims[-1]} experts, the model {spec.num_experts}; "
                "give the imatrix computed on this model"
            )
        kept = spec.block_kept[layer]
        out.append(OutTensor(t.name, (*t.dims[:-1], len(kept)), t.ggml_type, slab_ranges(t, kept)))
    return out


@dataclass
class ImatrixJob:
    """A checked slice of ``src`` into ``dst``: written to a temporary file beside ``dst``,
    renamed once the model is in place."""

    src: Path
    dst: Path
    part: GGUFPart
    tensors: list[OutTensor]
    tmp: Path | None = None

    def write(self) -> None:
        self.tmp = work_path(self.dst, "tmp")
        fields = [f.raw for f in self.part.fields]
        write_part(self.tmp, self.src, self.part.version, fields, self.tensors, self.part.alignment)

    def commit(self) -> None:
        if self.tmp is not None:
            os.replace(self.tmp, self.dst)
            self.tmp = None

    def discard(self) -> None:
        if self.tmp is not None:
            self.tmp.unlink(missing_ok=True)
            self.tmp = None


def prepare_imatrix(
    src: str | os.PathLike, dst: str | os.PathLike, spec: GGUFSpec, *, force: bool, model_dst: Path
) -> ImatrixJob:
    """Check the imatrix ``src`` against the bound plan and ``dst`` as an output, before
    anything is written."""
    src = Path(src)
    if not src.is_file():
        raise GGUFError(f"--imatrix {src} does not exist")
    with open(src, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFError(
                f"--imatrix {src} is in the legacy .dat format; convert it to GGUF first "
                f"(llama-imatrix --in-file {src.name} -o {src.stem}.gguf)"
            )
    part = read_part(src)
    tensors = sliced_tensors(part, spec)
    if not any(t.name.endswith(_SUFFIXES) for t in tensors):
        raise GGUFError(f"--imatrix {src} holds no importance-matrix entries (*.in_sum2)")
    dst = check_destination(src, dst, force=force)
    if dst == Path(os.path.abspath(model_dst)):
        raise GGUFError("--imatrix-out is the model's --out; give the imatrix its own file")
    return ImatrixJob(src=src, dst=dst, part=part, tensors=tensors)
