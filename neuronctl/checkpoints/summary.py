"""What `neuronctl inspect` reports about a checkpoint, as plain data."""

from __future__ import annotations

from typing import Any

from neuronctl.checkpoints.reader import Checkpoint, config_dtype, valid_tp_degrees
from neuronctl.checkpoints.registry import supported_backends


def summarize(ckpt: Checkpoint) -> dict[str, Any]:
    config = ckpt.config
    shape = ckpt.shape()
    degrees = valid_tp_degrees(shape.num_attention_heads, shape.num_key_value_heads)
    return {
        "model": ckpt.ref,
        "path": str(ckpt.path),
        "revision": ckpt.revision,
        "architecture": ckpt.architecture,
        "model_type": config.get("model_type"),
        "parameters": ckpt.num_parameters(),
        "dtype": config_dtype(config),
        "size_bytes": ckpt.size_on_disk(),
        "weight_files": len(ckpt.weight_files()),
        "num_layers": config.get("num_hidden_layers"),
        "hidden_size": config.get("hidden_size"),
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "vocab_size": config.get("vocab_size"),
        "max_position_embeddings": shape.max_position_embeddings,
        "tie_word_embeddings": bool(config.get("tie_word_embeddings")),
        "rope": config.get("rope_parameters") or config.get("rope_scaling"),
        "sliding_window": config.get("sliding_window"),
        "backends": supported_backends(ckpt.architecture),
        "tp_degrees": degrees,
        "max_tp_degree": max(degrees),
    }
