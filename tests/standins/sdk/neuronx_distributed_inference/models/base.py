"""STAND-IN: a causal LM application with compile/load/forward shaped like NxDI's."""

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import save_file
from standin_recorder import kv_rows, record


class StandinForCausalLM:
    config_cls: Any = None
    _model_cls = "StandinModel"

    def __init__(self, model_path: str, config: Any = None) -> None:
        if config is None:
            config = self.config_cls.load(model_path)
        record("init", {"cls": type(self).__name__, "model_path": model_path})
        self.model_path = model_path
        self.config = config

    @classmethod
    def save_quantized_state_dict(cls, model_path: str, config: Any) -> None:
        # As the real application_base: safetensors into an existing directory, otherwise
        # torch.save of the whole state dict to a file at that path.
        path = config.neuron_config.quantized_checkpoints_path
        record("save_quantized_state_dict", {"path": path, "is_dir": Path(path).is_dir()})
        state = {"w": torch.zeros(2, dtype=torch.int8)}
        if Path(path).is_dir():
            save_file(state, str(Path(path) / "model.safetensors"))
        else:
            torch.save(state, path)

    def compile(self, path: str) -> None:
        record("compile", path)
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        self.config.save(path)
        (out / "model.pt").write_bytes(b"standin torchscript " + path.encode())
        nc = self.config.neuron_config
        if nc.save_sharded_checkpoint:
            (out / "weights").mkdir(exist_ok=True)
            for rank in range(nc.tp_degree):
                save_file({"w": torch.full((2,), float(rank))},
                          str(out / "weights" / f"tp{rank}_sharded_checkpoint.safetensors"))

    def load(self, path: str) -> None:
        record("load", path)
        if not (Path(path) / "model.pt").is_file():
            raise ValueError("torch.jit.load: model.pt not found")
        dtype = self.config.neuron_config.torch_dtype
        if dtype != torch.float32:
            torch.nn.Linear(1, 1).to(dtype)  # the real load(): self.to(torch_dtype)
        self.vocab = int(getattr(self.config, "vocab_size", 32))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor, seq_ids: torch.Tensor) -> Any:
        record("forward", {"input_ids": input_ids.tolist(), "position_ids": position_ids.tolist(),
                           "seq_ids": seq_ids.tolist(), "mask": list(attention_mask.shape)})
        kv_rows(seq_ids.tolist(), position_ids.tolist(), input_ids.tolist())
        # Deterministic fake: the next token is (last token + 1) % vocab.
        nxt = (input_ids[:, -1] + 1) % self.vocab
        if self.config.neuron_config.on_device_sampling_config is not None:
            return SimpleNamespace(logits=nxt.unsqueeze(1))  # token ids, like on-device sampling
        logits = torch.zeros(input_ids.shape[0], self.vocab)
        logits[torch.arange(input_ids.shape[0]), nxt] = 1.0
        return SimpleNamespace(logits=logits)
