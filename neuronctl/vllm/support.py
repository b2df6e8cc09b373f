"""Which artifacts each vLLM generation can load without recompiling: the architectures its
Neuron loader serves, what vllm-neuron resolves, and `refuse` for every combination that would
recompile or fail."""

from __future__ import annotations

from neuronctl.errors import NeuronctlError, UsageError
from neuronctl.spec import BuildSpec
from neuronctl.store.manifest import Manifest
from neuronctl.vllm.artifact import (
    FRAMEWORK_BACKENDS,
    NXDI,
    TNX,
    architecture,
    on_device_sampling,
    prefix_caching,
)
from neuronctl.vllm.detect import VllmTarget, dotted
from neuronctl.vllm_generations import D_HINT, Generation

# Architectures each generation's Neuron loader serves (None: whatever NxDI has).
A_ARCHS: dict[tuple[int, ...], set[str]] = {
    (0, 3): {"LlamaForCausalLM"},  # TNx continuous-batching guide, vLLM 0.3.3
    (0, 5): {"LlamaForCausalLM", "MistralForCausalLM"},  # the same guide, vLLM 0.5.0
    (0, 6): {"LlamaForCausalLM", "MistralForCausalLM"},  # v0.6.x-neuron loader/neuron.py:36
}
# The 0.6.x-neuron fork also loads NxD Inference artifacts (model_loader/neuronx_distributed.py,
# upstreaming-to-vllm v0.6.x-neuron c097c1891): these architectures (:41-50, Mllama aside) from
# NEURON_COMPILED_ARTIFACTS (:124-125), picked by VLLM_NEURON_FRAMEWORK (worker :35-40).
A_NXDI_FROM = (0, 6)
A_NXDI_ARCHS = {"LlamaForCausalLM", "DbrxForCausalLM", "MixtralForCausalLM"}
B_ARCHS = {"LlamaForCausalLM", "MistralForCausalLM", "DbrxForCausalLM", "MixtralForCausalLM"}
B_FORK_EXTRA = {"Qwen2ForCausalLM"}  # neuron-2.24-vllm-v0.7.2 neuronx_distributed.py:70
# vllm-neuron resolves an architecture through NxDI's utils/constants.py MODEL_TYPES (its
# loader's _get_neuron_model_cls), so what it serves is what the NxDI of the SDK its README
# names has: 2.26 for 0.1.0/0.2.0, 2.27 for 0.2.2, 2.28 for 0.4.1/0.5.0. Keyed by the first
# plugin release of each SDK. None of them has "mistral" (from 2.29) or "gemma3" (2.29).
C_MODEL_TYPES: dict[tuple[int, ...], frozenset[str]] = {
    (0, 1): frozenset(
        {"llama", "llama4", "mllama", "mixtral", "dbrx", "qwen2", "qwen3", "qwen3_moe"}
    ),
}
C_MODEL_TYPES[(0, 2, 2)] = C_MODEL_TYPES[(0, 1)] | {"gpt_oss"}
C_MODEL_TYPES[(0, 4)] = C_MODEL_TYPES[(0, 2, 2)] | {"pixtral", "qwen2_vl", "qwen3_vl"}
C_SDK = {(0, 1): "2.26", (0, 2, 2): "2.27", (0, 4): "2.28"}
# The model name the plugin looks up for an architecture whose lowercased prefix is not it.
C_MODEL_NAMES = {"gptoss": "gpt_oss", "qwen3moe": "qwen3_moe", "qwen2vl": "qwen2_vl",
                 "qwen3vl": "qwen3_vl"}  # fmt: skip
# 0.1.0 has no CPU sampling: NeuronCausalLM.sample raises "CPU sampler not implemented".
C_CPU_SAMPLING = (0, 2)


def refuse(target: VllmTarget, framework: str, spec: BuildSpec, manifest: Manifest) -> None:
    """Raise for a combination that cannot reuse the artifact (vLLM would recompile or fail)."""
    gen, arch, why = target.generation, architecture(manifest), None
    if gen is Generation.NATIVE:
        raise UsageError("vllm-neuron 0.21+ (generation D) is not supported", D_HINT)
    if gen is Generation.TNX_FORK and framework == NXDI:
        why = _a_nxdi_refusal(target.vllm, spec, arch)
    elif gen is Generation.PLUGIN and framework == TNX:
        why = "the vllm-neuron plugin runs NxD Inference only (TNx ended with SDK 2.26)"
    elif gen is Generation.PLUGIN and spec.draft_model:
        why = "vllm-neuron serves EAGLE speculation only, not a draft model (its README)"
    elif gen is Generation.PLUGIN:
        why = _plugin_refusal(target.plugin_release, framework, spec, arch)
    elif gen is not Generation.PLUGIN and prefix_caching(spec):
        why = "block-KV (prefix caching) artifacts are launched for vllm-neuron (C) only"
    elif gen is Generation.TNX_FORK and arch not in a_archs(target.vllm):
        why = f"vLLM {dotted(target.vllm)}'s TNx loader does not serve {arch}"
    elif gen is Generation.V0 and framework == NXDI and arch not in b_archs(target.vllm):
        why = f"vLLM {dotted(target.vllm)}'s NxDI loader does not serve {arch}"
    elif gen is Generation.V0 and framework == TNX and target.vllm >= (0, 8):
        if target.frameworks is not None and NXDI in target.frameworks:
            why = (
                "upstream vLLM 0.8+ cannot be told to use TNx (VLLM_NEURON_FRAMEWORK="
                "transformers-neuronx raises AttributeError) and picks NxD Inference, which is "
                "installed here"
            )
    if why:
        raise NeuronctlError(
            f"vLLM {target.describe()} cannot reuse this {FRAMEWORK_BACKENDS[framework]} "
            f"artifact: {why}",
            "pick another --vllm-target or rebuild for it; see docs/neuron.md",
        )


def _a_nxdi_refusal(vllm: tuple[int, ...], spec: BuildSpec, arch: str) -> str | None:
    if vllm < A_NXDI_FROM:
        return (
            f"vLLM {dotted(vllm)} has only the Transformers NeuronX loader (NxD Inference "
            "comes with the 0.6.x-neuron fork's model_loader/neuronx_distributed.py)"
        )
    if arch not in A_NXDI_ARCHS:
        return f"the 0.6.x-neuron fork's NxDI loader does not serve {arch}"
    if spec.draft_model:
        return "the 0.6.x-neuron fork's NxDI speculation path is not launched by neuronctl"
    if not on_device_sampling(spec, NXDI):
        # Its NeuronCasualLM reads vLLM's own NeuronConfig (neuronx_distributed.py:120), whose
        # on_device_sampling_config is always set (:421-437), to decide that the model's
        # output is sampled token ids (:81, :97); the fork has no variable to say otherwise.
        return (
            "the 0.6.x-neuron fork's NxDI loader always takes the model's output for sampled "
            "token ids, and this artifact was compiled without on-device sampling"
        )
    return None


def plugin_model_name(arch: str) -> str | None:
    """The MODEL_TYPES key vllm-neuron's _get_neuron_model_cls looks `arch` up under."""
    if arch == "LlavaForConditionalGeneration":
        return "pixtral"
    model, sep, _task = arch.removeprefix("Neuron").partition("For")
    if not sep:
        return None
    return C_MODEL_NAMES.get(model.lower(), model.lower())


def _c_release(plugin: tuple[int, ...]) -> tuple[int, ...]:
    """The first plugin release of the SDK `plugin` names (C_MODEL_TYPES' key)."""
    return max((k for k in C_MODEL_TYPES if plugin >= k), default=(0, 1))


def c_model_types(plugin: tuple[int, ...]) -> frozenset[str]:
    return C_MODEL_TYPES[_c_release(plugin)]


def _plugin_refusal(
    plugin: tuple[int, ...], framework: str, spec: BuildSpec, arch: str
) -> str | None:
    if plugin_model_name(arch) not in c_model_types(plugin):
        elsewhere = " or vLLM 0.9's NxDI loader (--vllm-target v0)" if arch in B_ARCHS else ""
        return (
            f"vllm-neuron {dotted(plugin)} looks {arch} up in the MODEL_TYPES of the NxD "
            f"Inference of SDK {C_SDK[_c_release(plugin)]}, which lacks it, and raises "
            f"ValueError at start-up (serve it with `neuronctl serve`{elsewhere})"
        )
    if plugin < C_CPU_SAMPLING and not on_device_sampling(spec, framework):
        return (
            "vllm-neuron 0.1.0 has no CPU sampler and this artifact was compiled without "
            "on-device sampling, so every request would fail (rebuild with the default "
            "on-device sampling, vLLM's own config, or use vllm-neuron 0.2.0+)"
        )
    return None


def a_archs(vllm: tuple[int, ...]) -> set[str]:
    return A_ARCHS.get(vllm[:2], A_ARCHS[(0, 6)] if vllm >= (0, 6) else A_ARCHS[(0, 3)])


def b_archs(vllm: tuple[int, ...]) -> set[str]:
    return B_ARCHS | (B_FORK_EXTRA if vllm[:2] == (0, 7) else set())
