"""What the two Neuron SDK backends (nxdi, tnx) share: versions, env for the compiler, errors."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from importlib import metadata

from neuronctl.doctor import NEURON_REPO
from neuronctl.errors import BackendUnavailableError, BuildError, NeuronctlError


def install_hint(packages: Sequence[str]) -> str:
    return f"pip install --extra-index-url {NEURON_REPO} " + " ".join(packages)


def sdk_versions(
    packages: Sequence[str], unavailable: Callable[[str], BackendUnavailableError]
) -> dict[str, str]:
    """Installed versions of `packages`; the first missing one raises `unavailable(name)`."""
    out = {}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            raise unavailable(name) from None
    return out


@contextmanager
def env_var(name: str, value: str | None) -> Iterator[None]:
    """Set (or, with None/empty, unset) one variable for the duration, then restore it."""
    old = os.environ.get(name)
    if value:
        os.environ[name] = value
    else:
        os.environ.pop(name, None)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def cc_flags_env(flags: str) -> AbstractContextManager[None]:
    """NEURON_CC_FLAGS is part of the key: compile with exactly the recorded flags."""
    return env_var("NEURON_CC_FLAGS", flags)


@contextmanager
def sdk_failure(framework: str) -> Iterator[None]:
    """The SDK's own failure becomes a BuildError: nothing gets published."""
    try:
        yield
    except NeuronctlError:
        raise
    except Exception as exc:
        raise BuildError(
            f"{framework} compile failed: {type(exc).__name__}: {exc}",
            "run again with --debug for the SDK's traceback",
        ) from exc
