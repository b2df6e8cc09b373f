"""The docs stay true: every command is in docs/cli.md, and CI runs the README's test command."""

from __future__ import annotations

from pathlib import Path

import click
import typer.main

from neuronctl.cli.main import app

ROOT = Path(__file__).resolve().parents[1]


def command_paths(group: click.Group, prefix: str = "neuronctl") -> list[str]:
    paths = []
    for name, command in group.commands.items():
        path = f"{prefix} {name}"
        paths.append(path)
        if isinstance(command, click.Group):
            paths.extend(command_paths(command, path))
    return paths


def test_every_command_is_in_the_cli_reference() -> None:
    reference = (ROOT / "docs" / "cli.md").read_text()
    missing = [p for p in command_paths(typer.main.get_group(app)) if f"`{p}`" not in reference]
    assert missing == [], f"run `make docs`: {missing}"


def test_ci_runs_the_readme_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    for command in ("make install", "make test"):
        assert command in readme and command in ci


def test_cli_reference_has_no_html_entities() -> None:
    reference = (ROOT / "docs" / "cli.md").read_text()
    assert "&#x27;" not in reference and "&quot;" not in reference
