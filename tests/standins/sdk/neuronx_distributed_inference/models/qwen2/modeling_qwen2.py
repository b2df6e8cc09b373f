"""STAND-IN: Qwen2 classes."""

from ..base import StandinForCausalLM
from ..config import InferenceConfig


class Qwen2InferenceConfig(InferenceConfig):
    pass


class NeuronQwen2ForCausalLM(StandinForCausalLM):
    config_cls = Qwen2InferenceConfig
