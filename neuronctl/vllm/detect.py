"""Which vLLM a launch is written for: the installed one, detected from package metadata (vLLM's
version, the `vllm.platform_plugins` entry points, the vllm-neuron distribution), or the one
`--vllm-target NAME[@VERSION]` names."""

from __future__ import annotations

from dataclasses import dataclass, replace
from importlib import metadata

from neuronctl.errors import NeuronctlError, UsageError
from neuronctl.vllm.artifact import NXDI, TNX
from neuronctl.vllm_generations import (
    D_HINT,
    Generation,
    generation_for,
    platform_plugins,
    version_tuple,
)

PLUGIN_DIST = "vllm-neuron"
# The version assumed when a generation is named without one and none is installed.
DEFAULT_VLLM = {
    Generation.TNX_FORK: (0, 6, 2),
    Generation.V0: (0, 9, 2),
    Generation.PLUGIN: (0, 13, 0),
}
DEFAULT_PLUGIN = (0, 4, 1)  # Inf2's last plugin (SDK 2.28, vLLM 0.13)


def dotted(version: tuple[int, ...] | None) -> str:
    return ".".join(str(v) for v in version) if version else "?"


@dataclass(frozen=True)
class VllmTarget:
    """The vLLM a launch is written for."""

    generation: Generation
    vllm: tuple[int, ...]
    plugin: tuple[int, ...] | None = None  # vllm-neuron version (C, D)
    platform_plugins: tuple[str, ...] = ()  # installed vllm.platform_plugins entry points
    frameworks: frozenset[str] | None = None  # NxDI / TNx installed here; None: not known
    detected: bool = False

    @property
    def plugin_release(self) -> tuple[int, ...]:
        """The vllm-neuron version, or the default one where it is not known."""
        return self.plugin or DEFAULT_PLUGIN

    def describe(self) -> str:
        text = f"{self.generation.letter} ({self.generation.value}, vLLM {dotted(self.vllm)}"
        if self.plugin:
            text += f", vllm-neuron {dotted(self.plugin)}"
        how = "installed" if self.detected else "--vllm-target"
        return text + f"; {how})"


# --- which vLLM is installed -----------------------------------------------------------------


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def installed_frameworks() -> frozenset[str]:
    return frozenset(fw for fw in (NXDI, TNX) if _dist_version(fw) is not None)


def detect_target() -> VllmTarget | None:
    """The installed vLLM's target, or None when vLLM is not installed here."""
    version = _dist_version("vllm")
    if version is None:
        return None
    vllm = version_tuple(version)
    plugin_text = _dist_version(PLUGIN_DIST)
    plugin = version_tuple(plugin_text) if plugin_text else None
    generation = generation_for(vllm, plugin)
    if generation is None:
        raise NeuronctlError(
            f"vLLM {version} is installed without the vllm-neuron plugin: it has no Neuron "
            "support (the in-tree Neuron worker ended with 0.10.1)",
            f"install vllm-neuron (generation C) or pass --vllm-target; {D_HINT}",
        )
    return VllmTarget(
        generation,
        vllm,
        plugin,
        platform_plugins(),
        installed_frameworks(),
        detected=True,
    )


TARGET_NAMES = {
    "a": Generation.TNX_FORK,
    "tnx-fork": Generation.TNX_FORK,
    "b": Generation.V0,
    "v0": Generation.V0,
    "c": Generation.PLUGIN,
    "plugin": Generation.PLUGIN,
    "d": Generation.NATIVE,
    "native": Generation.NATIVE,
}
TARGET_HELP = (
    "vLLM to write the launch for: tnx-fork (A: vLLM 0.3-0.6 with TNx), v0 (B: the V0 Neuron "
    "worker, 0.7.2 fork and 0.8-0.10.1), plugin (C: vllm-neuron 0.1-0.5 on vLLM 0.10.2-0.16); "
    "add @VERSION for the vLLM version (plugin@0.4.1 names the plugin's). "
    "Default: the installed one."
)


def parse_target(text: str) -> VllmTarget:
    """`NAME[@VERSION]` -> VllmTarget (the installed one's details when it is the same
    generation)."""
    name, _, version = text.strip().partition("@")
    generation = TARGET_NAMES.get(name.lower())
    if generation is None:
        raise UsageError(
            f"--vllm-target: unknown vLLM target {text!r}",
            "use tnx-fork, v0 or plugin (optionally @VERSION, e.g. v0@0.7.2, plugin@0.4.1)",
        )
    if generation is Generation.NATIVE:
        raise UsageError("--vllm-target native (vllm-neuron 0.21+) is not supported", D_HINT)
    wanted = version_tuple(version) if version else None
    if version and not wanted:
        raise UsageError(f"--vllm-target: unreadable version {version!r}", "e.g. v0@0.9.2")
    try:
        installed = detect_target()
    except NeuronctlError:
        installed = None
    if installed is not None and installed.generation is generation and not wanted:
        return replace(installed, detected=False)
    if generation is Generation.PLUGIN:
        plugin = wanted or DEFAULT_PLUGIN
        return VllmTarget(generation, plugin_vllm(plugin), plugin)
    vllm = wanted or DEFAULT_VLLM[generation]
    if generation_for(vllm, None) is not generation:
        raise UsageError(
            f"--vllm-target {text}: vLLM {dotted(vllm)} is not generation {generation.letter}",
            "tnx-fork is vLLM < 0.7, v0 is 0.7-0.10.1",
        )
    return VllmTarget(generation, vllm)


def plugin_vllm(plugin: tuple[int, ...]) -> tuple[int, ...]:
    """The vLLM each vllm-neuron release pins (its requirements/core.txt)."""
    for since, vllm in (((0, 5), (0, 16, 0)), ((0, 4), (0, 13, 0)), ((0, 2), (0, 11, 0))):
        if plugin >= since:
            return vllm
    return (0, 10, 2)


def resolve_target(requested: str | VllmTarget | None = None) -> VllmTarget:
    """--vllm-target, else the installed vLLM, else generation C's default (where Inf2 is)."""
    if isinstance(requested, VllmTarget):
        return requested
    if requested:
        return parse_target(requested)
    installed = detect_target()
    if installed is not None:
        if installed.generation is Generation.NATIVE:
            raise UsageError(
                f"the installed vllm-neuron {dotted(installed.plugin)} is generation D", D_HINT
            )
        return installed
    return VllmTarget(Generation.PLUGIN, DEFAULT_VLLM[Generation.PLUGIN], DEFAULT_PLUGIN)


def require_target(requested: str | VllmTarget | None) -> VllmTarget:
    """For the CLI: no silent default when nothing is installed and nothing was named."""
    if not requested and _dist_version("vllm") is None:
        raise UsageError(
            "vLLM is not installed here, so neuronctl cannot tell which vLLM will launch",
            "pass --vllm-target tnx-fork|v0|plugin (e.g. plugin@0.4.1, v0@0.9.2)",
        )
    return resolve_target(requested)
