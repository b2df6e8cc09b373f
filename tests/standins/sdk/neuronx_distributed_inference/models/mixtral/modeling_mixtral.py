"""STAND-IN: Mixtral classes."""

from ..base import StandinForCausalLM
from ..config import InferenceConfig


class MixtralInferenceConfig(InferenceConfig):
    pass


class NeuronMixtralForCausalLM(StandinForCausalLM):
    config_cls = MixtralInferenceConfig
