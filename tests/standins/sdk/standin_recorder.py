"""Shared call log and failure switch for the SDK stand-ins (tests only)."""

from typing import Any

CALLS: list[tuple[str, Any]] = []
FAIL: set[str] = set()  # names of calls that raise RuntimeError, e.g. {"compile"}


def reset() -> None:
    CALLS.clear()
    FAIL.clear()


def record(name: str, payload: Any = None) -> None:
    CALLS.append((name, payload))
    if name in FAIL:
        raise RuntimeError(f"stand-in SDK failure in {name}")


def names() -> list[str]:
    return [name for name, _ in CALLS]
