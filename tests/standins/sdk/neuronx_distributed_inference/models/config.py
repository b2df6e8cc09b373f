"""STAND-IN: NeuronConfig / InferenceConfig with the behaviour NEURON_FACTS describes."""

import json
from pathlib import Path
from typing import Any

from standin_recorder import record


class NeuronConfig:
    def __init__(self, **kwargs: Any) -> None:
        record(type(self).__name__, dict(kwargs))
        self.batch_size = 1
        self.seq_len = 128
        self.tp_degree = 1
        self.save_sharded_checkpoint = False
        self.on_device_sampling_config = None
        self.__dict__.update(kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class MoENeuronConfig(NeuronConfig):
    pass


class InferenceConfig:
    def __init__(self, neuron_config: NeuronConfig, load_config: Any = None, **kwargs: Any):
        self.neuron_config = neuron_config
        self.fused_spec_config = None
        if load_config is not None:
            load_config(self)
        self.__dict__.update(kwargs)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "neuron_config"}
        out["neuron_config"] = self.neuron_config.to_dict()
        out["fused_spec_config"] = None if self.fused_spec_config is None else "fused"
        return out

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def save(self, path: str) -> None:
        (Path(path) / "neuron_config.json").write_text(self.to_json_string())

    @classmethod
    def load(cls, path: str) -> "InferenceConfig":
        data = json.loads((Path(path) / "neuron_config.json").read_text())  # FileNotFoundError
        neuron = NeuronConfig.__new__(NeuronConfig)
        neuron.__dict__.update(data.pop("neuron_config"))
        data.pop("fused_spec_config", None)
        return cls(neuron, **data)


class FusedSpecNeuronConfig:
    def __init__(self, model_cls: Any, draft_config: Any, draft_model_path: str) -> None:
        record("FusedSpecNeuronConfig", {"draft_model_path": draft_model_path})
        self.draft_config = draft_config
