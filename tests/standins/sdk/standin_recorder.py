"""Shared call log and failure switch for the SDK stand-ins (tests only)."""

from typing import Any

CALLS: list[tuple[str, Any]] = []
FAIL: set[str] = set()  # names of calls that raise RuntimeError, e.g. {"compile"}
# A tests.fake_runner.KvCache the stand-in models write their KV cache rows into, when set:
# a write into a slot's history fails the test there and then.
KV: Any = None


def reset() -> None:
    global KV
    CALLS.clear()
    FAIL.clear()
    KV = None


def kv_rows(slots: list[int], positions: list[list[int]], tokens: list[list[int]]) -> None:
    """What a static-batch device does with a forward's rows: a multi-position row is a
    prefill (a new sequence in its slot); a one-position row writes that one cell."""
    if KV is None:
        return
    for slot, pos, ids in zip(slots, positions, tokens, strict=True):
        if len(pos) > 1:
            KV.prefill(slot, ids)
        else:
            KV.write(slot, pos[0])


def record(name: str, payload: Any = None) -> None:
    CALLS.append((name, payload))
    if name in FAIL:
        raise RuntimeError(f"stand-in SDK failure in {name}")


def names() -> list[str]:
    return [name for name, _ in CALLS]
