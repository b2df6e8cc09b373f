"""What neuronctl changes for the whole process, each through one function named for it.

State set here is seen by every thread, and the environment by every child process too, so
nothing else sets it (tests/test_process.py fails on an `os.environ` write, a
`torch.set_num_threads` or an `atexit` registration anywhere else). Where the code that
reads a value is neuronctl's own, the value is passed as an argument instead (the CLI's
--debug); the environment carries only what other programs read: the Neuron SDK compilers
(NEURON_CC_FLAGS, NEURON_COMPILE_CACHE_URL) and child Pythons (PYTHONWARNINGS).

The process-wide state of the torch backend stays with the code it serves, each behind one
name: the ops registered with torch.library (backends/torch/kernel.py `register_ops`, and
`load` / `load_from`, one library per process), inductor's lowering table, patched for one
compile at a time (backends/torch/internals.py `onednn_weights_as_inputs`), and the weights
mapped before torch is imported (backends/torch/arena.py `map_early`, taken once by `take`).
"""

from __future__ import annotations

import atexit
import gc
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any


@contextmanager
def environment(changes: Mapping[str, str | None]) -> Iterator[None]:
    """Set each variable (None or "" unsets it) for the duration, for code that reads the
    environment and is not ours (an SDK compiler, a child process); restored afterwards."""
    saved = {name: os.environ.get(name) for name in changes}
    try:
        for name, value in changes.items():
            _set(name, value)
        yield
    finally:
        for name, value in saved.items():
            _set(name, value)


def _set(name: str, value: str | None) -> None:
    if value:
        os.environ[name] = value
    else:
        os.environ.pop(name, None)


def set_torch_threads(count: int) -> None:
    """torch's intra-op thread count for the calling thread (OpenMP keeps one per thread)."""
    import torch

    torch.set_num_threads(count)


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """The calling thread's intra-op thread count for the duration, then what it was."""
    import torch

    before = torch.get_num_threads()
    set_torch_threads(count)
    try:
        yield
    finally:
        set_torch_threads(before)


def at_exit(fn: Callable[..., Any], *args: Any) -> None:
    """Run fn(*args) when the interpreter exits (after those registered later)."""
    atexit.register(fn, *args)


def first_at_exit(fn: Callable[[], Any]) -> None:
    """Run fn() at exit before every handler registered until now (atexit runs the last
    registered first): registered again on each call."""
    atexit.unregister(fn)
    atexit.register(fn)


def freeze_startup_heap() -> None:
    """Leave everything allocated so far out of the garbage collector's full collections.

    A loaded server holds torch's, transformers' and the model's objects for good, and a full
    collection walks them all with every thread stopped (the GIL held): 49-188 ms each while
    a tiny model's server started. Frozen, a full collection walks only what came after.
    vLLM's server does the same at start-up
    (vllm/entrypoints/openai/api_server.py: `gc.collect(); gc.freeze()`, "Mark the startup
    heap as static so that it's ignored by GC")."""
    gc.collect()
    gc.freeze()
