"""`doctor`: what is installed, what is missing, which combinations are known to break.

Every result is a `Check` (neuronctl.checks): name, ok, reason, fix, and its section as `kind`.
A check is `required` when the selected backend cannot work without it; the report is healthy
when every required check is ok.
Package lookups go through `importlib.metadata` and `importlib.util.find_spec` (no imports of
the packages themselves: importing vLLM or the Neuron SDK can take seconds and print noise).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from neuronctl import toolchain
from neuronctl.checks import Check
from neuronctl.vllm_generations import platform_plugins, version_tuple

NEURON_REPO = "https://pip.repos.neuron.amazonaws.com"
NEURON_INSTALL = f"pip install --extra-index-url {NEURON_REPO} {{package}}"
LOW_DISK_BYTES = 20 * 2**30  # a compiled 8B model with sharded weights is ~16 GB
CORES_PER_DEVICE = 2  # NeuronCore-v2 devices (Inf2, Trn1); used only when neuron-ls is absent


def available_cpus() -> int:
    """CPUs this process may run on (its affinity, e.g. a container's cpuset), which compile
    and validate both hold a torch artifact's tp degree against."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# dist name -> (import name, backends that need it)
CORE_PACKAGES = {
    "torch": ("torch", ("torch", "nxdi", "tnx")),
    "transformers": ("transformers", ("torch", "nxdi", "tnx")),
    "huggingface_hub": ("huggingface_hub", ("torch", "nxdi", "tnx")),
    "safetensors": ("safetensors", ("torch", "nxdi", "tnx")),
}
NEURON_PACKAGES = {
    "neuronx-cc": ("neuronxcc", ("nxdi", "tnx")),
    "torch-neuronx": ("torch_neuronx", ("nxdi", "tnx")),
    "neuronx-distributed-inference": ("neuronx_distributed_inference", ("nxdi",)),
    "transformers-neuronx": ("transformers_neuronx", ("tnx",)),
}



@dataclass
class DoctorReport:
    backend: str
    checks: list[Check]  # `kind` is the section a check is shown in

    @property
    def healthy(self) -> bool:
        return all(c.ok for c in self.checks if c.required)

    @property
    def missing(self) -> list[Check]:
        return [c for c in self.checks if c.required and not c.ok]

    def as_dict(self) -> dict[str, Any]:
        return {
            "healthy": self.healthy,
            "backend": self.backend,
            "checks": [
                {
                    "name": c.name,
                    "ok": c.ok,
                    "detail": c.reason,
                    "fix": c.fix,
                    "required": c.required,
                    "section": c.kind,
                }
                for c in self.checks
            ],
        }


def diagnose(backend: str = "torch", store: Path | None = None) -> DoctorReport:
    checks = [python_check()]
    checks += [package_check(name, backend) for name in CORE_PACKAGES]
    checks += [package_check(name, backend) for name in NEURON_PACKAGES]
    checks += vllm_checks()
    checks.append(devices_check(backend))
    checks.append(toolchain_check(backend))
    checks.append(disk_check(store))
    return DoctorReport(backend, checks)


# --- packages -------------------------------------------------------------------------------


def dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def module_found(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def python_check() -> Check:
    version = platform.python_version()
    ok = sys.version_info >= (3, 11)
    fix = "" if ok else "use Python 3.11 or newer"
    return Check(
        "python", ok, f"{version} ({sys.executable})", fix=fix, required=True, kind="packages"
    )


def package_check(name: str, backend: str) -> Check:
    module, needed_by = {**CORE_PACKAGES, **NEURON_PACKAGES}[name]
    required = backend in needed_by
    neuron = name in NEURON_PACKAGES
    install = NEURON_INSTALL.format(package=name) if neuron else f"pip install {name}"
    version = dist_version(name)
    section = "neuron" if neuron else "packages"
    if version is None:
        detail = "not installed"
        if neuron:
            detail += " (the Neuron SDK is not on PyPI; install it from the Neuron repository)"
        return Check(name, False, detail, fix=install, required=required, kind=section)
    if not module_found(module):
        # PyPI only has placeholder packages for the Neuron SDK: installed, nothing to import.
        detail = f"{version} installed but module {module!r} is missing (a PyPI placeholder?)"
        fix = f"pip uninstall -y {name} && {install}"
        return Check(name, False, detail, fix=fix, required=required, kind=section)
    return Check(name, True, version, required=required, kind=section)


# --- vLLM -----------------------------------------------------------------------------------


def vllm_dir() -> Path | None:
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def vllm_checks() -> list[Check]:
    version = dist_version("vllm")
    if version is None:
        fix = (
            "only needed for `serve --engine vllm`: vllm-neuron 0.4.1 (Inf2, SDK 2.28) or 0.5.0, "
            "or a Neuron build from source (VLLM_TARGET_DEVICE=neuron pip install -e .)"
        )
        return [Check("vllm", True, "not installed (optional)", fix=fix, kind="vllm")]
    plugin = dist_version("vllm-neuron")
    neuron_build = "neuron" in version.split("+", 1)[-1] if "+" in version else False
    if neuron_build or plugin:
        how = f"vllm-neuron plugin {plugin}" if plugin else "Neuron build"
        checks = [Check("vllm", True, f"{version} ({how})", kind="vllm")]
    else:
        fix = (
            "the PyPI wheel does not support Neuron: install from source with "
            "VLLM_TARGET_DEVICE=neuron (see the Neuron vLLM user guide)"
        )
        checks = [Check("vllm", False, f"{version} (not a Neuron build)", fix=fix, kind="vllm")]
    checks.append(generation_check(version, plugin))
    checks += known_bad(version)
    checks += known_bad_neuron(version, plugin)
    return checks


def generation_check(version: str, plugin: str | None) -> Check:
    """Which of the four vLLM Neuron generations this is (docs/neuron.md)."""
    from neuronctl.vllm_generations import D_HINT, Generation, generation_for

    vllm, plug = version_tuple(version), version_tuple(plugin) if plugin else None
    gen = generation_for(vllm, plug)
    name = "vllm generation"
    if gen is None:
        fix = "install vllm-neuron (the plugin) or a vLLM <= 0.10.1 Neuron build"
        detail = f"vLLM {version} without vllm-neuron has no Neuron support"
        return Check(name, False, detail, fix=fix, kind="vllm")
    detail = f"{gen.letter} ({gen.value}): neuronctl launches it with --vllm-target {gen.value}"
    if gen is Generation.NATIVE:
        detail = f"D (native vllm-neuron {plugin}): it does not load NxDI artifacts"
        return Check(name, False, detail, fix=D_HINT, kind="vllm")
    return Check(name, True, detail, kind="vllm")


def sdk_release() -> tuple[int, int] | None:
    """The Neuron SDK release, from NxD Inference's version (0.N ships with SDK 2.(20+N):
    its release tags v0.4.7422 = 2.24 ... v0.7.14366 = 2.27, 0.9.0 = 2.29)."""
    nxdi = dist_version("neuronx-distributed-inference")
    parts = version_tuple(nxdi) if nxdi else ()
    if len(parts) < 2 or parts[0] != 0 or parts[1] < 4:
        return None
    return (2, 20 + parts[1])


def instance_type() -> str:
    """The EC2 instance type (Nitro exposes it as the DMI product name), or ''."""
    try:
        return Path("/sys/devices/virtual/dmi/id/product_name").read_text().strip()
    except OSError:
        return ""


def known_bad_neuron(vllm_version: str, plugin: str | None) -> list[Check]:
    """Combinations of vLLM generation, SDK release and host that the sources say break."""
    found = []
    sdk = sdk_release()
    sdk_text = f"SDK 2.{sdk[1]}" if sdk else ""
    if sdk and sdk >= (2, 26) and dist_version("transformers-neuronx"):
        found.append(
            _bad(
                "transformers-neuronx",
                f"installed with {sdk_text}: Transformers NeuronX ended in SDK 2.26 and its "
                "artifacts do not load there",
                "use --backend nxdi, or an SDK 2.25 environment for tnx artifacts",
            )
        )
    if sdk and sdk >= (2, 29) and instance_type().startswith("inf2"):
        found.append(
            _bad(
                "neuronx-distributed-inference",
                f"{sdk_text} on {instance_type()}: NxD Inference runs on Trn2+ only from SDK 2.29",
                "on Inf2 stay on SDK 2.28 with vllm-neuron 0.4.1 / vLLM 0.13",
            )
        )
    vllm = version_tuple(vllm_version)
    framework = os.environ.get("VLLM_NEURON_FRAMEWORK")
    if plugin is None and (0, 8) <= vllm < (0, 10, 2) and framework == "transformers-neuronx":
        found.append(
            _bad(
                "VLLM_NEURON_FRAMEWORK",
                f"transformers-neuronx with vLLM {vllm_version}: its platforms/neuron.py returns "
                "self.TRANSFORMERS_NEURONX, which does not exist (AttributeError at start)",
                "unset it: vLLM then picks TNx when NxD Inference is not installed",
            )
        )
    plugins = platform_plugins()
    if len(plugins) > 1 and not os.environ.get("VLLM_PLUGINS"):
        found.append(
            _bad(
                "vllm.platform_plugins",
                f"{len(plugins)} platform plugins installed ({', '.join(plugins)}): vLLM refuses "
                'to start when more than one activates (platforms/__init__.py: "Only one platform '
                'plugin can be activated")',
                "export VLLM_PLUGINS=neuron (neuronctl's vLLM launch sets it) or uninstall one",
            )
        )
    return found


def _bad(name: str, detail: str, fix: str) -> Check:
    return Check(name, False, detail, fix=fix, kind="known issues")


def known_bad(vllm_version: str) -> list[Check]:
    """Combinations the Neuron documentation warns about."""
    found = []
    triton = dist_version("triton")
    bad_triton = triton is not None and version_tuple(triton)[:3] == (2, 1, 0)
    if bad_triton and version_tuple(vllm_version) >= (0, 5, 3):
        found.append(
            Check(
                "triton",
                False,
                f'triton {triton} with vllm {vllm_version}: fails with "cannot import name '
                "'default_dump_dir'\" (the Neuron torch pins triton 2.1.0, vllm >= 0.5.3 needs "
                "newer)",
                fix="pip install --upgrade triton==3.0.0 (after installing vLLM)",
                kind="known issues",
            )
        )
    root = vllm_dir()
    old_layout = version_tuple(vllm_version)[:2] < (0, 4)
    if root is not None and old_layout and not (root / "model_executor/models/neuron").is_dir():
        found.append(
            Check(
                "vllm.model_executor.models.neuron",
                False,
                f"missing from {root}: vLLM raises ModuleNotFoundError on Neuron (pip skipped "
                "the directory because it had no __init__.py)",
                fix="in the vLLM checkout: touch vllm/model_executor/models/neuron/__init__.py, "
                "then pip install . again",
                kind="known issues",
            )
        )
    return found


# --- devices and disk -----------------------------------------------------------------------


def neuron_device_paths() -> list[str]:
    return sorted(p for p in glob.glob("/dev/neuron*") if re.fullmatch(r"/dev/neuron\d+", p))


def neuron_ls() -> list[dict[str, Any]] | None:
    """`neuron-ls --json-output`, or None when the tool is absent or fails."""
    exe = shutil.which("neuron-ls")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--json-output"], capture_output=True, text=True, timeout=20, check=True
        ).stdout
        data = json.loads(out)
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError):
        return None
    return data if isinstance(data, list) else None


def neuron_cores() -> tuple[int, str]:
    """NeuronCores on this host and how that was found out."""
    devices = neuron_ls()
    if devices is not None:
        cores = sum(int(d.get("nc_count") or 0) for d in devices if isinstance(d, dict))
        return cores, f"neuron-ls: {len(devices)} devices"
    paths = neuron_device_paths()
    if paths:
        return len(paths) * CORES_PER_DEVICE, f"{len(paths)} /dev/neuron* devices, no neuron-ls"
    return 0, "no /dev/neuron* devices"


def devices_check(backend: str) -> Check:
    cores, how = neuron_cores()
    if cores:
        return Check("neuron devices", True, f"{cores} NeuronCores ({how})", kind="host")
    note = "compile works, running needs an Inf2/Trn1/Trn2 instance" if backend != "torch" else ""
    fix = "install the Neuron driver (aws-neuronx-dkms) on a Neuron instance" if note else ""
    detail = how + (f"; {note}" if note else "; not needed by the torch backend")
    return Check("neuron devices", backend == "torch", detail, fix=fix, kind="host")


def toolchain_check(backend: str) -> Check:
    """What `--compiler inductor` needs on this host: a C++ compiler, and ninja to build
    neuronctl's CPU kernels (backends/torch/kernel.py). Not required: export graphs and
    the Neuron backends need neither."""
    cxx = next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    ninja = toolchain.ninja_path()
    missing = [what for what, found in (("C++ compiler", cxx), ("ninja", ninja)) if not found]
    if not missing:
        return Check(
            "c++ toolchain",
            True,
            f"{cxx} and ninja: inductor graphs and neuronctl's kernels can be built here",
            kind="host",
        )
    needed = "needed by --compiler inductor" if backend == "torch" else "torch backend only"
    return Check(
        "c++ toolchain",
        False,
        f"no {' or '.join(missing)} on PATH ({needed})",
        fix="install g++ and `pip install ninja`, or compile with --compiler export",
        kind="host",
    )


def disk_check(store: Path | None) -> Check:
    from neuronctl.store.local import default_store_root

    root = Path(store) if store is not None else default_store_root()
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent  # the store may not exist yet: its filesystem is what counts
    free = shutil.disk_usage(probe).free
    ok = free >= LOW_DISK_BYTES
    fix = "" if ok else "free space or point --store / NEURONCTL_STORE at a bigger disk"
    free_text = f"{free / 2**30:.1f} GiB free at {root}"
    return Check("store disk", ok, free_text, fix=fix, kind="host")
