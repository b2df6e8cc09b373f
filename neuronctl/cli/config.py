"""`neuronctl config show`: the resolved build spec and where each value came from."""

from __future__ import annotations

from typing import Any

import typer

from neuronctl.cli._common import (
    ConfigOpt,
    JsonOpt,
    print_json,
    print_table,
    with_spec_options,
)
from neuronctl.cli._groups import config_app
from neuronctl.spec import resolve_spec, spec_to_dict

ORDER = 60


@config_app.command("show")
@with_spec_options
def show(
    spec_flags: dict[str, Any],
    config: ConfigOpt = None,
    explain: bool = typer.Option(False, "--explain", help="Show where each value came from."),
    json_out: JsonOpt = False,
) -> None:
    """Print the build spec that flags, -c FILE, environment and defaults resolve to.

    Example: neuronctl config show -c neuronctl.toml --tp-degree 2 --explain
    """
    spec, sources = resolve_spec(spec_flags, config)
    values = spec_to_dict(spec)
    if json_out:
        print_json({"spec": values, "sources": sources} if explain else values)
        return
    columns = ["field", "value"] + (["source"] if explain else [])
    rows = [[k, _fmt(v)] + ([sources[k]] if explain else []) for k, v in values.items()]
    print_table("Build spec", columns, rows)


def _fmt(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return "-" if value is None or value == {} else str(value)


def register(app: typer.Typer) -> None:
    app.add_typer(config_app, name="config")
