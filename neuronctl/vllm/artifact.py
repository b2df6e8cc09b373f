"""What a vLLM launch reads from the artifact: its manifest's finalized spec, the Neuron library
(framework) that compiled it, its architecture and the compiled features that decide flags."""

from __future__ import annotations

from neuronctl.errors import NeuronctlError, UsageError
from neuronctl.spec import FRAMEWORK_BACKENDS, NXDI, TNX, BuildSpec
from neuronctl.store.manifest import Manifest

FRAMEWORK_ALIASES = {"nxdi": NXDI, "tnx": TNX, NXDI: NXDI, TNX: TNX}


def artifact_spec(manifest: Manifest) -> BuildSpec:
    spec = manifest.spec  # typed when read_manifest validated it
    if not isinstance(spec, BuildSpec):  # a Manifest.model_construct()ed by a caller
        spec = BuildSpec.model_validate(spec)
    if spec.dtype == "auto" or "auto" in (spec.context_buckets, spec.token_gen_buckets):
        raise NeuronctlError("the artifact's manifest spec is not finalized (has 'auto' values)")
    return spec


def framework_for(manifest: Manifest, framework: str | None = None) -> str:
    """The vLLM framework that can load this artifact; `framework` may only confirm it."""
    native = {v: k for k, v in FRAMEWORK_BACKENDS.items()}.get(manifest.backend)
    if native is None:
        raise UsageError(
            f"this artifact was built by the {manifest.backend!r} backend, which vLLM cannot load",
            "serve it with `neuronctl serve` (built-in engine) or rebuild with --backend nxdi",
        )
    if framework is None:
        return native
    wanted = FRAMEWORK_ALIASES.get(framework)
    if wanted is None:
        raise UsageError(f"unknown framework {framework!r}", "use nxdi or tnx")
    if wanted != native:
        # vLLM would fail to load it with the other library and recompile.
        raise UsageError(
            f"this artifact was compiled for {native}, not {wanted}",
            f"use --framework {manifest.backend} or rebuild with "
            f"--backend {FRAMEWORK_BACKENDS[wanted]}",
        )
    return native


def architecture(manifest: Manifest) -> str:
    archs = manifest.architecture.get("architectures") or ["?"]
    return str(archs[0])


def on_device_sampling(spec: BuildSpec, framework: str) -> bool:
    """Whether the compiled graph samples on device (what the backend built, overrides too)."""
    from neuronctl.backends import nxdi_neuron_config, tnx_neuron_config

    if framework == NXDI:
        return bool(nxdi_neuron_config(spec).get("on_device_sampling_config"))
    return bool(tnx_neuron_config(spec).get("on_device_generation"))


def prefix_caching(spec: BuildSpec) -> tuple[int, int] | None:
    """(pa_block_size, pa_num_blocks) of an NxDI artifact compiled with a block KV layout."""
    o = spec.override_neuron_config
    if not (o.get("is_prefix_caching") or o.get("is_block_kv_layout")):
        return None
    return int(o.get("pa_block_size") or 0), int(o.get("pa_num_blocks") or 0)
