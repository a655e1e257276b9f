"""What every ``reap`` command shares: exit codes, consoles, error reporting, output
directories checked before work starts, SIGTERM taken as Ctrl-C, options that take several
values after one flag, retired option spellings, and stdout kept for results.

Exit codes: ``0`` ok; ``1`` a check failed (``reap verify`` found a problem, or a
rewrite failed after its inputs were accepted); ``2`` usage or bad input (a message
on stderr says what to change; nothing was written); ``130`` interrupted (Ctrl-C or
SIGTERM; nothing was written).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
from os import PathLike
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
    "HELP_OPTIONS",
    "OUTPUT_ALIASES",
    "VLLM_ARG_OPTION",
    "VLLM_PYTHON_OPTION",
    "GreedyCommand",
    "check_failed",
    "check_output_dir",
    "command_class",
    "console",
    "err_console",
    "fail",
    "greedy",
    "interruptible",
    "key_values",
    "third_party_logs_to_stderr",
]

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it

console = Console()
if not console.is_terminal:  # pipes, CI logs, CliRunner: do not squeeze tables to 80 columns
    console.width = max(console.width, 160)
err_console = Console(stderr=True)

#: ``-h`` is ``--help`` for every command (the app's context settings, inherited)
HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}

#: options of every command that runs vLLM (``reap verify --vllm``, ``reap eval``)
VLLM_PYTHON_OPTION = typer.Option(
    None,
    "--vllm-python",
    help="Python of an environment with vLLM (default: $REAP_VLLM_PYTHON, ./.venv-vllm/bin/python)",
)
VLLM_ARG_OPTION = typer.Option(
    None,
    "--vllm-arg",
    help="extra vLLM server argument, e.g. --vllm-arg=--tensor-parallel-size=8 (repeatable)",
)

#: retired spellings of the output flag, still accepted (hidden from help): every command
#: writes to ``-o`` / ``--out``
OUTPUT_ALIASES = {"--output": "--out"}


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


def check_output_dir(path: str | PathLike | None, flag: str) -> None:
    """Exit 2 with one line when ``flag``'s directory ``path`` could not be created or
    written (a file there or above it, a parent not writable); before any work starts."""
    from ..fileio import output_dir_problem

    problem = None if path is None else output_dir_problem(path)
    if problem:
        fail(f"{flag} {path}: {problem}; give {flag} a directory you can write")


class GreedyCommand(TyperCommand):
    """Expands ``--opt v1 v2 v3`` into ``--opt v1 --opt v2 --opt v3`` for the options of
    this command that take several values (typer/click options take one per flag), and
    maps retired spellings (``aliases``, e.g. ``--output``) to the current flag."""

    greedy: tuple[str, ...] = ()
    aliases: dict[str, str] = {}

    def parse_args(self, ctx, args):
        args = _renamed(args, self.aliases)
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


def _renamed(args: list[str], aliases: dict[str, str]) -> list[str]:
    out = []
    for i, tok in enumerate(args):
        if tok == "--":
            return out + args[i:]
        name, eq, value = tok.partition("=")
        out.append(aliases[name] + eq + value if name in aliases else tok)
    return out


def command_class(
    *, greedy: tuple[str, ...] = (), aliases: dict[str, str] | None = None
) -> type[GreedyCommand]:
    """A command class whose options ``greedy`` take every value up to the next flag and
    whose ``aliases`` (old spelling -> flag) are accepted."""
    return type("GreedyCommand", (GreedyCommand,), {"greedy": greedy, "aliases": aliases or {}})


def greedy(*names: str) -> type[GreedyCommand]:
    """A command class whose options ``names`` take every value up to the next flag."""
    return command_class(greedy=names)


class _StdoutToStderrDuringImport(importlib.abc.MetaPathFinder):
    """Runs the import of one package with ``sys.stdout`` pointing at stderr."""

    def __init__(self, package: str):
        self.package = package

    def find_spec(self, fullname, path, target=None):
        if fullname != self.package:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        original_exec = spec.loader.exec_module

        def exec_module(module):
            with contextlib.redirect_stdout(sys.__stderr__ or sys.stderr):
                original_exec(module)

        spec.loader.exec_module = exec_module
        return spec


def third_party_logs_to_stderr() -> None:
    """Keep stdout for the command's results (``reap eval``'s table can be redirected as
    markdown): llm-compressor's log sink is made to write to stderr.

    Why: importing ``llmcompressor`` runs ``configure_logger()``, which removes loguru's
    stderr sink and adds one on ``sys.stdout`` (``llmcompressor/logger.py``); its first
    warning ("No accelerator available! ...", from a device probe during the same import)
    and every later loguru line then land on stdout. The sink keeps the stream it was given,
    so the import runs with ``sys.stdout`` pointing at stderr. Delete when llm-compressor
    logs to stderr. (No effect when it is already imported.)"""
    if "llmcompressor" in sys.modules:
        return
    if not any(isinstance(f, _StdoutToStderrDuringImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _StdoutToStderrDuringImport("llmcompressor"))


def key_values(items: list[str] | None, what: str) -> dict[str, str]:
    """``["B=en", "C=en+zh"]`` -> ``{"B": "en", "C": "en+zh"}``."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise typer.BadParameter(f"{what} expects KEY=VALUE, got {item!r}")
        out[key] = value
    return out


@contextlib.contextmanager
def interruptible():
    """SIGTERM (a scheduler's kill, ``timeout``) takes the same path as Ctrl-C: the
    rewriter removes its temporary directory and the command says so.  (SIGKILL
    cannot be caught: its leftovers are removed by the next run into the same output.)"""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
