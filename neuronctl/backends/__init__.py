"""Backend registry. Backends import lazily: the Neuron SDK is only on Neuron hosts."""

from __future__ import annotations

import importlib

from neuronctl.backends.base import Backend
from neuronctl.errors import UsageError

# name -> "module:attribute" of a zero-argument factory returning a Backend.
BACKENDS = {
    "torch": "neuronctl.backends.torch:TorchBackend",
    "nxdi": "neuronctl.backends.nxdi:NxdiBackend",
    "tnx": "neuronctl.backends.tnx:TnxBackend",
}


def get_backend(name: str) -> Backend:
    target = BACKENDS.get(name)
    if target is None:
        raise UsageError(f"unknown backend {name!r}", "use one of: " + ", ".join(BACKENDS))
    module_name, attr = target.split(":")
    factory = getattr(importlib.import_module(module_name), attr)
    backend: Backend = factory()
    return backend
