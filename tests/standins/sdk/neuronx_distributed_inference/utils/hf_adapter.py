"""STAND-IN: load_pretrained_config returns a callable that copies config.json attributes."""

import json
from pathlib import Path
from typing import Any

from standin_recorder import record


def load_pretrained_config(model_path: str) -> Any:
    record("load_pretrained_config", model_path)
    data = json.loads((Path(model_path) / "config.json").read_text())

    def load(config: Any) -> None:
        for key, value in data.items():
            setattr(config, key, value)

    return load
