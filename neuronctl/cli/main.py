"""The `neuronctl` entry point: discovers command modules and turns errors into exit codes."""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import inspect
import logging
import os
import pkgutil
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from typer.core import TyperGroup

import neuronctl.cli as cli_pkg
from neuronctl import __version__, log, process
from neuronctl.cli._common import err_console, print_json, unwrap_when_piped
from neuronctl.cli._typer_internals import ClickException, NoArgsIsHelpError, fold_help
from neuronctl.errors import EXIT_FAILED, EXIT_USAGE, NeuronctlError, UsageError

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it
# The options before the command that take a value (the rest are flags): what app_for skips
# to find the command's name.
ROOT_VALUE_OPTIONS = frozenset({"--log-level"})

HELP = """Ahead-of-time compiled LLMs as reproducible, content-addressed build products.

Typical flow:

  neuronctl download meta-llama/Llama-3.2-1B --revision main

  neuronctl compile meta-llama/Llama-3.2-1B --tp-degree 2 --seq-len 2048 --batch-size 4

  neuronctl validate $NEURON_COMPILED_ARTIFACTS

  neuronctl serve $NEURON_COMPILED_ARTIFACTS

  neuronctl -v compile ./model   (say what it does: key, cache hit or miss and why)

Exit codes: 0 ok, 1 check failed / not found / build failed, 2 usage error, 130 interrupted
(Ctrl-C).
"""


class Interrupted(Exception):  # noqa: N818 - a signal, not an error
    """Ctrl-C, carried past typer, which would turn it into a silent exit 130."""


class OneLineErrors(TyperGroup):
    """typer's click prints a usage error as a 5-6 line box; neuronctl promises one line and a
    hint. Parsing errors become neuronctl's own, which `main` prints like every other error."""

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().make_context(*args, **kwargs)
        except ClickException as exc:
            raise _as_neuronctl_error(exc) from None

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except ClickException as exc:
            raise _as_neuronctl_error(exc) from None
        except KeyboardInterrupt:
            raise Interrupted from None


def _as_neuronctl_error(exc: ClickException) -> Exception:
    if isinstance(exc, NoArgsIsHelpError):  # `neuronctl config` alone: typer prints the help
        return exc
    ctx = getattr(exc, "ctx", None)
    hint = f"see '{ctx.command_path} --help'" if ctx is not None else None
    error = UsageError if exc.exit_code == EXIT_USAGE else NeuronctlError
    return error(exc.format_message(), hint)


class _HelpTable(Table):
    """typer's options table, whose columns it never declares: every column but the help
    text keeps its names whole (rich shrank them all to fit 80 columns, cutting
    `--override-neuron-config` to `--override-neuron-conf…`); the help text wraps between
    words and folds a word longer than its column (a variable name, a path) instead of
    cutting it."""

    def add_row(self, *renderables: Any, **kw: Any) -> None:
        super().add_row(*renderables, **kw)
        for column in self.columns[:-1]:
            column.no_wrap = True
        if self.columns:
            self.columns[-1].overflow = "fold"


def _help_folding_long_words(parameter_help: Any) -> Any:
    """An option's help text with words longer than the column folded, not cut."""

    def folded(**kw: Any) -> Any:
        columns = parameter_help(**kw)
        for item in columns.renderables:
            if isinstance(item, Text):
                item.overflow = "fold"
        return columns

    return folded


fold_help(_HelpTable, _help_folding_long_words)


def _new_app() -> typer.Typer:
    app = typer.Typer(
        name="neuronctl",
        cls=OneLineErrors,
        help=HELP,
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    app.callback()(root)
    return app


def _version(value: bool) -> None:
    if value:
        print(f"neuronctl {__version__}")
        raise typer.Exit()


class _Tracebacks:
    """Whether an error shows its traceback: --debug (the root callback sets it), or
    NEURONCTL_DEBUG for an error raised before the callback ran (a usage error)."""

    shown = False

    def wanted(self) -> bool:
        return self.shown or bool(os.environ.get("NEURONCTL_DEBUG"))


_tracebacks = _Tracebacks()


def root(
    ctx: typer.Context,
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
    _tracebacks.shown = debug
    try:
        level = log.level_for(log_level, verbose)
    except ValueError as exc:
        raise UsageError(f"--log-level: {exc}") from None
    log.setup(level)
    if level >= logging.WARNING:
        ctx.with_resource(_quiet_warnings())


@contextlib.contextmanager
def _quiet_warnings() -> Iterator[None]:
    """Third-party warnings (torch's FutureWarning on every inductor graph) are not the user's
    to act on: hidden unless -v, here and in every child (graph workers, vLLM), which inherit
    PYTHONWARNINGS. A user's own -W or PYTHONWARNINGS wins."""
    if sys.warnoptions or "PYTHONWARNINGS" in os.environ:
        yield
        return
    with warnings.catch_warnings(), process.environment({"PYTHONWARNINGS": "ignore"}):
        warnings.simplefilter("ignore")
        yield


@functools.cache
def full_app() -> typer.Typer:
    """The app with every command: each cli/<name>.py module's register(app)."""
    app = _new_app()
    modules = [importlib.import_module(f"neuronctl.cli.{name}") for name in _command_modules()]
    # ORDER puts the everyday commands first in --help.
    for module in sorted(modules, key=lambda m: (getattr(m, "ORDER", 50), m.__name__)):
        module.register(app)
    _reflow_help(app)
    return app


def reflow(text: str) -> str:
    """Join each paragraph's lines; keep indented ones (examples) as written.

    Docstrings are wrapped for the source at 100 columns and typer keeps those line breaks
    after a help's first paragraph, so at 80 columns every such line broke twice."""
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(
        p if any(line[:1].isspace() or line.startswith("\b") for line in p.splitlines())
        else " ".join(p.split())
        for p in paragraphs
    )


def _reflow_help(typer_app: typer.Typer) -> None:
    if isinstance(typer_app.info.help, str):
        typer_app.info.help = reflow(typer_app.info.help)
    for command in typer_app.registered_commands:
        text = command.help or inspect.getdoc(command.callback)
        if text:
            command.help = reflow(text)
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _reflow_help(group.typer_instance)



def _command_modules() -> list[str]:
    return [
        info.name
        for info in pkgutil.iter_modules(cli_pkg.__path__)
        if not info.name.startswith("_") and info.name != "main"
    ]


def app_for(args: Sequence[str]) -> typer.Typer:
    """The app to run `args` with: where the command they name is all that its own module
    registers (generate, serve, ...), an app with that module alone, so a command pays for
    importing no other command's dependencies (stores, remotes, signing, the build); else
    (the groups, whose subcommands come from several modules, --help, a typo) full_app()."""
    name = _command_name(args)
    if name is None or name not in _command_modules():
        return full_app()
    app = _new_app()
    importlib.import_module(f"neuronctl.cli.{name}").register(app)
    if [info.name for info in app.registered_commands] != [name] or app.registered_groups:
        return full_app()
    _reflow_help(app)
    return app


def _command_name(args: Sequence[str]) -> str | None:
    """The first argument that is neither a root option nor a root option's value."""
    takes_value = False
    for arg in args:
        if takes_value:
            takes_value = False
        elif arg == "--":
            return None
        elif arg.startswith("-"):
            takes_value = arg in ROOT_VALUE_OPTIONS
        else:
            return arg
    return None


def __getattr__(name: str) -> typer.Typer:
    """`app`, the full app, is built on first use (tests, docs); `main` builds only what the
    command line needs."""
    if name == "app":
        return full_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    # At exit Python scans every object still alive for garbage cycles: some 200k after
    # torch is imported, 0.1-0.4 s of a one-token `generate`, for memory the OS takes back
    # anyway. Frozen (gc's permanent generation), they are skipped; Python never promised
    # finalizers to objects alive at exit, and atexit handlers run as before.
    process.at_exit(gc.freeze)
    unwrap_when_piped()
    try:
        # prog_name: not "python -m neuronctl.cli.main" in usage and hints
        app_for(sys.argv[1:])(prog_name="neuronctl")
    except NeuronctlError as exc:
        if _tracebacks.wanted():
            raise
        _report(exc)
        sys.exit(exc.exit_code)
    except (KeyboardInterrupt, Interrupted):
        err_console.print("[red]interrupted[/red]")
        sys.exit(EXIT_INTERRUPTED)
    except Exception as exc:  # a bug, not a user mistake: say so, briefly
        if _tracebacks.wanted():
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
