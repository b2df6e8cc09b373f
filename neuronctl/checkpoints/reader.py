"""Reading a local checkpoint directory: config.json plus safetensors (or, if allowed, pickle).

Everything that can be checked without reading tensor bytes is checked when the checkpoint is
opened (config present, every shard the index names present, no file truncated), so a broken
download fails in a second with one line instead of halfway through a compile.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from neuronctl.checkpoints.digest import model_files_digest, weights_digest
from neuronctl.checkpoints.registry import describe_support, supported_backends
from neuronctl.checkpoints.safetensors_format import TensorInfo, read_header
from neuronctl.errors import CheckpointError, NotFoundError
from neuronctl.spec import ModelShape

logger = logging.getLogger(__name__)

CONFIG = "config.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_INDEX = "pytorch_model.bin.index.json"
CONVERT_HINT = (
    "convert it to safetensors (e.g. `AutoModelForCausalLM.from_pretrained(dir)"
    ".save_pretrained(out, safe_serialization=True)`) or pass --allow-pickle if you trust it"
)


@dataclass
class Checkpoint:
    ref: str  # what the user named: Hub id or path
    path: Path  # local directory holding config.json and the weights
    revision: str | None  # Hub commit sha; None for a local directory
    config: dict[str, Any]  # parsed config.json
    # tensor name -> file holding it; filled by open_local
    _where: dict[str, Path] = field(default_factory=dict, repr=False)
    _infos: dict[str, TensorInfo] = field(default_factory=dict, repr=False)
    _pickled: dict[Path, dict[str, torch.Tensor]] = field(default_factory=dict, repr=False)

    @property
    def architecture(self) -> str:
        return str(self.config["architectures"][0])

    def shape(self) -> ModelShape:
        return ModelShape.from_config(self.config)

    def weight_files(self) -> list[Path]:
        return sorted(set(self._where.values()))

    def tensor_names(self) -> list[str]:
        return list(self._where)

    def tensor_info(self, name: str) -> TensorInfo:
        """Dtype and shape without reading the tensor."""
        return self._infos[self._check_name(name)]

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, read on its own; the file mapping is released before returning."""
        path = self._where[self._check_name(name)]
        if path.suffix == ".safetensors":
            # Open per tensor: keeping the mapping would count every page read toward RSS.
            with safe_open(str(path), framework="pt") as f:
                return f.get_tensor(name)
        return self._pickle_file(path)[name]

    def digest(self, rehash: bool = False) -> str:
        """The content digest of config.json and the weights (docs/checkpoints.md)."""
        return weights_digest(self.path, self.weight_files(), rehash=rehash)

    def model_files_digest(self, rehash: bool = False) -> str:
        """The digest of the config, tokenizer and generation files an artifact copies."""
        return model_files_digest(self.path, rehash=rehash)

    def num_parameters(self) -> int:
        tied = bool(self.config.get("tie_word_embeddings"))
        return sum(
            info.numel
            for name, info in self._infos.items()
            if not (tied and name == "lm_head.weight")
        )

    def size_on_disk(self) -> int:
        return sum(p.stat().st_size for p in self.weight_files())

    def _check_name(self, name: str) -> str:
        if name not in self._where:
            raise CheckpointError(f"{self.ref} has no tensor {name!r}")
        return name

    def _pickle_file(self, path: Path) -> dict[str, torch.Tensor]:
        if path not in self._pickled:
            # mmap keeps memory flat: tensors are paged in when used.
            self._pickled[path] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return self._pickled[path]


def valid_tp_degrees(heads: int, kv_heads: int) -> list[int]:
    """Degrees that divide the heads and either divide or are a multiple of the KV heads."""
    return [
        d
        for d in range(1, heads + 1)
        if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)
    ]


def config_dtype(config: dict[str, Any]) -> str | None:
    """The checkpoint dtype; transformers 5 writes "dtype", older versions "torch_dtype"."""
    value = config.get("dtype") or config.get("torch_dtype")
    return str(value) if value else None


# Bounds on a config.json, checked before anything is built from it: a model is allocated
# from these numbers (num_hidden_layers 10**8 drove a compile to 20.8 GB before any tensor
# was compared). Each is far above any released model's (Llama 3.1 405B: 126 layers, hidden
# 16384, intermediate 53248, 128 heads; Gemma: 262144 vocabulary; 10M-token contexts).
MAX_CONFIG_BYTES = 16 * 1024 * 1024
MAX_CONFIG_DEPTH = 32
CONFIG_LIMITS = {
    "num_hidden_layers": 1024,
    "hidden_size": 65536,
    "intermediate_size": 262144,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 1024,
    "vocab_size": 4 * 1024 * 1024,
    "max_position_embeddings": 32 * 1024 * 1024,
}
POSITIVE_FLOATS = ("rope_theta", "rms_norm_eps")


def read_config(path: Path) -> dict[str, Any]:
    config_path = path / CONFIG
    if not config_path.is_file():
        raise CheckpointError(
            f"{path} has no config.json", "point at the directory holding the model's config.json"
        )
    if config_path.stat().st_size > MAX_CONFIG_BYTES:
        raise CheckpointError(f"{config_path} is over {MAX_CONFIG_BYTES} bytes: not a config")
    try:
        config = json.loads(config_path.read_text(), parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{config_path} is not valid JSON: {exc}") from None
    except RecursionError:
        raise CheckpointError(f"{config_path} is nested too deeply to be a config") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path} is not a JSON object")
    if _depth(config) > MAX_CONFIG_DEPTH:
        raise CheckpointError(f"{config_path} is nested over {MAX_CONFIG_DEPTH} levels deep")
    check_config_values(config, config_path)
    return config


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _depth(value: Any) -> int:
    """How deeply objects and arrays nest (iterative: a deep value must not recurse)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth + 1)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest


def check_config_values(config: dict[str, Any], where: Path) -> None:
    """The sizes a model is built from are integers in range, its float constants finite
    and positive, at the top level and in a nested text_config."""
    text_config = config.get("text_config")
    for section in (config, text_config if isinstance(text_config, dict) else {}):
        for name, limit in CONFIG_LIMITS.items():
            value = section.get(name)
            if value is None:
                continue
            if not _is_int(value) or not 1 <= value <= limit:
                raise CheckpointError(
                    f"{where}: {name} is {value!r}; it must be an integer from 1 to {limit}",
                    "the config.json is damaged or not a model's",
                )
        for name in POSITIVE_FLOATS:
            value = section.get(name)
            if value is None:
                continue
            if not (_is_int(value) or isinstance(value, float)) or not 0 < value < math.inf:
                raise CheckpointError(
                    f"{where}: {name} is {value!r}; it must be a finite number > 0",
                    "the config.json is damaged or not a model's",
                )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_architecture(config: dict[str, Any], where: Path) -> None:
    archs = config.get("architectures") or []
    if not archs:
        raise CheckpointError(
            f"{where / CONFIG} names no architecture", 'add an "architectures" list to it'
        )
    if not supported_backends(archs[0]):
        raise CheckpointError(
            f"architecture {archs[0]} is not supported by any backend",
            "supported: " + describe_support(),
        )


def open_local(
    ref: str, path: Path, revision: str | None = None, *, allow_pickle: bool = False
) -> Checkpoint:
    """Open and validate a checkpoint directory (no tensor bytes are read)."""
    if not path.exists():
        raise NotFoundError(f"{path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory", "name the checkpoint directory")
    config = read_config(path)
    check_architecture(config, path)
    ckpt = Checkpoint(ref=ref, path=path, revision=revision, config=config)
    files = _safetensors_files(path)
    if files:
        for file in files:
            infos, _meta = read_header(file)
            for name, info in infos.items():
                ckpt._where[name] = file
                ckpt._infos[name] = info
    else:
        _open_pickle(ckpt, allow_pickle)
    if not ckpt._where:
        raise CheckpointError(f"{path} holds no tensors")
    logger.debug(
        "opened %s: %s, %d tensors in %d files",
        path,
        ckpt.architecture,
        len(ckpt._where),
        len(ckpt.weight_files()),
    )
    return ckpt


def _safetensors_files(path: Path) -> list[Path]:
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        return _indexed_files(path, index)
    return sorted(path.glob("*.safetensors"))


def _indexed_files(path: Path, index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise CheckpointError(f"{index} is not a valid index (no weight_map)") from None
    files = sorted({path / name for name in weight_map.values()})
    for file in files:
        if not file.is_file():
            raise CheckpointError(
                f"{index.name} names {file.name}, which is missing from {path}",
                "the download is incomplete: run `neuronctl download MODEL` again",
            )
    return files


def _open_pickle(ckpt: Checkpoint, allow_pickle: bool) -> None:
    path = ckpt.path
    index = path / PICKLE_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / name for name in weight_map.values()})
    else:
        files = sorted(path.glob("*.bin")) + sorted(path.glob("*.pth"))
    if not files:
        raise CheckpointError(
            f"{path} has no weights (*.safetensors)", "download the model's safetensors files"
        )
    if not allow_pickle:
        raise CheckpointError(f"{path} has only pickle weights ({files[0].name})", CONVERT_HINT)
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{index.name} names {file.name}, which is missing from {path}")
        try:
            tensors = ckpt._pickle_file(file)
        except Exception as exc:  # torch raises many types for a damaged or unsafe pickle
            raise CheckpointError(f"cannot load {file}: {exc}".splitlines()[0]) from None
        for name, tensor in tensors.items():
            ckpt._where[name] = file
            ckpt._infos[name] = TensorInfo(tensor.dtype, tuple(tensor.shape))
