"""The ``reap`` command line: one typer app, commands grouped by concept.

- checkpoint commands (``reap prune``, ``reap verify``) live in :mod:`.cli_checkpoint`
- scores commands (``reap scores ...``, ``reap cut``, ``reap tiers``, ``reap compare``)
  live in :mod:`.cli_scores`
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="reap",
    help="REAP expert pruning: scores, plans, checkpoint surgery and verification.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)


def _register() -> None:
    from importlib import import_module

    for mod in ("cli_checkpoint", "cli_scores"):
        try:
            module = import_module(f"{__package__}.{mod}")
        except ModuleNotFoundError as exc:  # pragma: no cover - transitional
            if exc.name != f"{__package__}.{mod}":
                raise
            continue
        module.register(app)


_register()

if __name__ == "__main__":  # pragma: no cover
    app()
