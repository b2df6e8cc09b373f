"""STAND-IN: Mixtral classes (MoENeuronConfig, as the real get_neuron_config_cls says)."""

from ..base import StandinForCausalLM
from ..config import InferenceConfig, MoENeuronConfig


class MixtralInferenceConfig(InferenceConfig):
    @classmethod
    def get_neuron_config_cls(cls):
        return MoENeuronConfig


class NeuronMixtralForCausalLM(StandinForCausalLM):
    config_cls = MixtralInferenceConfig
