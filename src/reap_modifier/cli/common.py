"""What every ``reap`` command shares: exit codes, consoles, error reporting, and
options that take several values after one flag.

Exit codes: ``0`` ok; ``1`` a check failed (``reap verify`` found a problem, or a
rewrite failed after its inputs were accepted); ``2`` usage or bad input (a message
on stderr says what to change; nothing was written); ``130`` interrupted (Ctrl-C or
SIGTERM; nothing was written).
"""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand

__all__ = [
    "EXIT_CHECK_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "GreedyCommand",
    "check_failed",
    "console",
    "err_console",
    "fail",
    "greedy",
    "key_values",
]

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it

console = Console()
if not console.is_terminal:  # pipes, CI logs, CliRunner: do not squeeze tables to 80 columns
    console.width = max(console.width, 160)
err_console = Console(stderr=True)


def fail(exc: Exception | str, code: int = EXIT_USAGE) -> NoReturn:
    """Print ``error: <message>`` on stderr and exit with ``code`` (no traceback).
    An ``OSError`` (``-o`` names a directory, a full or read-only disk) is said as
    its reason and the path it concerns."""
    if isinstance(exc, OSError):
        path = exc.filename2 or exc.filename
        msg = f"{exc.strerror or exc}: {path}" if path else str(exc)
    else:
        msg = str(exc)
    err_console.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=code)


def check_failed(failures: list[str], summary: str) -> NoReturn:
    """Print each failure as ``FAIL: ...`` and the summary on stderr, exit 1 (a check failed)."""
    for line in failures:
        typer.echo(f"FAIL: {line}", err=True)
    typer.echo(summary, err=True)
    raise typer.Exit(EXIT_CHECK_FAILED)


class GreedyCommand(TyperCommand):
    """Expands ``--opt v1 v2 v3`` into ``--opt v1 --opt v2 --opt v3`` for the options of
    this command that take several values (typer/click options take one per flag)."""

    greedy: tuple[str, ...] = ()

    def parse_args(self, ctx, args):
        out: list[str] = []
        i = 0
        while i < len(args):
            tok = args[i]
            out.append(tok)
            i += 1
            if tok in self.greedy:
                first = True
                while i < len(args) and (first or not args[i].startswith("-")):
                    if not first:
                        out.append(tok)
                    out.append(args[i])
                    i += 1
                    first = False
        return super().parse_args(ctx, out)


def greedy(*names: str) -> type[GreedyCommand]:
    """A command class whose options ``names`` take every value up to the next flag."""
    return type("GreedyCommand", (GreedyCommand,), {"greedy": names})


def key_values(items: list[str] | None, what: str) -> dict[str, str]:
    """``["B=en", "C=en+zh"]`` -> ``{"B": "en", "C": "en+zh"}``."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise typer.BadParameter(f"{what} expects KEY=VALUE, got {item!r}")
        out[key] = value
    return out
