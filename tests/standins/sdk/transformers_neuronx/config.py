"""STAND-IN for transformers_neuronx.config (tests only).

Keyword-only configs that accept exactly the keys of the real ones (transformers-neuronx,
Dec 2024 public sync, config.py) and reject what they reject, with the same exception types:
QuantizationConfig only vector_dynamic / direct_cast and s8 / f8e4m3fn (NotImplementedError),
ContinuousBatchingConfig needs max_num_seqs (KeyError) and asserts on any other key (no
block_size), GenerationConfig is keyword-only (global_top_k, not global_topk), NeuronConfig
asserts on unknown keys, padding_side and cast_logits_dtype. to_json() as the real one.
"""

import enum
import warnings
from typing import Any

from standin_recorder import record

# The real NeuronConfig.__init__ keyword-only parameters and their defaults.
DEFAULTS: dict[str, Any] = {
    "sparse_attn": None, "quant": None, "kv_cache_quant": None, "continuous_batching": None,
    "attention_layout": "HSB", "collectives_layout": "HSB", "cache_layout": "SBH",
    "padding_side": "left", "group_query_attention": None, "sequence_parallel_norm": False,
    "sequence_parallel_norm_threshold": 2048, "bf16_rms_norm": False,
    "on_device_embedding": False, "on_device_generation": None, "all_reduce_dtype": None,
    "cast_logits_dtype": "float32", "fuse_qkv": False, "qkv_tiling": False,
    "weight_tiling": False, "mlp_in_weight_tiling_permute_order": [1, 2, 0, 3],
    "mlp_out_weight_tiling_permute_order": [1, 2, 0, 3], "log_softmax_scores": False,
    "shard_over_sequence": False, "output_all_logits": False, "attn_output_transposed": False,
    "fused_rmsnorm_qkv": False, "fused_rmsnorm_mlp": False, "mlp_out_weight_transpose": False,
    "fuse_mlp": False, "is_eagle_target": False, "is_eagle_draft": False,
    "has_pre_attention_norm": True, "compilation_worker_count": None,
    "duplicate_q_weight_sos": False,
}
KNOWN = frozenset(DEFAULTS)
DEPRECATED = ("use_2d_cache_ids", "lhs_aligned")  # popped from **kwargs, with a warning
VALID_DTYPES = ("float32", "float16", "bfloat16")


class QuantizationConfig:
    def __init__(self, quant_dtype: str = "s8", dequant_dtype: str = "f16",
                 quantize_method: str = "vector_dynamic", quantize_attn: bool = True,
                 no_quantize_list: Any = None) -> None:
        record("QuantizationConfig", {"quant_dtype": quant_dtype, "dequant_dtype": dequant_dtype,
                                      "quantize_method": quantize_method})
        if quant_dtype not in ("s8", "f8e4m3fn"):
            raise NotImplementedError(f"{quant_dtype} is not implemented.")
        if quantize_method not in ("vector_dynamic", "direct_cast"):
            raise NotImplementedError(f"{quantize_method} is not implemented.")
        self.quant_dtype = quant_dtype
        self.dequant_dtype = dequant_dtype
        self.quantize_method = quantize_method
        self.quantize_attn = quantize_attn
        self.no_quantize_list = list(no_quantize_list or [])


class KVCacheQuantizationConfig:
    def __init__(self, quant_dtype: str = "s8", dequant_dtype: str = "bf16",
                 quantize_method: str = "direct_cast") -> None:
        if quant_dtype not in ("s8", "f16", "bf16", "f8e4m3fn"):
            raise NotImplementedError(f"{quant_dtype} is not implemented.")
        if quantize_method != "direct_cast":
            raise NotImplementedError(f"{quantize_method} is not implemented.")
        self.quant_dtype = quant_dtype
        self.dequant_dtype = dequant_dtype
        self.quantize_method = quantize_method


def _pop_set(kwargs: dict[str, Any], key: str, default: Any) -> Any:
    return kwargs.pop(key) if kwargs.get(key) is not None else default


class ContinuousBatchingConfig:
    def __init__(self, **kwargs: Any) -> None:
        record("ContinuousBatchingConfig", dict(kwargs))
        if kwargs.get("max_num_seqs") is not None:
            self.max_num_seqs = kwargs.pop("max_num_seqs")
        else:
            self.max_num_seqs = kwargs.pop("batch_size_for_shared_caches")  # KeyError
        # As the real one: a key given as None is not popped, so it trips the assert below.
        self.max_model_len = _pop_set(kwargs, "max_model_len", None)
        self.optimized_paged_attention = _pop_set(kwargs, "optimized_paged_attention", False)
        self.enable_chunked_prefill = _pop_set(kwargs, "enable_chunked_prefill", False)
        if self.enable_chunked_prefill:
            assert self.optimized_paged_attention, "chunked prefill needs optimized paged attention"
        self.block_size = None  # set by init_cache_engine, never by the constructor
        self.num_blocks = None
        assert len(kwargs) == 0, f"unexpected key word arguments: {kwargs.keys()}"

    @property
    def batch_size_for_shared_caches(self) -> int:
        return self.max_num_seqs


class GenerationConfig:
    def __init__(self, *, max_length: Any = None, do_sample: bool = False, top_k: Any = 50,
                 top_p: Any = 1.0, top_p_min_tokens: int = 1, global_top_k: Any = None,
                 eos_token_id: Any = None, temperature: Any = 1.0, dynamic: bool = False,
                 deterministic: bool = False, per_batch_line: bool = False) -> None:
        record("GenerationConfig", {"dynamic": dynamic, "per_batch_line": per_batch_line})
        self.max_length = max_length
        self.do_sample = do_sample
        self.per_batch_line = per_batch_line
        self.top_k = top_k
        self.top_p = [float(p) for p in top_p] if isinstance(top_p, list) else float(top_p)
        self.temperature = ([float(t) for t in temperature] if isinstance(temperature, list)
                            else float(temperature))
        self.top_p_min_tokens = top_p_min_tokens
        self.global_top_k = global_top_k
        self.eos_token_id = eos_token_id
        self.dynamic = dynamic
        self.deterministic = deterministic

    def __eq__(self, value: object) -> bool:
        return isinstance(value, GenerationConfig) and self.__dict__ == value.__dict__


class NeuronConfig:
    def __init__(self, **kwargs: Any) -> None:
        record("NeuronConfig", dict(kwargs))
        for name in DEPRECATED:
            if name in kwargs:
                warnings.warn(f"NeuronConfig `{name}` argument is deprecated.", stacklevel=2)
                kwargs.pop(name)
        unknown = {k: v for k, v in kwargs.items() if k not in KNOWN}
        assert not unknown, f"Unexpected NeuronConfig keyword arguments: {unknown}"
        self.__dict__.update({**DEFAULTS, **kwargs})
        assert self.cast_logits_dtype in VALID_DTYPES, "cast_logits_dtype"
        assert self.padding_side in ("left", "right"), "padding_side must be left or right"
        if self.continuous_batching:
            self.padding_side = "right"
        assert self.sequence_parallel_norm_threshold > 0
        if self.qkv_tiling:
            assert self.fuse_qkv, "QKV weight tiling needs fuse_qkv"

    def to_json(self) -> Any:
        """As the real to_json: enums by value, objects by their __dict__."""

        def convert(obj: Any) -> Any:
            if obj is None or isinstance(obj, str | int | float | bool):
                return obj
            if isinstance(obj, enum.Enum):
                return obj.value
            if isinstance(obj, list):
                return [convert(e) for e in obj]
            if isinstance(obj, dict):
                return {convert(k): convert(v) for k, v in obj.items()}
            return convert(obj.__dict__)

        return convert(self)
