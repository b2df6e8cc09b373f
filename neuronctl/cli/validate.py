"""`neuronctl validate`: prove an artifact will be reused as-is, or say why not."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer

from neuronctl.cli._common import (
    AllowUnsignedOpt,
    ArtifactArg,
    ArtifactsOpt,
    ConfigOpt,
    JsonOpt,
    RevisionOpt,
    StoreOpt,
    TrustKeyOpt,
    console,
    one_artifact,
    print_json,
    print_table,
    with_spec_options,
)
from neuronctl.cli._progress import progress_for
from neuronctl.errors import EXIT_FAILED, EXIT_OK
from neuronctl.validate import Report, requested_spec, validate_artifact

if TYPE_CHECKING:
    pass

ORDER = 30


@with_spec_options
def validate_command(
    spec_flags: dict[str, Any],
    ctx: typer.Context,
    artifact: ArtifactArg = None,
    artifacts: ArtifactsOpt = None,
    config: ConfigOpt = None,
    model: str | None = typer.Option(
        None,
        "--model",
        help="Also check that this checkpoint is the one the artifact was built from.",
        show_default=False,
    ),
    revision: RevisionOpt = None,
    deep: bool = typer.Option(
        False, "--deep", help="Re-hash every byte against the manifest's sha256 (slow)."
    ),
    store: StoreOpt = None,
    trust_key: TrustKeyOpt = None,
    allow_unsigned: AllowUnsignedOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Check that an artifact can be reused as-is: for this spec, on this host.

    Checks: the directory is an artifact; every file is present at its recorded size (with
    --deep, its sha256 too); backend/compiler/runtime versions and NEURON_CC_FLAGS match this
    host; the requested spec (flags or -c FILE, when given) equals the compiled one on every
    field that changes the compiled result; the host has the cores the tp degree needs; with
    --model, the checkpoint is the one it was built from; and the trust check generate and
    serve run before loading (a local build in a store you own, or a signature by a key
    trusted now: --trust-key, --allow-unsigned take the same values as theirs).

    Exit codes: 0 reusable, 1 not reusable (or not found), 2 usage error.

    Examples:

      neuronctl validate $NEURON_COMPILED_ARTIFACTS

      neuronctl validate ./neuron-compiled-artifacts/3f2a9c --seq-len 2048 --tp-degree 2

      neuronctl validate -c neuronctl.toml --model ./llama --deep --json
    """
    from neuronctl.store.resolve import resolve_artifact
    from neuronctl.store.signing import TrustPolicy

    policy = TrustPolicy.load(trust_key, allow_unsigned)
    path = resolve_artifact(one_artifact(ctx, artifact, artifacts), store, policy=policy)
    spec, sources = requested_spec(spec_flags, config)
    with progress_for(quiet=json_out or not deep, bytes_=True) as progress:
        report = validate_artifact(
            path,
            spec,
            model=model,
            revision=revision,
            deep=deep,
            progress=progress,
            sources=sources,
            policy=policy,
        )
    if json_out:
        print_json(report.as_dict())
    else:
        print_report(report)
    raise typer.Exit(EXIT_OK if report.reusable else EXIT_FAILED)


def print_report(report: Report) -> None:
    rows = [[_mark(c.ok, c.kind), c.name, c.reason] for c in report.checks]
    print_table(str(report.path), ["", "check", "reason"], rows)
    if report.reusable:
        console.print("[green]reusable[/green]: this artifact will be used as-is")
    else:
        n = len(report.failed)
        console.print(f"[red]not reusable[/red]: {n} check{'s' if n > 1 else ''} failed")


def _mark(ok: bool, kind: str) -> str:
    if not ok:
        return "[red]FAIL[/red]"
    return "[yellow]note[/yellow]" if kind in ("runtime-only", "note") else "[green]ok[/green]"


def register(app: typer.Typer) -> None:
    app.command("validate")(validate_command)
