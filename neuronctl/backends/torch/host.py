"""This host's CPU as the torch backend sees it, and the checks an artifact must pass here.

Its flags, the vector ISA inductor generates code for, its half-precision units, whether
neuronctl's kernel runs on it; then `host_checks`, what validate's version comparison cannot
judge (the ISA, the half-precision units, the cores). Read without importing torch wherever
it can be: validate answers from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Mapping
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from neuronctl.backends.torch import internals
from neuronctl.checks import Check
from neuronctl.store.local import user_cache_store

if TYPE_CHECKING:
    from neuronctl.store.manifest import Manifest

# Inductor's x86 ISAs, best first (inductor's cpu_vec_isa.supported_vec_isa_list): it
# generates code for the first whose capabilities the CPU has.
X86_ISAS = ("avx512 avx512_vnni amx_tile", "avx512 avx512_vnni", "avx512", "avx2")


def x86_capabilities(flags: str) -> set[str]:
    """The capabilities inductor reads on x86 (`x86_isa_checker`), from the CPU flags.

    As aten's at::cpu checks them (aten/src/ATen/cpu/Utils.cpp): avx512 needs the F, VL, BW
    and DQ subsets; avx512_vnni needs avx512 too; amx_tile is its own flag.
    """
    have = set(flags.split())
    caps = set()
    if "avx2" in have:
        caps.add("avx2")
    if {"avx512f", "avx512vl", "avx512bw", "avx512dq"} <= have:
        caps.add("avx512")
        if "avx512_vnni" in have:
            caps.add("avx512_vnni")
    if "amx_tile" in have:
        caps.add("amx_tile")
    return caps


def is_x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


@cache
def cpu_isa() -> str:
    """The vector ISA inductor generates code for on this host (e.g. 'avx512 avx512_vnni').

    On x86 from the CPU flags, as inductor ranks them, without its compile probes: a key
    computed where no C++ compiler is installed (a CI runner's `plan`) is the key a builder on
    the same CPU computes. Elsewhere inductor's own pick (no compiler involved on arm64),
    cached per (torch, machine, CPU flags) in the user cache because it imports torch and
    `validate` must answer well under a second.
    """
    if is_x86():
        caps = x86_capabilities(cpu_flags())
        return next((isa for isa in X86_ISAS if set(isa.split()) <= caps), "none")
    key = _host_fingerprint()
    cache_file = user_cache_store() / "cpu_isa.json"
    try:
        cached = json.loads(cache_file.read_text())
        if cached.get("key") == key:
            return str(cached["isa"])
    except (OSError, ValueError, KeyError):
        pass
    isa = _detect_isa()
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "isa": isa}))
        os.replace(tmp, cache_file)
    except OSError:
        pass  # a read-only cache only costs the probe next time
    return isa


def _detect_isa() -> str:
    try:
        return internals.inductor_isa() or "none"
    except Exception:  # pragma: no cover - hosts inductor has no ISA for
        return "none"


@cache
def cpu_flags() -> str:
    try:
        line = next(
            (
                line
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith(("flags", "Features"))
            ),
            "",
        )
        return line.partition(":")[2].strip()
    except OSError:
        return platform.processor()


def _host_fingerprint() -> str:
    text = f"{torch_version()}|{platform.machine()}|{cpu_flags()}"
    return hashlib.sha256(text.encode()).hexdigest()


def half_units() -> str:
    """The half-precision dtypes this CPU computes natively: "bf16", "bf16 fp16" or "none".

    From the CPU flags (no torch import: versions() runs on every validate). x86 needs
    avx512_bf16 or AMX for bf16 and avx512_fp16 or AMX-FP16 for fp16; arm64 its BF16 and
    FP16 arithmetic features. Elsewhere the narrow dtypes are emulated, and a bf16 artifact
    computes in float32 (config.Numerics).
    """
    flags = set(cpu_flags().split())
    units = []
    if flags & {"avx512_bf16", "amx_bf16", "bf16"}:
        units.append("bf16")
    if flags & {"avx512_fp16", "amx_fp16", "asimdhp"}:
        units.append("fp16")
    return " ".join(units) or "none"


def compute_dtype(dtype: str, quantized: bool, units: str) -> str:
    """The dtype an artifact computes in: its own where the CPU has units for it, else fp32.

    int8 weights always compute in float32 (they are widened inside the kernel).
    """
    unit = {"bfloat16": "bf16", "float16": "fp16"}.get(dtype)
    if quantized or unit is None or unit not in units.split():
        return "float32"
    return dtype


def torch_version() -> str:
    # Package metadata, not `import torch`: versions() runs on every validate.
    return metadata.version("torch")


def kernel_runs_on(flags: str) -> bool:
    """neuronctl's ops' instructions exist on this CPU (x86-64 with AVX2 and FMA)."""
    return is_x86() and {"avx2", "fma"} <= set(flags.split())


def cpu_runs(isa: str) -> bool:
    """An x86 ISA inductor compiled for ("avx2", "avx512 avx512_vnni", ...) runs on this CPU.

    From the CPU's own capabilities, as inductor checks them before its compile probes: a
    host that serves compiled code needs the instructions, not a compiler (without one,
    `supported_isas()` answers "none").
    """
    if isa == "none":
        return True
    here = x86_capabilities(cpu_flags()) if is_x86() else set()
    return bool(here) and set(isa.split()) <= here


def supported_isas() -> set[str]:
    try:
        return internals.inductor_isas() | {"none"}
    except Exception:  # pragma: no cover
        return {"none"}


def host_checks(manifest: Manifest, here: Mapping[str, str]) -> list[Check]:
    """What validate's generic version comparison cannot judge: the ISA and the units.

    (torch and modeling versions are compared by validate from `versions()`.)
    """
    checks = []
    if manifest.spec.compiler == "inductor":
        checks.append(isa_check(manifest, here))
    checks.append(half_units_check(manifest, here))
    return checks


def artifact_computes(manifest: Manifest) -> list[str]:
    """The dtypes an artifact's graphs compute in: its op choice's, per row count."""
    assert manifest.ops is not None  # half_units_check refuses a manifest without one
    return sorted(manifest.ops.computes, key=lambda dtype: dtype != "float32")


def half_units_check(manifest: Manifest, here: Mapping[str, str]) -> Check:
    """A graph built to compute in bf16 (fp16) needs a CPU with those units."""
    if manifest.ops is None:
        return Check("half-precision units", False,
                     "the manifest records no op choice (what each graph computes in); "
                     "recompile the artifact with this neuronctl")
    built_with = manifest.backend_versions.get("cpu_half_units", "none")
    computes = artifact_computes(manifest)
    units = here.get("cpu_half_units", "none")
    narrow = [dtype for dtype in computes if compute_dtype(dtype, False, units) != dtype]
    compute = " and ".join(computes)
    if not narrow:
        return Check("half-precision units", True,
                     f"computes in {compute}; this host has {_units_phrase(units)}")
    compute = " and ".join(narrow)
    return Check(
        "half-precision units",
        False,
        f"compiled to compute in {compute} on a CPU with {_units_phrase(built_with)}, this "
        f"host has {_units_phrase(units)}; recompile here (it will compute in float32)",
    )


def _units_phrase(units: str) -> str:
    """"bf16 units", "no half-precision units" (the versions record says "none")."""
    return "no half-precision units" if units == "none" else f"{units} units"


def isa_check(manifest: Manifest, here: Mapping[str, str]) -> Check:
    isa = manifest.backend_versions.get("cpu_isa", "none")
    if isa == here.get("cpu_isa"):  # the common case, answered from the cached probe
        return Check("cpu isa", True, f"{isa}, as compiled")
    if cpu_runs(isa):
        return Check("cpu isa", True, f"compiled for {isa}, which this CPU runs")
    supported = supported_isas()
    if isa in supported:
        return Check("cpu isa", True, f"compiled for {isa}, which this host supports")
    return Check(
        "cpu isa",
        False,
        f"compiled for {isa} ({manifest.host.get('machine', '?')}), this host "
        f"({platform.machine()}) supports {sorted(supported)}; recompile here or use "
        "--compiler export",
    )
