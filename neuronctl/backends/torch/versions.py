"""What a torch artifact's graphs depend on besides the spec: the graph key's versions.

Read without importing torch or probing a compiler (host.py): validate and `plan` answer
from them.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

from neuronctl.backends.torch import host

# Bump when the model (model.py, config.py, layout.py, linear.py, attention.py), the graph
# signatures or the stored form of the weights (weights.py) change what a graph computes or
# takes.
MODELING_VERSION = "7"
# neuronctl's own CPU ops, one library (kernel.py): the matmul and decode attention, and
# the header they share (in the digest, not compiled on its own).
KERNEL_SOURCES = tuple(Path(__file__).with_name(n) for n in ("simd.h", "gemv.cpp", "attention.cpp"))


@cache
def kernel_digest() -> str:
    """The source digest of neuronctl's CPU ops (kernel.py): a graph calling them depends on
    them, so it is part of the graph key (read without importing torch)."""
    h = hashlib.sha256()
    for source in KERNEL_SOURCES:
        h.update(source.name.encode() + b"\0" + source.read_bytes())
    return h.hexdigest()[:16]


def graph_versions(compiler: str, dtype: str, quantized: bool) -> dict[str, str]:
    """The versions an artifact's graphs depend on, and nothing else (part of the graph key).

    - torch and the modeling version, always;
    - `cpu_half_units` where the dtype is a half one the CPU may or may not compute in (they
      decide whether the graphs compute in it or in float32);
    - `cpu_isa` only for AOTInductor, which generates code for it (an exported program runs
      the same on every CPU);
    - `kernel`, the digest of neuronctl's ops, wherever the op choice may pick them
      (`kernel_may_run`): the choice is measured at build time and must not change the key.

    Read without importing torch or probing a compiler: validate and `plan` answer from it.
    """
    versions = {"torch": host.torch_version(), "modeling": MODELING_VERSION}
    if dtype in ("bfloat16", "float16") and not quantized:
        versions["cpu_half_units"] = host.half_units()
    if compiler == "inductor":
        versions["cpu_isa"] = host.cpu_isa()
        if kernel_may_run(compiler):
            versions["kernel"] = kernel_digest()
    return versions


def all_versions() -> dict[str, str]:
    """Everything a torch artifact's graphs can depend on, whatever its spec."""
    return {"torch": host.torch_version(), "modeling": MODELING_VERSION,
            "kernel": kernel_digest(), "cpu_isa": host.cpu_isa(),
            "cpu_half_units": host.half_units()}


def kernel_may_run(compiler: str) -> bool:
    """Whether graphs compiled here may call neuronctl's ops (opchoice decides, from the
    model's shapes and timings too): AOTInductor on a CPU the kernel runs on, whatever the
    compute dtype (the kernel computes in float32 and rounds its result to it)."""
    return compiler == "inductor" and host.kernel_runs_on(host.cpu_flags())
