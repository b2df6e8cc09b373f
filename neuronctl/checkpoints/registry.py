"""Which backends build a checkpoint's architecture, read from the one table of model families
(neuronctl/families.py): what `inspect` lists and `check_supported` enforces."""

from __future__ import annotations

from neuronctl.errors import CheckpointError
from neuronctl.families import BY_ARCHITECTURE, FAMILIES, architectures
from neuronctl.spec import BACKENDS

# Per backend, the architectures it builds, derived from the families table: scripts outside
# the package (the real-source check among them) read it by this name.
ARCHITECTURES: dict[str, dict[str, str]] = {name: architectures(name) for name in BACKENDS}


def supported_backends(architecture: str) -> list[str]:
    """The backends that can build `architecture`, in the order of spec.BACKENDS."""
    family = BY_ARCHITECTURE.get(architecture)
    return [name for name in BACKENDS if family is not None and name in family.builds]


def describe_support() -> str:
    """One line per backend listing its architectures, for error messages."""
    return "; ".join(
        f"{name}: {', '.join(f.architecture for f in FAMILIES if name in f.builds)}"
        for name in BACKENDS
    )


def check_supported(architecture: str, backend: str) -> None:
    """Raise CheckpointError naming what each backend supports if `backend` can't build it."""
    others = supported_backends(architecture)
    if backend in others:
        return
    hint = f"use --backend {others[0]}" if others else "supported: " + describe_support()
    raise CheckpointError(
        f"the {backend} backend does not support {architecture}"
        + (f" (supported by: {', '.join(others)})" if others else ""),
        hint,
    )
