"""A process that ends with its engine still started exits as Python says, never by abort.

The CLI always stops its engine; a library user, a test, or an exception escaping between
`start` and `stop` may not. Each test runs a real artifact's engine in a fresh interpreter and
lets that interpreter end while the engine thread is inside a step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Start an engine over the artifact argv[1], run one request, then end (argv[2] "end") or
# raise (argv[2] "raise") while a second request's step is inside torch ops. The step spends
# a second in matmuls, which run with the GIL released, before the artifact's real decode:
# the interpreter finalizes while the engine thread is in C++ (without it, exit lands there
# in some runs only).
PROGRAM = """
import sys, threading, time
from pathlib import Path
import torch
from neuronctl.engine.loader import make_engine, open_artifact
from neuronctl.engine.sampling import SamplingParams

loaded = open_artifact(Path(sys.argv[1]))
decode, in_step = loaded.runner.decode, threading.Event()

def held_decode(tokens, positions):
    in_step.set()
    square = torch.ones(256, 256)
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        square @ square
    return decode(tokens, positions)

engine = make_engine(loaded).start()
print(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids, flush=True)
loaded.runner.decode = held_decode
engine.submit([1, 2, 3], SamplingParams(max_tokens=8))
in_step.wait()
if sys.argv[2] == "raise":
    raise RuntimeError("escaped between start and stop")
"""


@pytest.mark.parametrize(("ending", "code"), [("end", 0), ("raise", 1)])
def test_a_process_ending_with_its_engine_started_exits_without_abort(
    compiled_artifact: Path, ending: str, code: int
) -> None:
    """Before `stop_started`, both ended in "terminate called without an active exception"
    and SIGABRT (-6 here, 134 from a shell) in every run.

    The engine thread is a daemon, not joined at exit. When a torch op it runs returns after
    finalization began, CPython ends the thread with pthread_exit (python/cpython,
    Python/ceval_gil.h, `take_gil`: `if (_PyThreadState_MustExit(tstate))` ->
    `PyThread_exit_thread()`; line 289 in 3.11.7, the frame under the abort), and that
    forced unwind stops with std::terminate at the torch binding that asked for the GIL
    (`THPVariable_matmul` here; `THPVariable_clear` in an unprovoked abort of an AOTInductor
    artifact's engine, exiting mid-generation)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(compiled_artifact), ending],
                          env=env, capture_output=True, text=True, timeout=300)
    assert "terminate called" not in done.stderr
    assert done.returncode == code, done.stderr
    assert done.stdout.startswith("["), done.stderr  # the first request's tokens: it ran
    if ending == "raise":
        assert done.stderr.rstrip().endswith("RuntimeError: escaped between start and stop")
