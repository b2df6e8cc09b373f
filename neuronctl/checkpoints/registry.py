"""Which Hugging Face architectures each backend can build, with a note on each.

`torch` lists what neuronctl's embedded backend really implements (the Llama family).
This is the one list: each backend's `architectures()` returns its entry here.
`nxdi` follows the model support table of the AWS "Migrating from Transformers NeuronX to NxD
Inference" guide (aws-neuron/aws-neuron-sdk
libraries/nxd-inference/developer_guides/migrate-from-tnx-to-nxdi.rst) and NxD Inference's model
classes by HF model_type (aws-neuron/neuronx-distributed-inference
src/neuronx_distributed_inference/utils/constants.py, MODEL_TYPES). `tnx` lists the two
architectures vLLM serves through Transformers NeuronX (aws-neuron/upstreaming-to-vllm branch
v0.6.x-neuron, vllm/model_executor/model_loader/neuron.py:36-39).
"""

from __future__ import annotations

from neuronctl.errors import CheckpointError

ARCHITECTURES: dict[str, dict[str, str]] = {
    "torch": {
        "LlamaForCausalLM": "Llama 2, 3, 3.1, 3.2 text models",
        "MistralForCausalLM": "Mistral 7B (Llama layout with sliding-window attention)",
        "Qwen2ForCausalLM": "Qwen2 / Qwen2.5 (Llama layout with q/k/v biases)",
    },
    "nxdi": {
        "LlamaForCausalLM": "NeuronLlamaForCausalLM: Llama 2, 3, 3.1, 3.2 (1B, 3B)",
        "MllamaForConditionalGeneration": "Llama 3.2 11B and 90B (multimodal)",
        "MistralForCausalLM": "Mistral-V2; vLLM maps it to the Llama class",
        "MixtralForCausalLM": "NeuronMixtralForCausalLM (MoE)",
        "DbrxForCausalLM": "NeuronDbrxForCausalLM (MoE)",
        "Qwen2ForCausalLM": "NeuronQwen2ForCausalLM",
        "Qwen3ForCausalLM": "qwen3 model class",
        "Qwen3MoeForCausalLM": "qwen3_moe model class (MoE)",
        "Gemma3ForCausalLM": "gemma3 model class",
    },
    "tnx": {
        "LlamaForCausalLM": "LlamaForSampling: Llama 2, 3, 3.1, 3.2 (1B, 3B); vLLM supported",
        "MistralForCausalLM": "MistralForSampling: Mistral-V2; vLLM supported",
        # Transformers NeuronX also has Mixtral, Bloom, GPT2, GPT-J and GPT-NeoX classes, but
        # without continuous batching or vLLM support, which neuronctl's tnx artifacts need.
    },
}


def supported_backends(architecture: str) -> list[str]:
    """The backends that can build `architecture`, in registry order."""
    return [name for name, archs in ARCHITECTURES.items() if architecture in archs]


def describe_support() -> str:
    """One line per backend listing its architectures, for error messages."""
    return "; ".join(f"{name}: {', '.join(archs)}" for name, archs in ARCHITECTURES.items())


def check_supported(architecture: str, backend: str) -> None:
    """Raise CheckpointError naming what each backend supports if `backend` can't build it."""
    if architecture in ARCHITECTURES.get(backend, {}):
        return
    others = supported_backends(architecture)
    hint = f"use --backend {others[0]}" if others else "supported: " + describe_support()
    raise CheckpointError(
        f"the {backend} backend does not support {architecture}"
        + (f" (supported by: {', '.join(others)})" if others else ""),
        hint,
    )
