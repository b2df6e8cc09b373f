"""The Transformers NeuronX arguments a finalized BuildSpec compiles to. Pure: no SDK import.

vLLM's TNx path never calls TNx `load(dir)`: it compiles again and finds the NEFFs only
through the persistent compile cache, keyed on the HLO. So the NeuronConfig compiled here is
the one vLLM's TNx loader builds for the same flags (vllm/model_executor/model_loader/neuron.py
`_get_default_neuron_config`, the same in the 0.6.x-neuron, 0.7.2 and 0.9 trees): BSH attention
and collectives layouts, fused QKV, `ContinuousBatchingConfig(batch_size_for_shared_caches=
max_num_seqs)` (max_model_len stays None), vector_dynamic quantization with weight tiling, and
the on-device generation config its model runner builds (`_init_neuron_sampling`) unless
NEURON_ON_DEVICE_SAMPLING_DISABLED=1, which the launcher sets for artifacts without it.

`from_pretrained` takes the shape arguments (batch_size, tp_degree, n_positions,
context_length_estimate, amp) and a keyword-only NeuronConfig whose sub-configs are written
here as nested dicts (continuous_batching, quant, on_device_generation) and turned into
ContinuousBatchingConfig / QuantizationConfig / GenerationConfig by the backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from neuronctl.errors import SpecError
from neuronctl.spec import BuildSpec

AMP = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
QUANT_DTYPE = {"int8": "s8", "f8e4m3": "f8e4m3fn"}  # spec (NxDI) name -> TNx quant_dtype
# The only method vLLM's TNx path builds (neuron_quant.py); TNx itself knows only
# vector_dynamic and direct_cast (config.py QuantizationConfig, NotImplementedError otherwise).
QUANTIZE_METHOD = "vector_dynamic"
# vLLM's neuron_model_runner._MAX_NEURON_SAMPLING_TOP_K: the compiled global top-k.
MAX_TOP_K = 256
# Sub-config dicts an override merges into, key by key, instead of replacing.
MERGED_CONFIGS = ("continuous_batching", "quant", "on_device_generation")
# ContinuousBatchingConfig asserts on any other key; block_size / num_blocks are set later by
# vLLM through init_cache_engine, never passed to the constructor.
CB_KEYS = ("max_num_seqs", "batch_size_for_shared_caches", "max_model_len",
           "optimized_paged_attention", "enable_chunked_prefill")
CB_SET_BY_VLLM = ("block_size", "num_blocks")
# vLLM's Transformers NeuronX integration supports these (the TNx
# continuous-batching guide for vLLM 0.5.0 and 0.6.2; v0.6.x-neuron model_loader/neuron.py:36-39).
MODEL_TYPES = {"llama": "LlamaForSampling", "mistral": "MistralForSampling"}


def check(spec: BuildSpec, config: Mapping[str, Any]) -> None:
    """What TNx (and vLLM over it) cannot build or load exactly."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise SpecError(
            "backend",
            f"the tnx backend supports {', '.join(MODEL_TYPES)}, not {model_type!r}",
            "use --backend nxdi",
        )
    token_gen = list(spec.token_gen_buckets)  # type: ignore[arg-type]
    if token_gen[-1] != spec.seq_len:
        raise SpecError(
            "token_gen_buckets",
            f"the last bucket {token_gen[-1]} must equal seq_len {spec.seq_len} for tnx",
            "TNx continuous batching sizes every KV block to max_model_len",
        )
    check_continuous_batching(spec)
    check_sampling(spec)
    if "--cache_dir" in spec.cc_flags:
        raise SpecError(
            "cc_flags",
            "--cache_dir would send the compiled NEFFs outside the artifact",
            "drop --cache_dir; neuronctl keeps the compile cache inside the artifact",
        )


def from_pretrained_kwargs(spec: BuildSpec) -> dict[str, Any]:
    return {
        "batch_size": spec.batch_size,
        "tp_degree": spec.tp_degree,
        "n_positions": list(spec.token_gen_buckets),  # type: ignore[arg-type]
        "context_length_estimate": list(spec.context_buckets),  # type: ignore[arg-type]
        "amp": AMP[spec.dtype],
    }


def check_continuous_batching(spec: BuildSpec) -> None:
    cb = spec.override_neuron_config.get("continuous_batching") or {}
    if not isinstance(cb, Mapping):
        return
    unknown = sorted(set(cb) - set(CB_KEYS) - set(CB_SET_BY_VLLM))
    if unknown:
        raise SpecError(
            f"override_neuron_config.continuous_batching.{unknown[0]}",
            "is not a ContinuousBatchingConfig key (TNx asserts on it)",
            "known: " + ", ".join(CB_KEYS),
        )
    expected = {"block_size": spec.seq_len, "max_model_len": spec.seq_len,
                "max_num_seqs": spec.batch_size, "batch_size_for_shared_caches": spec.batch_size}
    for key, want in expected.items():
        if key in cb and cb[key] != want:
            raise SpecError(
                f"override_neuron_config.continuous_batching.{key}",
                f"{cb[key]} differs from {want}",
                "TNx continuous batching uses max_num_seqs == batch_size and block_size == "
                "max_model_len == seq_len; drop the key",
            )


def check_sampling(spec: BuildSpec) -> None:
    """On-device generation compiles into the graph; vLLM's runner builds it one way only."""
    s = spec.on_device_sampling
    if s is None:
        return
    if not s.dynamic or s.global_topk != MAX_TOP_K or s.top_k > MAX_TOP_K:
        raise SpecError(
            "on_device_sampling",
            "tnx compiles on-device sampling only as vLLM's TNx path does: dynamic, per batch "
            f"line, global_topk {MAX_TOP_K} (top_k up to {MAX_TOP_K})",
            f'use {{"dynamic": true, "global_topk": {MAX_TOP_K}, ...}} or leave it off',
        )


def vllm_generation_config(spec: BuildSpec) -> dict[str, Any]:
    """vLLM's neuron_model_runner._init_neuron_sampling, value for value: the compiled one."""
    n = spec.batch_size
    return {
        "max_length": spec.seq_len,
        "do_sample": True,
        "per_batch_line": True,
        "top_k": [MAX_TOP_K] * n,
        "top_p": [1.0] * n,
        "temperature": [1.0] * n,
        "dynamic": True,
        "global_top_k": MAX_TOP_K,
    }


def runtime_generation_config(spec: BuildSpec) -> dict[str, Any]:
    """The spec's sampling values for every batch line, set after load with
    update_generation_config (what vLLM's runner does per request); greedy is top_k 1."""
    s = spec.on_device_sampling
    assert s is not None
    n = spec.batch_size
    top_k = s.top_k if s.do_sample else 1
    return {
        **vllm_generation_config(spec),
        "top_k": [top_k] * n,
        "top_p": [s.top_p] * n,
        "temperature": [s.temperature] * n,
    }


def neuron_config_kwargs(spec: BuildSpec) -> dict[str, Any]:
    """NeuronConfig kwargs with sub-configs as dicts, as vLLM's TNx loader builds them for the
    same flags; override_neuron_config merged last (one level deep for the sub-configs)."""
    kwargs: dict[str, Any] = {
        "continuous_batching": {"max_num_seqs": spec.batch_size},
        "attention_layout": "BSH",
        "collectives_layout": "BSH",
        "fuse_qkv": True,
        # Required by save(sharded_weights=True); vLLM gets it through the override.
        "on_device_embedding": True,
    }
    if spec.quantized:
        kwargs["quant"] = {
            "quant_dtype": QUANT_DTYPE[spec.quantization_dtype],
            "dequant_dtype": AMP[spec.dtype],
            "quantize_method": QUANTIZE_METHOD,
        }
        kwargs["weight_tiling"] = True
    if spec.on_device_sampling:
        kwargs["on_device_generation"] = vllm_generation_config(spec)
    for key, value in spec.override_neuron_config.items():
        if key in MERGED_CONFIGS and isinstance(value, dict):
            kwargs[key] = {**kwargs.get(key, {}), **value}
        else:
            kwargs[key] = value
    cb = kwargs["continuous_batching"]
    if isinstance(cb, dict):
        if "batch_size_for_shared_caches" in cb:  # TNx's alias of max_num_seqs
            cb["max_num_seqs"] = cb.pop("batch_size_for_shared_caches")
        for key in CB_SET_BY_VLLM:  # checked equal to seq_len: what vLLM sets anyway
            cb.pop(key, None)
    return kwargs


def vllm_defaults(spec: BuildSpec) -> dict[str, Any]:
    """The plain keys vLLM's TNx loader sets itself for the same flags (_get_default_neuron_config;
    weight_tiling follows --quantization)."""
    return {"attention_layout": "BSH", "collectives_layout": "BSH", "fuse_qkv": True,
            "weight_tiling": spec.quantized}


def vllm_override(spec: BuildSpec) -> dict[str, Any]:
    """What vLLM's --override-neuron-config gets for tnx: the plain keys vLLM does not already
    set to the same value, and a sub-config only where the spec overrides it. vLLM builds the
    sub-configs itself from its own arguments (max_num_seqs, --quantization neuron_quant +
    NEURON_QUANT_DTYPE, its sampling config) to the same values as neuron_config_kwargs; a dict
    in the override replaces its object."""
    kwargs = neuron_config_kwargs(spec)
    defaults = vllm_defaults(spec)
    overridden = {k for k in spec.override_neuron_config if k in MERGED_CONFIGS}
    return {
        k: v for k, v in kwargs.items()
        if (k not in MERGED_CONFIGS or k in overridden) and not (k in defaults and defaults[k] == v)
    }
