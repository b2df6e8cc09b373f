"""Check: one named verdict with its reason, the result type of every check neuronctl runs.

validate's artifact checks, a backend's host checks and doctor's checks are all Checks; each
report picks the fields it shows and names them in its own --json schema (docs/validate.md)."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    reason: str = ""  # what was found, or why it failed (doctor's JSON calls it "detail")
    _: KW_ONLY
    fix: str = ""  # what to do about a failure, when the reason does not already say
    # What sort of check, which decides how it is shown: validate's check | host |
    # runtime-only | note; doctor's section (packages | neuron | vllm | known issues | host).
    kind: str = "check"
    required: bool = False  # doctor: a failed required check makes the host not ready
