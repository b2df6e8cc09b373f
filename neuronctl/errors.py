"""Errors a person can act on.

Every error neuronctl raises on purpose is a NeuronctlError: the CLI prints its message (and
hint) as one line and exits with its code, never with a traceback (unless --debug).
"""

from __future__ import annotations

# Exit codes, documented in README.md and docs/cli.md.
EXIT_OK = 0
EXIT_FAILED = 1  # a check failed, something was not found, a build failed
EXIT_USAGE = 2  # the user asked for something invalid


class NeuronctlError(Exception):
    exit_code = EXIT_FAILED

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class UsageError(NeuronctlError):
    """Invalid input: a flag, a spec field, a config file."""

    exit_code = EXIT_USAGE


class SpecError(UsageError):
    """A build spec field is invalid; names the field."""

    def __init__(self, field: str, message: str, hint: str | None = None) -> None:
        super().__init__(f"{field}: {message}", hint)
        self.field = field


class NotFoundError(NeuronctlError):
    """An artifact, a model or a file does not exist."""


class CheckpointError(NeuronctlError):
    """A checkpoint is unreadable, incomplete or unsupported."""


class BuildError(NeuronctlError):
    """A compile failed; nothing was published."""


class BackendUnavailableError(NeuronctlError):
    """The backend's SDK is not installed on this host."""
