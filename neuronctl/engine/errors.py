"""Why the engine refused a request. The server maps them to HTTP codes, the CLI to exit codes."""

from __future__ import annotations

from neuronctl.errors import NeuronctlError, UsageError


class RequestError(UsageError):
    """The request itself is invalid (HTTP 400, exit 2)."""

    def __init__(
        self, message: str, param: str | None = None, hint: str | None = None, code: str = ""
    ) -> None:
        super().__init__(message, hint)
        self.param = param
        self.code = code or "invalid_request"


class QueueFullError(NeuronctlError):
    """Every slot is busy and the waiting queue is at its limit (HTTP 429)."""


class EngineStoppedError(NeuronctlError):
    """The engine is shutting down or has stopped (HTTP 503)."""


class EngineDeadError(EngineStoppedError):
    """The engine thread failed: what it held was failed, nothing new is taken (HTTP 503, as
    vLLM's /health answers once its engine is dead)."""
