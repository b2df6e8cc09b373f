"""Imports point one way: the layers of docs/architecture.md, as pyproject.toml's import-linter
contracts state them, hold for the code as it is (`make lint` runs the same check)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("importlinter", reason="make install (the dev extra) brings import-linter")
    from importlinter.cli import lint_imports

    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT))
    assert lint_imports(config_filename="pyproject.toml", no_cache=True, no_logo=True) == 0


def test_every_package_is_in_a_layer() -> None:
    """A new top-level module must be placed in the layers, or the contract says nothing of it."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in config["contracts"] if c["type"] == "layers")["layers"]
    named = {name.strip() for layer in layers for name in layer.split("|")}
    package = ROOT / "neuronctl"
    present = {
        f"neuronctl.{p.stem}"
        for p in package.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()
    }
    assert present - named == set()
