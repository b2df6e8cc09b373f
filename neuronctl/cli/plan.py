"""`neuronctl plan`: the CI matrix of a builds file, compiling only what the remote lacks."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from neuronctl.cli._common import JsonOpt, StoreOpt, print_table
from neuronctl.errors import UsageError
from neuronctl.plan import FORMATS, make_plan, render_github, render_gitlab, render_json

ORDER = 27

# The build plan is an argument here and `compile --plan` there: -c is a spec file everywhere.
PlanFileArg = Annotated[
    Path,
    typer.Argument(
        metavar="PLAN",
        help="Build plan: \\[defaults] and \\[\\[build]] tables (see docs/ci.md).",
        show_default=False,
    ),
]
FormatOpt = Annotated[
    str,
    typer.Option(
        "--format",
        "-f",
        help="table | github (lines for $GITHUB_OUTPUT) | gitlab (child pipeline YAML); "
        "--json for JSON.",
    ),
]
RemoteOpt = Annotated[
    str | None,
    typer.Option(
        "--remote",
        envvar="NEURONCTL_REMOTE",
        help="Remote store to look keys up in, e.g. s3://bucket/neuron (default: "
        "$NEURONCTL_REMOTE; without one every build is listed as to compile).",
        show_default=False,
    ),
]


def plan_command(
    config: PlanFileArg,
    output_format: FormatOpt = "table",
    remote: RemoteOpt = None,
    store: StoreOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Print one entry per artifact of a builds file: its key and whether the remote has it.

    Nothing is compiled: keys come from the checkpoints and specs, as `neuronctl hash` does.

    Examples:

      neuronctl plan builds.toml --remote s3://my-bucket/neuron

      neuronctl plan builds.toml --remote s3://bucket/neuron -f github >> "$GITHUB_OUTPUT"

      neuronctl plan builds.toml --format gitlab > compile-pipeline.yml

    To build them on a Ray cluster instead: neuronctl compile --plan builds.toml --ray auto.

    Exit codes: 0 ok, 1 a model or the remote could not be read, 2 invalid builds file.
    """
    if output_format not in FORMATS:
        raise UsageError(
            f"--format: unknown format {output_format!r}",
            "use " + " | ".join(FORMATS) + ", or --json",
        )
    fmt = "json" if json_out else output_format
    remote_store = None
    if remote:
        from neuronctl.store.remote.client import open_remote

        remote_store = open_remote(remote)
    plan = make_plan(config, remote_store, store)
    if fmt == "json":
        print(render_json(plan))
    elif fmt == "github":
        print(render_github(plan))
    elif fmt == "gitlab":
        print(render_gitlab(plan, str(config)), end="")
    else:
        rows = [[b.entry.index, b.entry.name, b.dirname, _state(b.remote)] for b in plan.builds]
        print_table(None, ["entry", "name", "key", "remote"], rows)


def _state(remote: bool | None) -> str:
    return {True: "present", False: "missing", None: "unknown"}[remote]


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_command)
