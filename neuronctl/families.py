"""The model families neuronctl builds: one row per Hugging Face architecture, the one table.

Each row says what each backend builds of the family and, for the torch backend, what its
modeling reads differently from Llama's. What else names families is derived from it or
checked against it: the checkpoint registry (`checkpoints/registry.py`) and every backend's
`architectures()` read it; the torch modeling (`backends/torch/config.py`) reads its traits;
tests check docs/checkpoints.md's table, the Neuron backends' model classes (NxD Inference's
by model_type, Transformers NeuronX's), the test checkpoints and the parity tests against it
(tests/test_families.py, tests/test_docs.py).

Sources. `nxdi`: the model support table of the AWS guide "Migrating from Transformers
NeuronX to NxD Inference" (aws-neuron/aws-neuron-sdk,
libraries/nxd-inference/developer_guides/migrate-from-tnx-to-nxdi.rst) and NxD Inference's
model classes by model_type (aws-neuron/neuronx-distributed-inference,
src/neuronx_distributed_inference/utils/constants.py, MODEL_TYPES). `tnx`: the two
architectures vLLM serves through Transformers NeuronX (aws-neuron/upstreaming-to-vllm branch
v0.6.x-neuron, vllm/model_executor/model_loader/neuron.py:36-39); Transformers NeuronX also
has Mixtral, Bloom, GPT-2, GPT-J and GPT-NeoX classes, but without the continuous batching
vLLM needs, so neuronctl's tnx artifacts leave them out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelFamily:
    architecture: str  # config.json's architectures[0]
    model_type: str  # config.json's model_type: NxD Inference and tnx pick classes by it
    builds: Mapping[str, str]  # backend -> what it builds of the family (for people)
    # The torch modeling's differences from Llama (backends/torch/config.py):
    qkv_bias: bool = False  # q/k/v always have a bias (Llama: only with attention_bias)
    windowed: bool = False  # a sliding_window applies to every layer whenever it is set
    moe: bool = False  # a mixture of experts


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        "LlamaForCausalLM", "llama",
        {"torch": "Llama 2, 3, 3.1, 3.2 text models (default, linear and llama3 rope)",
         "nxdi": "NeuronLlamaForCausalLM: Llama 2, 3, 3.1, 3.2 (1B, 3B)",
         "tnx": "LlamaForSampling: Llama 2, 3, 3.1, 3.2 (1B, 3B); vLLM supported"},
    ),
    ModelFamily(
        "MistralForCausalLM", "mistral",
        {"torch": "Mistral 7B: Llama's layout, sliding window only when >= seq_len",
         "nxdi": "Mistral-V2; vLLM maps it to the Llama class",
         "tnx": "MistralForSampling: Mistral-V2; vLLM supported"},
        windowed=True,
    ),
    ModelFamily(
        "Qwen2ForCausalLM", "qwen2",
        {"torch": "Qwen2 / Qwen2.5: q/k/v biases; sliding window only when >= seq_len",
         "nxdi": "NeuronQwen2ForCausalLM"},
        qkv_bias=True,
    ),
    ModelFamily("MixtralForCausalLM", "mixtral", {"nxdi": "NeuronMixtralForCausalLM"}, moe=True),
    ModelFamily("DbrxForCausalLM", "dbrx", {"nxdi": "NeuronDbrxForCausalLM"}, moe=True),
    ModelFamily("Qwen3ForCausalLM", "qwen3", {"nxdi": "qwen3 model class"}),
    ModelFamily("Qwen3MoeForCausalLM", "qwen3_moe", {"nxdi": "qwen3_moe model class"}, moe=True),
    # HF's Gemma3ForCausalLM config says model_type "gemma3_text".
    ModelFamily("Gemma3ForCausalLM", "gemma3_text", {"nxdi": "gemma3 model class"}),
)
BY_ARCHITECTURE = {family.architecture: family for family in FAMILIES}


def architectures(backend: str) -> dict[str, str]:
    """The architectures `backend` builds, with what it builds of each, in table order."""
    return {f.architecture: f.builds[backend] for f in FAMILIES if backend in f.builds}


def model_types(backend: str) -> list[str]:
    return [f.model_type for f in FAMILIES if backend in f.builds]
