"""`neuronctl doctor`: what is installed, what is missing, known-bad combinations."""

from __future__ import annotations

import typer
from rich.markup import escape

from neuronctl.cli._common import JsonOpt, StoreOpt, console, print_json, print_table
from neuronctl.doctor import DoctorReport, diagnose
from neuronctl.errors import EXIT_FAILED, EXIT_OK, UsageError
from neuronctl.spec import BACKENDS

ORDER = 90


def doctor_command(
    backend: str = typer.Option(
        "torch", "--backend", help="The backend whose requirements decide the exit code."
    ),
    store: StoreOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Show Python and package versions, the Neuron SDK, vLLM, devices, the C++ toolchain and
    store disk space.

    Exit codes: 0 everything the backend needs is there, 1 something required is missing,
    2 usage error. Warnings (optional packages, known-bad combinations, no C++ toolchain,
    low disk) do not fail.

    Examples:

      neuronctl doctor

      neuronctl doctor --backend nxdi --json
    """
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}", "use one of: " + ", ".join(BACKENDS))
    report = diagnose(backend, store)
    if json_out:
        print_json(report.as_dict())
    else:
        print_checks(report)
    raise typer.Exit(EXIT_OK if report.healthy else EXIT_FAILED)


def print_checks(report: DoctorReport) -> None:
    """One row per check under its section's heading, its fix below its state: a section
    and a fix column left the state too narrow for a path or URL at 80 columns."""
    rows: list[list[str]] = []
    section = None
    for check in report.checks:
        if check.kind != section:
            section = check.kind
            rows.append(["", f"[bold]{escape(section)}[/bold]", ""])
        state = escape(check.reason)
        if check.fix:
            state += f"\n[dim]fix:[/dim] {escape(check.fix)}"
        rows.append([_mark(check.ok, check.required), escape(check.name), state])
    print_table(None, ["", "name", "state"], rows)
    if report.healthy:
        console.print(f"[green]ready[/green] for the {report.backend} backend")
    else:
        names = ", ".join(f.name for f in report.missing)
        console.print(f"[red]missing[/red] for the {report.backend} backend: {names}")


def _mark(ok: bool, required: bool) -> str:
    if ok:
        return "[green]ok[/green]"
    return "[red]MISSING[/red]" if required else "[yellow]warn[/yellow]"


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor_command)
