"""``reap prune`` and ``reap verify``: the checkpoint commands.

Every input is checked before any expensive work (hashing, copying): the scores
file or plan, the keep count, the plan against the checkpoint (layers, counts,
top-k, groups) and the destination.  Bad input exits with code 2 and one line
saying what to change; a failed verification exits with code 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from .common import (
    EXIT_CHECK_FAILED,
    EXIT_INTERRUPTED,
    VLLM_ARG_OPTION,
    VLLM_PYTHON_OPTION,
    check_failed,
    fail,
    interruptible,
)

__all__ = ["register"]

PRUNE_EXAMPLE = (
    "Examples: reap prune /models/K3 --scores scores.safetensors --keep 448 --divisible-by 8 "
    "--out /models/K3-448 ; reap prune /models/K3 --plan plan.json --out /models/K3-448 ; "
    "reap prune model-Q4_K_M.gguf --plan plan.json -o model-448-Q4_K_M.gguf"
)
VERIFY_EXAMPLE = (
    "Example: reap verify /models/K3-448 --source /models/K3; "
    "reap verify pruned/ --vllm --vllm-python .venv-vllm/bin/python --vllm-dtype float32"
)


def _check_prune_args(scores, plan, keep, sparsity, divisible_by, output_checksum) -> None:
    """``reap prune``'s options that exclude or require each other (exit 2)."""
    from ..scores.keep_count import PlanError, check_keep_spec

    if (scores is None) == (plan is None):
        fail("give exactly one of --scores (with --keep or --sparsity) or --plan")
    if plan is not None and (keep is not None or sparsity is not None or divisible_by is not None):
        fail(
            "--keep / --sparsity / --divisible-by cut a plan from --scores; they do not apply to --plan"
        )
    if scores is not None:
        try:
            check_keep_spec(keep, sparsity, "--keep N", "--sparsity S")
        except PlanError as exc:
            fail(exc)
    if output_checksum not in (None, "xxh3_128", "sha256"):
        fail(f"--output-checksum must be xxh3_128 or sha256, got {output_checksum!r}")


def _prepare_prune(
    src: Path, out: Path, scores: Path | None, plan: Path | None, cut: dict, **options
):
    """The checked rewrite job (:func:`~reap_modifier.checkpoint.prepare_rewrite`); bad
    input exits 2 before any expensive work."""
    from ..checkpoint import CheckpointError, ScoresCut, prepare_rewrite
    from ..scores import ScoresError
    from ..scores.plan import PlanError, PruningPlan

    try:
        the_plan = PruningPlan.load(plan) if plan is not None else ScoresCut(scores, **cut)
        return prepare_rewrite(src, the_plan, out, scores_path=scores, **options)
    except (CheckpointError, PlanError, ScoresError) as exc:
        fail(exc)
    except OSError as exc:
        fail(f"cannot read {exc.filename or src}: {exc.strerror or exc}")


def _run_prune(job) -> Path:
    """Run the rewrite; a destination taken meanwhile exits 2, a failure or an interrupt
    exits with the output neither written nor replaced."""
    from ..checkpoint import CheckpointError, DestinationError
    from ..scores.plan import PlanError

    out = job.dst
    try:
        with interruptible():
            return job.run()
    except DestinationError as exc:  # taken by another run meanwhile, not writable
        fail(exc)
    except (CheckpointError, PlanError) as exc:
        fail(exc, EXIT_CHECK_FAILED)
    except KeyboardInterrupt:
        fail(
            f"interrupted: {out} was not written (nor replaced) and the source is untouched; "
            "rerun the same command to start again",
            EXIT_INTERRUPTED,
        )
    except OSError as exc:
        fail(
            f"{exc.strerror or exc} ({exc.filename or out}): {out} was not written (nor replaced) "
            "and the source is untouched",
            EXIT_CHECK_FAILED,
        )


def _prune(
    src, out, scores, plan, cut: dict, extra_layers, save_plan, force, options: dict
) -> None:
    """``reap prune``'s work: check the options, prepare the job, save the plan, run (a GGUF
    source goes to :func:`~reap_modifier.cli.gguf.prune_gguf`)."""
    from ..gguf.layout import is_gguf

    keep, sparsity, divisible_by = cut["keep"], cut["sparsity"], cut["divisible_by"]
    _check_prune_args(scores, plan, keep, sparsity, divisible_by, options["output_checksum"])
    if extra_layers not in ("error", "like-last"):
        fail(f"--extra-layers must be 'error' or 'like-last', got {extra_layers!r}")
    if save_plan is not None and save_plan.is_dir():
        fail(f"--save-plan {save_plan} is a directory; give the path of the JSON file to write")
    gguf = options.pop("gguf")
    if is_gguf(src):
        from .gguf import prune_gguf

        prune_gguf(
            src,
            out,
            scores,
            plan,
            cut,
            extra_layers,
            save_plan,
            force,
            {**options, "gguf": gguf},
            _run_prune,
        )
        return
    if any(v for v in gguf.values()):
        fail("--imatrix / --imatrix-out / --no-provenance apply to a GGUF source (a .gguf file)")
    job = _prepare_prune(
        src,
        out,
        scores,
        plan,
        cut,
        force=force,
        extra_layers=extra_layers,
        manifest_extra={"cli": {"argv": sys.argv[1:], "plan_file": str(plan) if plan else None}},
        **options,
    )
    if save_plan is not None:
        try:
            job.plan.save(save_plan)
        except OSError as exc:
            fail(f"--save-plan {save_plan}: cannot write it ({exc.strerror})")
    typer.echo(job.summary(), err=True)
    typer.echo(str(_run_prune(job)))


def _verify(dst: Path, source: Path | None, quiet: bool) -> None:
    """``reap verify`` without vLLM: run the checks, print the verdict (exit 1 on failure)."""
    from ..checkpoint.errors import CheckpointError
    from ..checkpoint.verify import verify_checkpoint
    from ..gguf.layout import is_gguf

    if is_gguf(dst):
        from .gguf import verify_gguf_cli

        report = verify_gguf_cli(dst, source, quiet)
    else:
        try:
            report = verify_checkpoint(dst, source=source, progress=not quiet)
        except (OSError, CheckpointError) as exc:
            fail(f"{dst}: verification could not read the files ({exc})", EXIT_CHECK_FAILED)
    for w in report.warnings:
        typer.echo(f"warning: {w}", err=True)
    if not report.ok:
        check_failed(
            report.failures, f"{dst}: verification FAILED ({len(report.failures)} problem(s))"
        )
    info = report.info
    typer.echo(
        f"{dst}: OK ({info.get('moe_layers')} MoE layers x {info.get('num_experts')} experts, "
        f"{info.get('tensors')} tensors in {info.get('shards')} shards"
        + (
            f", {info.get('tensors_matching_source')} tensors sha256-equal to the source"
            if info.get("checked_against_source")
            else ""
        )
        + ")"
    )
    for name, why in sorted((info.get("differs_from_source") or {}).items()):
        typer.echo(f"  {name}: differs from the source: {why} (recorded in the manifest)")
    for line in info.get("post_cut_fit") or []:
        typer.echo(f"  post-cut fit: {line}")


def register(app: typer.Typer) -> None:
    """Add ``prune`` and ``verify`` to ``app``."""
    _register_prune(app)
    _register_verify(app)


def _register_prune(app: typer.Typer) -> None:
    """``reap prune``: its options; the work is :func:`_prune`."""

    @app.command("prune", epilog=PRUNE_EXAMPLE)
    def prune(
        src: Path = typer.Argument(
            ...,
            help="source checkpoint directory (safetensors, e.g. MXFP4 compressed-tensors), or a llama.cpp .gguf file (the first part of a split)",
        ),
        out: Path = typer.Option(
            ...,
            "--out",
            "-o",
            help="output directory, or .gguf file for a GGUF source (a directory for a split one); written next to it, then renamed",
        ),
        scores: Path | None = typer.Option(
            None, "--scores", help="scores file (safetensors) to cut the plan from"
        ),
        plan: Path | None = typer.Option(
            None, "--plan", help="plan.json to apply instead of cutting one"
        ),
        keep: int | None = typer.Option(None, "--keep", help="experts to keep per layer"),
        sparsity: float | None = typer.Option(
            None, "--sparsity", help="fraction of experts to drop, in (0, 1)"
        ),
        divisible_by: int | None = typer.Option(
            None, "--divisible-by", help="round the keep count down to a multiple of this"
        ),
        saliency: str = typer.Option(
            "reap",
            "--saliency",
            help="criterion: reap, frequency, weighted_frequency, ean, ean_mean, max_norm",
        ),
        extra_layers: str = typer.Option(
            "error",
            "--extra-layers",
            help="MoE layers in the checkpoint but not in the plan (e.g. an MTP layer): 'error' or 'like-last' (cut like the deepest plan layer)",
        ),
        save_plan: Path | None = typer.Option(
            None, "--save-plan", help="also write the plan used to this JSON file"
        ),
        force: bool = typer.Option(
            False, "--force", help="replace an existing non-empty output (never the source)"
        ),
        no_hash_source: bool = typer.Option(
            False,
            "--no-hash-source",
            help="skip sha256 of the source shards (faster; manifest then lacks them)",
        ),
        no_hash_cache: bool = typer.Option(
            False,
            "--no-hash-cache",
            help="rehash every source shard (by default a shard's sha256 is reused while its size/mtime/ctime/inode are unchanged; cache file: $REAP_SHA256_CACHE or ~/.cache/reap-modifier/sha256.json)",
        ),
        output_checksum: str | None = typer.Option(
            None,
            "--output-checksum",
            help="checksum recorded per output shard: xxh3_128 or sha256 (default: xxh3_128 when the xxhash package is installed, else sha256)",
        ),
        imatrix: Path | None = typer.Option(
            None,
            "--imatrix",
            help="GGUF source only: the source's importance matrix (GGUF format) to slice like the model",
        ),
        imatrix_out: Path | None = typer.Option(
            None, "--imatrix-out", help="GGUF source only: where the sliced importance matrix goes"
        ),
        no_provenance: bool = typer.Option(
            False,
            "--no-provenance",
            help="GGUF source only: no reap.* keys (source count, kept ids); the file is then byte-identical to converting the pruned safetensors, and reap verify cannot compare it with its source",
        ),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
    ):
        """Prune routed experts from a checkpoint or GGUF file: kept experts' bytes copied verbatim."""
        _prune(
            src,
            out,
            scores,
            plan,
            dict(keep=keep, sparsity=sparsity, divisible_by=divisible_by, saliency=saliency),
            extra_layers,
            save_plan,
            force,
            dict(
                progress=not quiet,
                hash_source=not no_hash_source,
                hash_cache=False if no_hash_cache else None,
                output_checksum=output_checksum,
                gguf=dict(imatrix=imatrix, imatrix_out=imatrix_out, no_provenance=no_provenance),
            ),
        )


def _register_verify(app: typer.Typer) -> None:
    """``reap verify``: its options; the work is :func:`_verify` and :func:`_verify_with_vllm`."""

    @app.command("verify", epilog=VERIFY_EXAMPLE)
    def verify(
        dst: Path = typer.Argument(
            ..., help="checkpoint directory or .gguf file to verify (a pruned output)"
        ),
        source: Path | None = typer.Option(
            None,
            "--source",
            help="the source checkpoint or .gguf: compare every tensor's sha256 (a GGUF's kept slabs)",
        ),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
        vllm: bool = typer.Option(
            False,
            "--vllm",
            help="also check that vLLM loads the checkpoint and serves the tokens transformers computes",
        ),
        vllm_python: Path | None = VLLM_PYTHON_OPTION,
        vllm_mode: str = typer.Option(
            "auto",
            "--vllm-mode",
            help="serve (OpenAI server + greedy tokens), load (weight loading only), auto",
        ),
        vllm_dtype: str = typer.Option(
            "auto", "--vllm-dtype", help="compute dtype on both sides: auto, bfloat16, float32"
        ),
        vllm_arg: list[str] | None = VLLM_ARG_OPTION,
        vllm_max_tokens: int = typer.Option(
            16, "--vllm-max-tokens", help="greedy tokens per prompt"
        ),
        no_reference: bool = typer.Option(
            False,
            "--no-reference",
            help="do not load the model in transformers: prove loading/serving only",
        ),
        vllm_work_dir: Path | None = typer.Option(
            None, "--vllm-work-dir", help="where server logs and the JSON report go"
        ),
        llama_cpp: bool = typer.Option(
            False,
            "--llama-cpp",
            help="GGUF only: also run it in llama.cpp (llama-cpp-python) and compare its logits with --reference in transformers",
        ),
        reference: Path | None = typer.Option(
            None,
            "--reference",
            help="with --llama-cpp: the checkpoint the GGUF must compute (e.g. the pruned safetensors)",
        ),
        llama_cpp_python: Path | None = typer.Option(
            None,
            "--llama-cpp-python",
            help="Python of an environment with llama-cpp-python (default: $REAP_LLAMA_CPP_PYTHON, ./.venv-llama-cpp/bin/python)",
        ),
    ):
        """Check a pruned checkpoint: counts, routers, expert indices, manifest, and (with --source) bytes."""
        if vllm and dst.suffix.lower() == ".gguf":
            fail(
                "--vllm checks safetensors checkpoints; a .gguf file runs in llama.cpp: drop --vllm"
            )
        if llama_cpp and reference is None:
            fail("--llama-cpp compares with a transformers checkpoint: give --reference DIR")
        _verify(dst, source, quiet)
        if llama_cpp:
            from .gguf import verify_with_llama_cpp

            verify_with_llama_cpp(dst, reference, llama_cpp_python)
        if vllm:
            _verify_with_vllm(
                dst,
                vllm_python,
                vllm_mode,
                vllm_dtype,
                vllm_arg or [],
                vllm_max_tokens,
                not no_reference,
                vllm_work_dir,
            )


def _verify_with_vllm(
    dst, python, mode, dtype, server_args, max_tokens, reference, work_dir
) -> None:
    """``reap verify --vllm``: print what was proved (loaded / served / tokens match)."""
    from ..serving.vllm_check import VllmNotFound, check_with_vllm

    if mode not in ("auto", "serve", "load"):
        fail(f"--vllm-mode must be auto, serve or load, got {mode!r}")
    if dtype not in ("auto", "bfloat16", "float16", "float32"):
        fail(f"--vllm-dtype must be auto, bfloat16, float16 or float32, got {dtype!r}")
    if max_tokens < 1:
        fail("--vllm-max-tokens must be at least 1")
    try:
        report = check_with_vllm(
            dst, vllm_python=python, mode=mode, dtype=dtype, reference=reference, max_tokens=max_tokens,
            server_args=server_args, work_dir=work_dir,
        )  # fmt: skip
    except (VllmNotFound, ValueError) as exc:
        fail(exc)
    for line in report.proved:
        typer.echo(f"vLLM {line}")
    for line in report.notes:
        typer.echo(f"note: {line}", err=True)
    if not report.ok:
        check_failed(report.failures, f"{dst}: vLLM check FAILED (log: {report.log_path})")
    verdict = "tokens match" if report.tokens_match else ("served" if report.served else "loaded")
    typer.echo(f"{dst}: vLLM check OK ({report.mode} mode: {verdict})")
