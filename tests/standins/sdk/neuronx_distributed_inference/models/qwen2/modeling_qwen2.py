"""STAND-IN: Qwen2 classes (the real Qwen2InferenceConfig asks for Qwen2NeuronConfig)."""

from ..base import StandinForCausalLM
from ..config import InferenceConfig, NeuronConfig


class Qwen2NeuronConfig(NeuronConfig):
    pass


class Qwen2InferenceConfig(InferenceConfig):
    @classmethod
    def get_neuron_config_cls(cls):
        return Qwen2NeuronConfig


class NeuronQwen2ForCausalLM(StandinForCausalLM):
    config_cls = Qwen2InferenceConfig
