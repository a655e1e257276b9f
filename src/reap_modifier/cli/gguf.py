"""``reap prune`` and ``reap verify`` on a GGUF model (a ``.gguf`` file, or the parts of a
split): the same plan, scores and keep-count options as for a checkpoint, checked before
anything is written; bad input exits 2 with one line saying what to change. ``reap
export-gguf``: a checkpoint (MXFP4 compressed-tensors experts included) to a GGUF file."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import typer

from .common import EXIT_CHECK_FAILED, OUTPUT_ALIASES, check_failed, command_class, fail

__all__ = ["prune_gguf", "register", "verify_gguf_cli", "verify_with_llama_cpp"]

EXPORT_EXAMPLE = (
    "Example: reap export-gguf /models/Qwen3-30B-A3B-MXFP4-96 -o qwen3-96-MXFP4.gguf "
    "--converter build/llama-cpp/converter --outtype bf16"
)


def prune_gguf(
    src: Path,
    out: Path,
    scores,
    plan,
    cut: dict,
    extra_layers,
    save_plan,
    force,
    options: dict,
    run,
):
    """``reap prune SRC.gguf``: the checked job (:func:`~reap_modifier.gguf.prepare_gguf_rewrite`),
    the plan saved, then ``run(job)`` (the checkpoint command's runner: interrupts, exit codes)."""
    from ..gguf import GGUFError, prepare_gguf_rewrite
    from ..scores import ScoresError
    from ..scores.plan import PlanError, PruningPlan

    not_for_gguf = [
        flag
        for flag, given in (
            ("--no-hash-source", not options["hash_source"]),
            ("--no-hash-cache", options["hash_cache"] is False),
            ("--output-checksum", options["output_checksum"] is not None),
        )
        if given
    ]
    if not_for_gguf:
        fail(
            f"{', '.join(not_for_gguf)} apply to safetensors checkpoints, not to a GGUF source; drop them"
        )
    gguf = options["gguf"]
    try:
        if plan is not None:
            the_plan = PruningPlan.load(plan)
        else:
            the_plan = {"scores_path": scores, **cut}
        job = prepare_gguf_rewrite(
            src,
            the_plan,
            out,
            force=force,
            extra_layers=extra_layers,
            provenance=not gguf["no_provenance"],
            imatrix=gguf["imatrix"],
            imatrix_out=gguf["imatrix_out"],
            progress=options["progress"],
        )
    except (GGUFError, PlanError, ScoresError) as exc:
        fail(exc)
    except OSError as exc:
        fail(f"cannot read {exc.filename or src}: {exc.strerror or exc}")
    if save_plan is not None:
        try:
            job.plan.save(save_plan)
        except OSError as exc:
            fail(f"--save-plan {save_plan}: cannot write it ({exc.strerror})")
    typer.echo(job.summary(), err=True)
    typer.echo(str(run(job)))


def verify_gguf_cli(dst: Path, source: Path | None, quiet: bool):
    """``reap verify DST.gguf [--source SRC.gguf]``: the report (exit 1 on a failure)."""
    from ..gguf import GGUFError
    from ..gguf.verify import verify_gguf

    try:
        report = verify_gguf(dst, source=source, progress=not quiet)
    except (OSError, GGUFError) as exc:
        fail(f"{dst}: verification could not read the files ({exc})", EXIT_CHECK_FAILED)
    for w in report.warnings:
        typer.echo(f"warning: {w}", err=True)
    if not report.ok:
        check_failed(
            report.failures, f"{dst}: verification FAILED ({len(report.failures)} problem(s))"
        )
    return report


def verify_with_llama_cpp(dst: Path, reference: Path, python: Path | None) -> None:
    """``reap verify X.gguf --llama-cpp --reference DIR``: llama.cpp's logits against
    transformers' (exit 1 when they disagree)."""
    from ..gguf.layout import is_gguf
    from ..serving.llama_cpp_check import LlamaCppNotFound, check_with_llama_cpp

    if not is_gguf(dst):
        fail("--llama-cpp runs a GGUF model; give a .gguf file")
    try:
        report = check_with_llama_cpp(dst, reference, python=python)
    except LlamaCppNotFound as exc:
        fail(exc)
    except (RuntimeError, OSError, ValueError) as exc:
        fail(f"{dst}: the llama.cpp check could not run ({exc})", EXIT_CHECK_FAILED)
    line = (
        f"max |logit difference| {report.max_abs_diff:.3g}, top-1 agreement "
        f"{report.top1_agreement:.3f}, mean KL {report.mean_kl:.3g}"
    )
    if not report.ok:
        check_failed(report.failures, f"{dst}: llama.cpp check FAILED ({line})")
    typer.echo(f"{dst}: llama.cpp check OK ({line}, vs {reference} in transformers)")


def register(app: typer.Typer) -> None:
    """Add ``export-gguf`` to ``app``."""

    @app.command("export-gguf", epilog=EXPORT_EXAMPLE, cls=command_class(aliases=OUTPUT_ALIASES))
    def export_gguf_cli(
        model: Path = typer.Argument(..., help="checkpoint directory (safetensors)"),
        out: Path = typer.Option(
            ..., "--out", "-o", help="the .gguf file; written next to it, then renamed"
        ),
        converter: Path | None = typer.Option(
            None,
            "--converter",
            envvar="REAP_GGUF_CONVERTER",
            help="folder of llama.cpp's convert_hf_to_gguf.py (scripts/llama_cpp_converter.sh extracts it)",
        ),
        outtype: Literal["auto", "f32", "f16", "bf16", "q8_0"] = typer.Option(
            "auto",
            "--outtype",
            help="the tensors that are not MXFP4 experts (auto: the checkpoint's 16-bit type)",
        ),
        model_name: str | None = typer.Option(
            None, "--model-name", help="general.name of the file (default: the folder's name)"
        ),
        force: bool = typer.Option(False, "--force", help="replace an existing output"),
    ):
        """Convert a checkpoint to GGUF with llama.cpp's converter; MXFP4 compressed-tensors
        routed experts (Qwen3-MoE, DeepSeek-V3) are repacked bit for bit, not dequantized."""
        from ..gguf.errors import GGUFError
        from ..gguf.export import export_gguf

        try:
            path = export_gguf(
                model, out, converter=converter, outtype=outtype, model_name=model_name, force=force
            )
        except GGUFError as exc:
            fail(exc)
        typer.echo(str(path))
