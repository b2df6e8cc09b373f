"""STAND-IN: NxD Inference's NeuronConfig / InferenceConfig (tests only).

Rejects what the real classes of neuronx-distributed-inference 0.5 (SDK 2.25,
models/config.py) reject and keeps their types: torch_dtype becomes a torch.dtype,
on_device_sampling_config an OnDeviceSamplingConfig, unknown keys only log a warning and are
not set. Serialized like the real to_json_string (dtypes as their names, nested objects as
dicts) and rebuilt through the same classes on load.
"""

import inspect
import json
import logging
from pathlib import Path
from typing import Any

import torch
from standin_recorder import record

# The keys the real NeuronConfig.__init__ pops at SDK 2.25 (models/config.py).
KNOWN = frozenset({
    "activation_quantization_type", "allow_input_truncation", "apply_seq_ids_mask", "async_mode",
    "attention_dp_degree", "attention_dtype", "attn_block_cte_nki_kernel_enabled",
    "attn_block_tkg_nki_kernel_cache_update", "attn_block_tkg_nki_kernel_enabled", "attn_cls",
    "attn_kernel_enabled", "attn_tkg_builtin_kernel_enabled", "attn_tkg_nki_kernel_enabled",
    "batch_size", "bucket_n_active_tokens", "buckets", "cast_type", "cc_pipeline_tiling_factor",
    "chunked_prefill_config", "context_encoding_buckets", "cp_degree", "ctx_batch_size",
    "disable_kv_cache_tiling", "draft_model_modules_to_not_convert", "enable_bucketing",
    "enable_eagle_draft_input_norm", "enable_eagle_speculation", "enable_fused_speculation",
    "enable_output_completion_notifications", "enable_spill_reload_dge", "ep_degree",
    "expert_mlp_nki_kernel_enabled", "flash_decoding_enabled", "fused_qkv",
    "fused_rmsnorm_skip_gamma", "is_block_kv_layout", "is_continuous_batching", "is_eagle_draft",
    "is_medusa", "is_prefix_caching", "k_cache_transposed", "kv_cache_batch_size",
    "kv_cache_padding_size", "kv_cache_quant", "layer_boundary_markers", "lm_head_pad",
    "lm_head_pad_alignment_size", "local_ranks_size", "logical_nc_config", "logical_neuron_cores",
    "lora_config", "max_batch_size", "max_context_length", "max_length", "max_new_tokens",
    "medusa_speculation_length", "medusa_tree", "mlp_kernel_enabled",
    "mlp_kernel_fuse_residual_add", "modules_to_not_convert", "moe_fused_nki_kernel_enabled",
    "n_active_tokens", "n_positions", "num_medusa_heads", "on_cpu", "on_device_sampling_config",
    "output_logits", "overrides_torch_dtype", "pa_block_size", "pa_num_blocks", "padding_side",
    "pp_degree", "prefix_buckets", "qk_layernorm", "qkv_kernel_enabled",
    "qkv_kernel_fuse_residual_add", "qkv_kernel_nbsd_layout", "quantization_dtype",
    "quantization_type", "quantize_clamp_bound", "quantized", "quantized_checkpoints_path",
    "quantized_mlp_kernel_enabled", "rmsnorm_quantize_kernel_enabled",
    "router_topk_nki_kernel_enabled", "rpl_reduce_dtype", "save_sharded_checkpoint",
    "scratchpad_page_size", "seq_len", "seq_len_threshold_for_cc_tiling",
    "sequence_parallel_enabled", "shared_mlp_nki_kernel_enabled", "skip_sharding", "skip_vision",
    "skip_warmup", "spec_batch_size", "speculation_length", "start_rank_id", "target",
    "tkg_batch_size", "token_generation_buckets", "token_tree_config", "torch_dtype", "tp_degree",
    "vocab_parallel", "weight_gather_seq_len_threshold", "world_size"
})

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# neuronx_distributed QuantizedDtype members from SDK 2.27 on (F8E4M3FN is new there), the
# SDK of the vllm-neuron releases neuronctl serves. The real NeuronConfig asks neuronx_distributed
# (QuantizedDtype.has_dtype), so where one is importable the stand-in asks it too.
QUANTIZED_DTYPES = ("INT8", "F8E4M3", "F8E4M3FN", "F8E5M2")


def valid_quantized_dtype(name: str) -> bool:
    try:
        from neuronx_distributed.quantization.quantization_config import QuantizedDtype
    except ImportError:
        return name.upper() in QUANTIZED_DTYPES
    try:
        QuantizedDtype.has_dtype(name)
    except AssertionError:
        return False
    return True


def to_torch_dtype(name: str) -> torch.dtype:
    assert name in DTYPES, f"Unsupported dtype: {name}"
    return DTYPES[name]


class OnDeviceSamplingConfig:
    def __init__(self, **kwargs: Any) -> None:
        self.do_sample = kwargs.pop("do_sample", False)
        self.top_k = kwargs.pop("top_k", 1)
        self.top_p = kwargs.pop("top_p", 1.0)
        self.temperature = kwargs.pop("temperature", 1.0)
        self.dynamic = kwargs.pop("dynamic", False)
        self.deterministic = kwargs.pop("deterministic", False)
        self.global_topk = kwargs.pop("global_topk", 256)
        self.on_device_sampling_config = kwargs.pop("on_device_sampling_config", True)
        self.top_k_kernel_enabled = kwargs.pop("top_k_kernel_enabled", False)


class NeuronConfig:
    def __init__(self, **kwargs: Any) -> None:
        record(type(self).__name__, dict(kwargs))
        kwargs = dict(kwargs)
        unknown = {k: kwargs.pop(k) for k in list(kwargs) if k not in KNOWN}
        self.batch_size = kwargs.pop("batch_size", 1)
        self.seq_len = kwargs.pop("seq_len", 128)
        self.tp_degree = kwargs.pop("tp_degree", 1)
        dtype = kwargs.pop("torch_dtype", torch.bfloat16)
        self.torch_dtype = to_torch_dtype(dtype) if isinstance(dtype, str) else dtype
        self.max_context_length = kwargs.pop("max_context_length", self.seq_len)
        self.max_length = kwargs.pop("max_length", self.seq_len)
        assert self.max_context_length <= self.max_length, (
            "max_context_length cannot be more than max_length"
        )
        self.ctx_batch_size = kwargs.pop("ctx_batch_size", self.batch_size)
        self.tkg_batch_size = kwargs.pop("tkg_batch_size", self.batch_size)
        self.max_batch_size = kwargs.pop("max_batch_size", self.batch_size)
        self.is_continuous_batching = kwargs.pop("is_continuous_batching", False)
        sampling = kwargs.pop("on_device_sampling_config", None)
        if type(sampling) is dict:
            sampling = OnDeviceSamplingConfig(**sampling)
        self.on_device_sampling_config = sampling
        self.enable_bucketing = kwargs.pop("enable_bucketing", False)
        self.buckets = kwargs.pop("buckets", [self.seq_len])
        self.context_encoding_buckets = kwargs.pop("context_encoding_buckets", None)
        self.token_generation_buckets = kwargs.pop("token_generation_buckets", None)
        if self.context_encoding_buckets is not None:
            self.context_encoding_buckets.sort()
            assert self.context_encoding_buckets[-1] <= self.max_context_length, "context bucket"
        if self.token_generation_buckets is not None:
            self.token_generation_buckets.sort()
            assert self.token_generation_buckets[-1] <= self.max_length, "token bucket"
        self.padding_side = kwargs.pop("padding_side", "right")
        self.save_sharded_checkpoint = kwargs.pop("save_sharded_checkpoint", False)
        self.quantized = kwargs.pop("quantized", False)
        self.quantized_checkpoints_path = kwargs.pop("quantized_checkpoints_path", None)
        if self.quantized is True:
            assert self.quantized_checkpoints_path is not None, (
                "quantized_checkpoints_path is required"
            )
        self.quantization_type = kwargs.pop("quantization_type", "per_tensor_symmetric")
        self.quantization_dtype = kwargs.pop("quantization_dtype", "int8")
        self.speculation_length = kwargs.pop("speculation_length", 0)
        self.enable_fused_speculation = kwargs.pop("enable_fused_speculation", False)
        self.attention_dp_degree = kwargs.pop("attention_dp_degree", 1)
        self.__dict__.update(kwargs)  # the other real keys, as given
        if self.tp_degree % self.attention_dp_degree != 0:
            raise ValueError("TP Degree must be evenly divisible by DP Degree")
        if unknown:
            logging.warning(f"NeuronConfig init: Unexpected keyword arguments: {unknown}")
        if self.quantized:
            assert valid_quantized_dtype(self.quantization_dtype), (
                f"{self.quantization_dtype} is not a valid QuantizedDtype."
            )


class MoENeuronConfig(NeuronConfig):
    pass


def to_dict(obj: Any) -> Any:
    """The real models/config.py to_dict: classes by name, dtypes by name, objects as dicts."""
    if type(obj) is dict:
        return {k: to_dict(v) for k, v in obj.items()}
    if type(obj) is list:
        return [to_dict(v) for v in obj]
    if inspect.isclass(obj):
        return {"__module__": obj.__module__, "__name__": obj.__name__}
    if hasattr(obj, "__dict__"):
        return {k: to_dict(v) for k, v in obj.__dict__.items()}
    if type(obj) is torch.dtype:
        return str(obj).split(".")[1]
    return obj


class InferenceConfig:
    def __init__(self, neuron_config: NeuronConfig, fused_spec_config: Any = None,
                 load_config: Any = None, metadata: Any = None, **kwargs: Any) -> None:
        self.neuron_config = neuron_config
        self.fused_spec_config = fused_spec_config
        if load_config is not None:
            load_config(self)
        self.metadata = metadata
        for key, value in kwargs.items():
            setattr(self, key, value)

    @classmethod
    def get_neuron_config_cls(cls) -> type:
        return NeuronConfig

    def to_json_string(self) -> str:
        return json.dumps(to_dict(self), indent=2, sort_keys=True)

    def save(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "neuron_config.json").write_text(self.to_json_string() + "\n")

    @classmethod
    def load(cls, path: str) -> "InferenceConfig":
        data = json.loads((Path(path) / "neuron_config.json").read_text())  # FileNotFoundError
        data["neuron_config"] = cls.get_neuron_config_cls()(**data["neuron_config"])
        data.pop("fused_spec_config", None)  # the real rebuilds it by importing worker_cls
        return cls(**data)


class FusedSpecNeuronConfig:
    def __init__(self, worker_cls: Any, draft_config: Any = None,
                 draft_model_path: Any = None) -> None:
        record("FusedSpecNeuronConfig", {"draft_model_path": draft_model_path})
        self.worker_cls = worker_cls
        self.draft_config = draft_config
        self.draft_model_path = draft_model_path
