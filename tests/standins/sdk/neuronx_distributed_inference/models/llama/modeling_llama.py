"""STAND-IN: Llama classes."""

from ..base import StandinForCausalLM
from ..config import InferenceConfig


class LlamaInferenceConfig(InferenceConfig):
    pass


class NeuronLlamaForCausalLM(StandinForCausalLM):
    config_cls = LlamaInferenceConfig
