"""What a named EC2 instance type and Neuron SDK release can load: the Neuron devices and
cores an instance has, and the checks that refuse an artifact its pods would have to compile
again (validate's version check and the SDK rules doctor knows, judged for that host instead
of this one)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass

from neuronctl.checks import Check
from neuronctl.errors import UsageError
from neuronctl.spec import BuildSpec
from neuronctl.store.manifest import Manifest
from neuronctl.validate import versions_check
from neuronctl.vllm_generations import version_tuple

NXDI_DIST = "neuronx-distributed-inference"
TNX_LAST_SDK = (2, 25)  # Transformers NeuronX ended with SDK 2.25 (doctor.known_bad_neuron)
INF2_LAST_NXDI_SDK = (2, 28)  # NxD Inference runs on Trn2+ only from SDK 2.29


@dataclass(frozen=True)
class Family:
    """An instance family: its NeuronCore generation and the physical cores per device."""

    name: str
    core_version: int
    physical_cores: int
    default_lnc: int = 1  # cores the runtime groups into one logical core by default


INF2 = Family("inf2", 2, 2)
TRN1 = Family("trn1", 2, 2)
TRN2 = Family("trn2", 3, 8, default_lnc=2)
# Neuron devices per instance size (the Neuron architecture pages' instance tables).
INSTANCES: dict[str, tuple[Family, int]] = {
    "inf2.xlarge": (INF2, 1),
    "inf2.8xlarge": (INF2, 1),
    "inf2.24xlarge": (INF2, 6),
    "inf2.48xlarge": (INF2, 12),
    "trn1.2xlarge": (TRN1, 1),
    "trn1.32xlarge": (TRN1, 16),
    "trn1n.32xlarge": (TRN1, 16),
    "trn2.3xlarge": (TRN2, 1),
    "trn2.48xlarge": (TRN2, 16),
    "trn2u.48xlarge": (TRN2, 16),
}
# neuronx-cc --target values -> the NeuronCore generation their code runs on.
COMPILE_TARGETS = {"inf2": 2, "trn1": 2, "trn1n": 2, "trn2": 3}


@dataclass(frozen=True)
class Instance:
    name: str
    family: Family
    devices: int
    lnc: int

    @property
    def cores_per_device(self) -> int:
        """The (logical) NeuronCores one device gives a process: what tp ranks run on."""
        return self.family.physical_cores // self.lnc

    @property
    def cores(self) -> int:
        return self.devices * self.cores_per_device


def instance(name: str, spec: BuildSpec) -> Instance:
    """The named instance type, with the logical core size the artifact was compiled for."""
    try:
        family, devices = INSTANCES[name]
    except KeyError:
        raise UsageError(
            f"--instance-type: unknown Neuron instance type {name!r}",
            "known: " + ", ".join(INSTANCES),
        ) from None
    return Instance(name, family, devices, logical_cores(spec, family))


def logical_cores(spec: BuildSpec, family: Family) -> int:
    """Physical cores per logical core: the compile's -lnc / logical_nc_config, else the
    family's runtime default (the two must agree, so the compile decides)."""
    override = spec.override_neuron_config.get("logical_nc_config")
    if override is None:
        override = spec.override_neuron_config.get("logical_neuron_cores")
    flag = cc_flag(spec.cc_flags, ("--logical-nc-config", "-lnc"))
    value = flag if flag is not None else override
    return int(value) if value else family.default_lnc


def cc_flag(flags: str, names: tuple[str, ...]) -> str | None:
    """The value of the first of `names` in NEURON_CC_FLAGS (`--x=v` or `--x v`)."""
    try:
        words = shlex.split(flags or "")
    except ValueError:
        words = (flags or "").split()
    for i, word in enumerate(words):
        name, eq, value = word.partition("=")
        if name in names:
            if eq:
                return value
            return words[i + 1] if i + 1 < len(words) else None
    return None


def parse_sdk_release(text: str) -> tuple[int, int]:
    parts = version_tuple(text)
    if len(parts) < 2 or parts[0] != 2:
        raise UsageError(f"--neuron-sdk: {text!r} is not a Neuron SDK release", "e.g. 2.24")
    return parts[0], parts[1]


def nxdi_sdk_release(nxdi_version: str) -> tuple[int, int] | None:
    """The SDK release an NxD Inference version ships with (0.N is SDK 2.(20+N)), as
    doctor.sdk_release reads it from the installed package."""
    parts = version_tuple(nxdi_version)
    if len(parts) < 2 or parts[0] != 0 or parts[1] < 4:
        return None
    return 2, 20 + parts[1]


def load_checks(
    manifest: Manifest,
    where: Instance | None,
    sdk: tuple[int, int] | None,
    versions: Mapping[str, str],
) -> list[Check]:
    """Whether pods on `where` with SDK `sdk` (and exactly `versions`, when given) load the
    artifact as compiled. Every failed check is a reason the pod would compile again."""
    spec = manifest.spec
    checks = []
    if manifest.backend == "torch":
        checks.append(Check("backend", True, "torch: runs on the CPU, no Neuron devices"))
    elif where is not None:
        checks.extend([capacity_check(spec, where), target_check(spec, where)])
    if sdk is not None and manifest.backend != "torch":
        checks.extend(sdk_checks(manifest, sdk, where))
    if versions:
        checks.append(pinned_versions_check(manifest, versions))
    return checks


def pinned_versions_check(manifest: Manifest, versions: Mapping[str, str]) -> Check:
    """The packages the user pinned for the image against what compiled the artifact
    (validate's version rule; packages the artifact does not record say nothing)."""
    recorded = {k: v for k, v in manifest.backend_versions.items() if k in versions}
    if not recorded:
        return Check("versions", False, "none of the --sdk-version packages is one the "
                     f"artifact records ({', '.join(sorted(manifest.backend_versions))})")
    return versions_check(recorded, {k: versions[k] for k in recorded}, where="the image")


def capacity_check(spec: BuildSpec, where: Instance) -> Check:
    tp = spec.tp_degree
    if tp > where.cores:
        return Check(
            "capacity",
            False,
            f"tp degree {tp} needs {tp} NeuronCores, {where.name} has {where.cores}: "
            "name a larger instance type or recompile with a smaller --tp-degree",
        )
    return Check("capacity", True, f"tp degree {tp} <= {where.cores} NeuronCores of {where.name}")


def target_check(spec: BuildSpec, where: Instance) -> Check:
    target = cc_flag(spec.cc_flags, ("--target",))
    if target is None:
        return Check("target", True, "no --target in NEURON_CC_FLAGS: compiled for its host")
    version = COMPILE_TARGETS.get(target)
    if version != where.family.core_version:
        return Check(
            "target",
            False,
            f"compiled with --target {target}, which {where.name} (NeuronCore-v"
            f"{where.family.core_version}) cannot run: recompile with --target "
            f"{where.family.name}",
        )
    return Check("target", True, f"--target {target} runs on {where.name}")


def sdk_checks(manifest: Manifest, sdk: tuple[int, int], where: Instance | None) -> list[Check]:
    shown = f"SDK {sdk[0]}.{sdk[1]}"
    if manifest.backend == "tnx":
        if sdk > TNX_LAST_SDK:
            return [Check("sdk", False, f"{shown} has no Transformers NeuronX (it ended with "
                          "SDK 2.25): serve from an SDK 2.25 image or rebuild with --backend nxdi")]
        return [Check("sdk", True, f"{shown} still ships Transformers NeuronX")]
    checks = []
    built = nxdi_sdk_release(manifest.backend_versions.get(NXDI_DIST, ""))
    if built is None:
        checks.append(Check("sdk", False, f"the artifact records no NxD Inference version "
                            f"{shown} could be matched against; name --sdk-version instead"))
    elif built != sdk:
        checks.append(Check("sdk", False, f"compiled with SDK {built[0]}.{built[1]} (NxD "
                            f"Inference {manifest.backend_versions[NXDI_DIST]}), the pods run "
                            f"{shown}: its compiler would build again; use an SDK "
                            f"{built[0]}.{built[1]} image or recompile with {shown}"))
    else:
        checks.append(Check("sdk", True, f"compiled with {shown}"))
    if where is not None and where.family is INF2 and sdk > INF2_LAST_NXDI_SDK:
        checks.append(Check("sdk.instance", False, f"{shown} on {where.name}: NxD Inference "
                            "runs on Trn2 and newer only from SDK 2.29; stay on SDK 2.28 on Inf2"))
    return checks


def parse_versions(pins: list[str]) -> dict[str, str]:
    """`--sdk-version PKG==VERSION` options -> {PKG: VERSION}."""
    out = {}
    for pin in pins:
        name, sep, version = pin.partition("==")
        if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name.strip()) or not version.strip():
            raise UsageError(
                f"--sdk-version: {pin!r} is not PKG==VERSION", "e.g. neuronx-cc==2.19.8089.0"
            )
        out[name.strip()] = version.strip()
    return out
