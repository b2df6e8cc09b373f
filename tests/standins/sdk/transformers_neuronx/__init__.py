"""STAND-IN for transformers_neuronx (tests only): *ForSampling with from_pretrained (and its
_sanity_check), to_neuron, save and load shaped like TNx's, NEFFs named by a fake HLO hash of
the arguments and NeuronConfig.to_json(). save(sharded_weights=True) writes TNx's own config
object as config.json, without `architectures`, as the real base.py does."""

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from standin_recorder import kv_rows, record

from . import config  # noqa: F401
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
                                   "neuron_config": neuron_config.to_json()})
        _sanity_check(neuron_config=neuron_config, **kwargs)
        json.loads((Path(path) / "config.json").read_text())  # AutoConfig.from_pretrained
        return cls(path, neuron_config, **kwargs)

    def hlo_hash(self) -> str:
        shape = json.dumps([self.kwargs, self.neuron_config.to_json(), VERSION], sort_keys=True)
        return hashlib.sha256(shape.encode()).hexdigest()[:20]

    def update_generation_config(self, generation_config: Any) -> None:
        assert self.neuron_config.on_device_generation is not None
        assert self.neuron_config.on_device_generation.dynamic, "not a dynamic config"
        record("update_generation_config", dict(generation_config.__dict__))
        self.generation = generation_config

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
        if sharded_weights:
            assert self.neuron_config.on_device_embedding, (
                "on_device_embedding must be True to save and load presharded weights")
        out = Path(directory)
        (out / f"{self.hlo_hash()}.neff").write_bytes(b"standin neff")
        if sharded_weights:
            hf = json.loads((Path(self.path) / "config.json").read_text())
            # TNx's own LlamaConfig.__dict__: some HF attributes, its shape arguments and
            # model_type, but no `architectures`.
            config = {k: hf[k] for k in ("hidden_size", "num_attention_heads",
                                         "num_hidden_layers", "vocab_size") if k in hf}
            config.update(model_type="llama", n_positions=self.kwargs.get("n_positions"),
                          batch_size=self.kwargs.get("batch_size"), amp=self.kwargs.get("amp"),
                          tp_degree=self.kwargs.get("tp_degree"), is_presharded_checkpoint=True)
            (out / "config.json").write_text(json.dumps(config))
            (out / "layer0.safetensors").write_bytes(b"standin weights")

    def load(self, directory: str) -> None:
        record("load", directory)
        self.load_dir = directory

    def forward(self, input_ids: torch.Tensor, cache_ids: torch.Tensor,
                start_ids: torch.Tensor) -> torch.Tensor:
        record("forward", {"input_ids": input_ids.tolist(), "cache_ids": cache_ids.tolist(),
                           "start_ids": start_ids.tolist()})
        kv_rows(start_ids.tolist(), cache_ids.tolist(), input_ids.tolist())
        vocab = json.loads((Path(self.path) / "config.json").read_text())["vocab_size"]
        nxt = (input_ids[:, -1] + 1) % vocab
        if self.neuron_config.on_device_generation is not None:
            return nxt.unsqueeze(1)  # token ids, as on-device generation returns
        logits = torch.zeros(input_ids.shape[0], vocab)
        logits[torch.arange(input_ids.shape[0]), nxt] = 1.0
        return logits


def _sanity_check(**kwargs: Any) -> None:
    """The real PretrainedModel.from_pretrained._sanity_check (module.py)."""
    cle, n_positions = kwargs.get("context_length_estimate"), kwargs.get("n_positions", 2048)
    max_n = max(n_positions) if isinstance(n_positions, list) else n_positions
    max_cle = max(cle) if isinstance(cle, list) else cle
    if isinstance(max_n, int) and isinstance(max_cle, int):
        assert max_n >= max_cle, "context_length_estimate cannot be more than n_positions"
    nc = kwargs.get("neuron_config")
    bsh_cache = nc is not None and nc.cache_layout == "BSH"
    if nc is not None and nc.continuous_batching:
        cb = nc.continuous_batching
        assert cb.batch_size_for_shared_caches == kwargs.get("batch_size"), "batch size"
        if bsh_cache and not cb.optimized_paged_attention:
            assert isinstance(n_positions, list) and len(n_positions) == 1
            assert isinstance(cle, list) and len(cle) == 1, "BSH cache: no multi-bucketing"
    else:
        assert not bsh_cache, "BSH cache layout can only be configured with continuous batching."


class SparseAttnConfig:
    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)


class LlamaForSampling(_ForSampling):
    pass


class MistralForSampling(_ForSampling):
    pass
