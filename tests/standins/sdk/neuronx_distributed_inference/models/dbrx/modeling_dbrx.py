"""STAND-IN: DBRX classes (the real NeuronDbrxConfig forces fused_qkv)."""

from ..base import StandinForCausalLM
from ..config import InferenceConfig, MoENeuronConfig


class NeuronDbrxConfig(MoENeuronConfig):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.fused_qkv = True


class DbrxInferenceConfig(InferenceConfig):
    @classmethod
    def get_neuron_config_cls(cls):
        return NeuronDbrxConfig


class NeuronDbrxForCausalLM(StandinForCausalLM):
    config_cls = DbrxInferenceConfig
