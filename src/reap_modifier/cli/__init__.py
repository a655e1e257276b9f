"""The ``reap`` command line: one typer app, commands grouped by stage.

- ``reap scores merge|show|from-weights``, ``reap cut``: :mod:`.scores`
- ``reap tiers``, ``reap compare``: :mod:`.analysis`
- ``reap prune``, ``reap verify``: :mod:`.checkpoint`
- ``reap export-gguf``: :mod:`.gguf`
- ``reap eval``: :mod:`.evaluate`

Exit codes (every command): 0 ok; 1 a check failed (``reap verify`` found a problem,
or a rewrite failed after its inputs were accepted); 2 usage or bad input (the
message says what to change, nothing was written); 130 ``reap prune`` interrupted
(Ctrl-C / SIGTERM; nothing was written).
"""

from __future__ import annotations

from importlib import import_module

import typer

from .common import HELP_OPTIONS, third_party_logs_to_stderr

__all__ = ["app"]

app = typer.Typer(
    name="reap",
    help="REAP expert pruning: scores, plans, checkpoint surgery and verification.",
    epilog="Exit codes: 0 ok, 1 a check failed, 2 usage or bad input, 130 interrupted. "
    "Example: reap cut scores.safetensors --keep 448 -o plan.json",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    context_settings=HELP_OPTIONS,
)


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"reap-modifier {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="print the version and exit"
    ),
) -> None:
    """REAP expert pruning: scores, plans, checkpoint surgery and verification."""
    third_party_logs_to_stderr()


for _module in ("scores", "analysis", "checkpoint", "gguf", "evaluate"):
    import_module(f"{__name__}.{_module}").register(app)

if __name__ == "__main__":  # pragma: no cover
    app()
