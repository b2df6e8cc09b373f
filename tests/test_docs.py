"""The docs stay true: every command is in docs/cli.md, CI runs the README's test command, the
backends' architectures are the registry's, and nothing cites what only this project's authors
had (issue numbers, local notes, machine paths)."""

from __future__ import annotations

import re
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


def docs_families_table() -> dict[str, list[str]]:
    """docs/checkpoints.md's table of model families: backend -> the architectures its row
    names, in order."""
    text = (ROOT / "docs" / "checkpoints.md").read_text()
    section = text.split("## Model families", 1)[1].split("\n## ", 1)[0]
    arch = re.compile(r"\b[A-Z]\w*(?:ForCausalLM|ForConditionalGeneration|LMHeadModel)\b")
    rows = re.findall(r"^\| (\w+) \|(.*)\|$", section, re.M)
    return {backend: arch.findall(cells) for backend, cells in rows if backend != "backend"}


def test_docs_list_what_each_backend_builds() -> None:
    """docs/checkpoints.md's table names exactly what neuronctl/families.py says each backend
    builds, and has a row for every backend."""
    from neuronctl.families import architectures
    from neuronctl.spec import BACKENDS

    table = docs_families_table()
    assert list(table) == list(BACKENDS)
    for backend in BACKENDS:
        assert set(table[backend]) == set(architectures(backend)), backend


# What only someone who was there can follow: a tracker's issue number, the project's local
# source notes, a path on one machine.
OUTSIDE = re.compile(r"\b[Ii]ssues? #?\d+|\bseeds? ?\d{3}|NEURON[_]FACTS|/work[/]")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".cpp", ".h", ".txt", ".sh", ".yml", ".yaml", ".json"}


def test_code_and_docs_cite_nothing_outside_the_repository() -> None:
    files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "Makefile"]
    for folder in ("neuronctl", "tests", "docs", "bench"):
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in TEXT_SUFFIXES]
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in files
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert found == []

