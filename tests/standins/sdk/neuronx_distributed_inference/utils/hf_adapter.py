"""STAND-IN: load_pretrained_config returns a callable that copies config.json attributes.

As the real one (utils/hf_adapter.py), it takes a path or an hf_config, never both, and the
config it loads carries `_name_or_path`: the path given, or "" for an in-memory config
(transformers' PretrainedConfig.to_dict keeps it), so vLLM's md5 name depends on --model."""

import json
from pathlib import Path
from typing import Any

from standin_recorder import record


def load_pretrained_config(model_path_or_name: Any = None, hf_config: Any = None) -> Any:
    if (model_path_or_name is None) == (hf_config is None):
        raise ValueError('Please provide only one of "model_path_or_name" or "hf_config"')
    record("load_pretrained_config", model_path_or_name)
    if hf_config is not None:
        data = hf_config.to_dict()
    else:
        data = json.loads((Path(model_path_or_name) / "config.json").read_text())
        data["_name_or_path"] = str(model_path_or_name)

    def load(config: Any) -> None:
        for key, value in data.items():
            setattr(config, key, value)

    return load
