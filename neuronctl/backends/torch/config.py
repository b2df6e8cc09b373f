"""The model a checkpoint's config.json describes, as the torch backend runs it.

`ModelArgs` is every shape and option the graphs depend on, read from a config.json in its
old and new transformers spellings; what this backend cannot compute exactly is refused here,
before any tensor is read. `Numerics` is how an artifact stores and computes. Neither needs
torch at run time: validate and the build's checks read them without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from neuronctl.errors import CheckpointError, SpecError
from neuronctl.families import BY_ARCHITECTURE, ModelFamily, architectures

if TYPE_CHECKING:
    import torch

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict[str, Any]  # rope_type, rope_theta and the type's own parameters
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    max_position_embeddings: int | None
    sliding_window: int | None  # the window that applies to some layer, None when none does

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class Numerics:
    """How an artifact stores its weights and computes with them.

    `storage` is the artifact's dtype (weights, KV cache). `compute` is the activations' and
    the matmuls' dtype: the storage dtype where the CPU has units for it, float32 where it
    does not (bf16 on an AVX2 host: weights stay bf16 in memory and are widened inside each
    kernel or matmul, as llama.cpp does). `quantized` artifacts hold every projection and the
    LM head as int8 with one bf16 scale per output channel (`<name>_scale`).
    """

    storage: torch.dtype
    compute: torch.dtype
    quantized: bool = False


def args_from_config(config: Mapping[str, Any]) -> ModelArgs:
    """Read a config.json (old and new transformers spellings); refuse what we cannot run."""
    archs = config.get("architectures") or []
    arch = archs[0] if archs else None
    family = BY_ARCHITECTURE.get(str(arch))
    if family is None or "torch" not in family.builds:
        raise CheckpointError(
            f"architecture {arch!r} is not supported by the torch backend",
            "supported: " + ", ".join(architectures("torch")),
        )
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"hidden_act {act!r} is not supported", "only silu is")
    if config.get("mlp_bias"):
        raise CheckpointError("mlp_bias is not supported by the torch backend")
    heads = int(config["num_attention_heads"])
    attention_bias = bool(config.get("attention_bias", False))
    return ModelArgs(
        architecture=family.architecture,
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope=rope_parameters(config),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        # A qkv_bias family (Qwen2) always has q/k/v biases; Llama's attention_bias adds
        # them to q/k/v and o.
        qkv_bias=family.qkv_bias or attention_bias,
        o_bias=not family.qkv_bias and attention_bias,
        max_position_embeddings=config.get("max_position_embeddings"),
        sliding_window=_sliding_window(family, config),
    )


def rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """transformers 5 keeps rope in `rope_parameters`; older configs in rope_theta+rope_scaling."""
    params = dict(config.get("rope_parameters") or {})
    if not params or "rope_theta" not in params:
        params.update(config.get("rope_scaling") or {})
        params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.pop("type", None) or params.get("rope_type") or "default"
    params["rope_type"] = rope_type
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(
            f"rope type {rope_type!r} is not supported by the torch backend",
            "supported: " + ", ".join(ROPE_TYPES),
        )
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointError("partial_rotary_factor != 1 is not supported")
    return params


def _sliding_window(family: ModelFamily, config: Mapping[str, Any]) -> int | None:
    window = config.get("sliding_window")
    if not window:
        return None
    if family.windowed:
        return int(window)
    layer_types = config.get("layer_types") or []
    if "sliding_attention" in layer_types:
        return int(window)
    if config.get("use_sliding_window") and not layer_types:
        # Older Qwen2 configs: layers from max_window_layers on use the window.
        if int(config.get("max_window_layers", 0)) < int(config["num_hidden_layers"]):
            return int(window)
    return None


def check_args(args: ModelArgs, seq_len: int) -> None:
    """Refuse shapes this modeling code would not compute exactly."""
    if args.num_heads % args.num_kv_heads:
        raise CheckpointError(
            f"{args.num_heads} attention heads are not a multiple of {args.num_kv_heads} KV heads"
        )
    if args.sliding_window is not None and args.sliding_window < seq_len:
        raise SpecError(
            "seq_len",
            f"the model uses a sliding window of {args.sliding_window} tokens, shorter than "
            f"seq_len {seq_len}; the torch backend attends over the full context",
            f"use --seq-len {args.sliding_window} or less",
        )
