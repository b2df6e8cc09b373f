"""Where long work reports progress: a protocol every layer may take, and a silent default.

Neutral on purpose: the store (push/pull/verify), sharding and the backends report through it,
and only the CLI draws bars (cli/_progress.py), so none of them imports another to do so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class Progress(Protocol):
    """`task` starts one line of work and returns a callback taking an advance."""

    def task(self, description: str, total: float | None = None) -> Callable[[float], None]: ...


class NullProgress:
    def task(self, description: str, total: float | None = None) -> Callable[[float], None]:
        return lambda _advance: None
