"""STAND-IN for transformers_neuronx (tests only): *ForSampling with from_pretrained,
to_neuron, save and load shaped like TNx's, NEFFs named by a fake HLO hash."""

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from standin_recorder import record

from .config import (  # noqa: F401
    ContinuousBatchingConfig,
    GenerationConfig,
    NeuronConfig,
    QuantizationConfig,
)

VERSION = "0.99.0"


class _ForSampling:
    def __init__(self, path: str, neuron_config: Any, **kwargs: Any) -> None:
        self.path, self.neuron_config, self.kwargs = path, neuron_config, kwargs
        self.load_dir: str | None = None
        self.compiled = False

    @classmethod
    def from_pretrained(cls, path: str, *, neuron_config: Any, **kwargs: Any) -> "_ForSampling":
        record("from_pretrained", {"cls": cls.__name__, "path": path, **kwargs,
                                   "neuron_config": neuron_config.as_dict()})
        return cls(path, neuron_config, **kwargs)

    def hlo_hash(self) -> str:
        shape = json.dumps([self.kwargs, self.neuron_config.as_dict(), VERSION], sort_keys=True)
        return hashlib.sha256(shape.encode()).hexdigest()[:20]

    def to_neuron(self) -> None:
        record("to_neuron", {"load_dir": self.load_dir,
                             "cache": os.environ.get("NEURON_COMPILE_CACHE_URL")})
        if self.load_dir is not None:
            if not (Path(self.load_dir) / f"{self.hlo_hash()}.neff").is_file():
                raise FileNotFoundError("Could not find a matching NEFF for your HLO")
        elif cache := os.environ.get("NEURON_COMPILE_CACHE_URL"):
            flags = os.environ.get("NEURON_CC_FLAGS", "")
            entry = Path(cache) / f"neuronxcc-2.99.0/MODULE_{self.hlo_hash()}+{len(flags)}"
            entry.mkdir(parents=True, exist_ok=True)
            (entry / "model.neff").write_bytes(b"neff")
            (entry / "model.done").write_bytes(b"")
        self.compiled = True

    def save(self, directory: str, sharded_weights: bool = False) -> None:
        record("save", {"dir": directory, "sharded_weights": sharded_weights})
        if sharded_weights and not self.neuron_config.kwargs.get("on_device_embedding"):
            raise ValueError("sharded_weights requires on_device_embedding=True")
        out = Path(directory)
        (out / f"{self.hlo_hash()}.neff").write_bytes(b"standin neff")
        if sharded_weights:
            config = json.loads((Path(self.path) / "config.json").read_text())
            config["is_presharded_checkpoint"] = True
            (out / "config.json").write_text(json.dumps(config))
            (out / "layer0.safetensors").write_bytes(b"standin weights")

    def load(self, directory: str) -> None:
        record("load", directory)
        self.load_dir = directory

    def forward(self, input_ids: torch.Tensor, cache_ids: torch.Tensor,
                start_ids: torch.Tensor) -> torch.Tensor:
        record("forward", {"input_ids": input_ids.tolist(), "cache_ids": cache_ids.tolist(),
                           "start_ids": start_ids.tolist()})
        vocab = json.loads((Path(self.path) / "config.json").read_text())["vocab_size"]
        nxt = (input_ids[:, -1] + 1) % vocab
        logits = torch.zeros(input_ids.shape[0], vocab)
        logits[torch.arange(input_ids.shape[0]), nxt] = 1.0
        return logits


class LlamaForSampling(_ForSampling):
    pass


class MistralForSampling(_ForSampling):
    pass
