"""Which vLLM Neuron generation a vLLM (and vllm-neuron plugin) version is: the part of the
launcher that doctor also needs, kept free of backends so it sits low in the layers.
Generations A-D are described in docs/neuron.md."""

from __future__ import annotations

from enum import StrEnum
from importlib import metadata

from packaging.version import InvalidVersion, Version

PLATFORM_PLUGINS = "vllm.platform_plugins"  # entry-point group vLLM loads platforms from

D_HINT = (
    "vllm-neuron 0.21+ compiles with torch.compile and never reads an NxDI artifact or "
    "NEURON_COMPILED_ARTIFACTS: serve this artifact with vllm-neuron 0.4.1/0.5.0 (generation C) "
    "or `neuronctl serve`; for D, warm its own compile cache and set "
    "VLLM_NEURON_DISABLE_WARMUP_COMPILE=1 (docs/neuron.md)"
)


class Generation(StrEnum):
    TNX_FORK = "tnx-fork"  # A
    V0 = "v0"  # B
    PLUGIN = "plugin"  # C
    NATIVE = "native"  # D

    @property
    def letter(self) -> str:
        return "ABCD"[list(Generation).index(self)]


def version_tuple(version: str) -> tuple[int, ...]:
    """The release numbers of a version, as packaging reads it (PEP 440): '0.6.dev0+neuron215'
    -> (0, 6), '0.5.3rc1' -> (0, 5, 3); () for a version packaging cannot read."""
    try:
        return Version(version).release
    except InvalidVersion:
        return ()


def platform_plugins() -> tuple[str, ...]:
    """Names of the installed `vllm.platform_plugins` entry points (what VLLM_PLUGINS picks)."""
    return tuple(sorted({ep.name for ep in metadata.entry_points(group=PLATFORM_PLUGINS)}))


def generation_for(vllm: tuple[int, ...], plugin: tuple[int, ...] | None) -> Generation | None:
    """The generation of an installed vLLM (and vllm-neuron plugin), or None: no Neuron."""
    if plugin is not None:
        return Generation.NATIVE if plugin >= (0, 21) or vllm >= (0, 21) else Generation.PLUGIN
    if vllm < (0, 7):
        return Generation.TNX_FORK
    if vllm < (0, 10, 2):
        return Generation.V0
    return None  # 0.10.2+ dropped the in-tree Neuron worker: Neuron needs the plugin
