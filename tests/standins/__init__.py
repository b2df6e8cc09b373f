"""Clearly named stand-ins for the Neuron SDK, for contract tests only.

`sdk/` holds fake `neuronx_distributed_inference` and `transformers_neuronx` packages (plus
dist-info metadata, so importlib.metadata reports versions ending in "+standin"). They record
every call in `CALLS` and write files shaped like the real ones; they are put on sys.path only
by the `neuron_standins` fixture, never installed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SDK_DIR = Path(__file__).parent / "sdk"
PACKAGES = ("neuronx_distributed_inference", "transformers_neuronx")


def _drop_modules() -> None:
    for name in list(sys.modules):
        if name.split(".")[0] in PACKAGES:
            del sys.modules[name]


@pytest.fixture
def neuron_standins(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The stand-in SDK on sys.path; yields its shared call recorder module."""
    _drop_modules()
    monkeypatch.syspath_prepend(str(SDK_DIR))
    import standin_recorder

    standin_recorder.reset()
    yield standin_recorder
    _drop_modules()
    sys.modules.pop("standin_recorder", None)
