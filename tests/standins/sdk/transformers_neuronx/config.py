"""STAND-IN for transformers_neuronx.config: keyword-only configs that reject unknown keys."""

from typing import Any

from standin_recorder import record

KNOWN = {
    "continuous_batching", "on_device_embedding", "quant", "on_device_generation",
    "sparse_attn", "kv_cache_quant", "attention_layout", "collectives_layout", "cache_layout",
    "padding_side", "group_query_attention", "sequence_parallel_norm", "bf16_rms_norm",
    "all_reduce_dtype", "cast_logits_dtype", "fuse_qkv", "shard_over_sequence",
    "fused_rmsnorm_qkv", "fused_rmsnorm_mlp", "weight_tiling", "output_all_logits",
}


class _Config:
    def __init__(self, **kwargs: Any) -> None:
        record(type(self).__name__, dict(kwargs))
        self.kwargs = kwargs

    def as_dict(self) -> dict[str, Any]:
        return {k: v.as_dict() if isinstance(v, _Config) else v for k, v in self.kwargs.items()}


class NeuronConfig(_Config):
    def __init__(self, **kwargs: Any) -> None:
        unknown = set(kwargs) - KNOWN
        if unknown:
            raise TypeError(f"NeuronConfig got unexpected keyword arguments {sorted(unknown)}")
        super().__init__(**kwargs)


class ContinuousBatchingConfig(_Config):
    pass


class QuantizationConfig(_Config):
    pass


class GenerationConfig(_Config):
    pass
