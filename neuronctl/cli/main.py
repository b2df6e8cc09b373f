"""The `neuronctl` entry point: discovers command modules and turns errors into exit codes."""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
from typing import Annotated

import typer
from rich.markup import escape

import neuronctl.cli as cli_pkg
from neuronctl import __version__, log
from neuronctl.cli._common import err_console, print_json
from neuronctl.errors import EXIT_FAILED, NeuronctlError, UsageError

HELP = """Ahead-of-time compiled LLMs as reproducible, content-addressed build products.

Typical flow:

  neuronctl download meta-llama/Llama-3.2-1B --revision main

  neuronctl compile meta-llama/Llama-3.2-1B --tp-degree 2 --seq-len 2048 --batch-size 4

  neuronctl validate $NEURON_COMPILED_ARTIFACTS

  neuronctl serve --artifacts $NEURON_COMPILED_ARTIFACTS

  neuronctl -v compile ./model   (say what it does: key, cache hit or miss and why)

Exit codes: 0 ok, 1 check failed / not found / build failed, 2 usage error.
"""

app = typer.Typer(
    name="neuronctl",
    help=HELP,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        print(f"neuronctl {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
    debug: Annotated[
        bool, typer.Option("--debug", help="Show tracebacks for errors.", envvar="NEURONCTL_DEBUG")
    ] = False,
    log_level: Annotated[
        str | None,
        typer.Option(
            "--log-level",
            envvar="NEURONCTL_LOG_LEVEL",
            help="debug | info | warning | error (default warning: quiet).",
            show_default=False,
        ),
    ] = None,
    verbose: Annotated[
        int,
        typer.Option(
            "--verbose", "-v", count=True, help="Say what the tool does (-v info, -vv debug)."
        ),
    ] = 0,
) -> None:
    # Options before the command apply to every command.
    if debug:
        os.environ["NEURONCTL_DEBUG"] = "1"
    try:
        level = log.level_for(log_level, verbose)
    except ValueError as exc:
        raise UsageError(f"--log-level: {exc}") from None
    log.setup(level)


def _register_commands() -> None:
    modules = []
    for info in pkgutil.iter_modules(cli_pkg.__path__):
        if info.name.startswith("_") or info.name == "main":
            continue
        modules.append(importlib.import_module(f"neuronctl.cli.{info.name}"))
    # ORDER puts the everyday commands first in --help.
    for module in sorted(modules, key=lambda m: (getattr(m, "ORDER", 50), m.__name__)):
        module.register(app)


_register_commands()


def main() -> None:
    try:
        app()
    except NeuronctlError as exc:
        if os.environ.get("NEURONCTL_DEBUG"):
            raise
        _report(exc)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err_console.print("[red]interrupted[/red]")
        sys.exit(130)
    except Exception as exc:  # a bug, not a user mistake: say so, briefly
        if os.environ.get("NEURONCTL_DEBUG"):
            raise
        err_console.print(
            f"[red]internal error:[/red] {type(exc).__name__}: {escape(str(exc))}\n"
            "Run again with --debug for the traceback, and please report it."
        )
        sys.exit(EXIT_FAILED)


def _report(exc: NeuronctlError) -> None:
    if "--json" in sys.argv:
        print_json({"error": exc.message, "hint": exc.hint, "exit_code": exc.exit_code})
    # Messages and hints are plain text: `[[build]]` or `[0, 1]` must print as written.
    err_console.print(f"[red]error:[/red] {escape(exc.message)}", soft_wrap=True)
    if exc.hint:
        err_console.print(f"[dim]hint:[/dim] {escape(exc.hint)}", soft_wrap=True)


if __name__ == "__main__":
    main()
