"""The Transformers NeuronX arguments a finalized BuildSpec compiles to. Pure: no SDK import.

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
SUB_CONFIGS = ("continuous_batching", "quant", "on_device_generation")
# vLLM's Transformers NeuronX integration supports these (seeds 001, 003).
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
    cb = spec.override_neuron_config.get("continuous_batching") or {}
    for key in ("block_size", "max_model_len"):
        if key in cb and cb[key] != spec.seq_len:
            raise SpecError(
                f"override_neuron_config.continuous_batching.{key}",
                f"{cb[key]} differs from seq_len {spec.seq_len}",
                "TNx requires block_size == max_model_len == seq_len (drop the key)",
            )
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


def neuron_config_kwargs(spec: BuildSpec) -> dict[str, Any]:
    """NeuronConfig kwargs with sub-configs as dicts; override_neuron_config merged last
    (one level deep for the sub-configs)."""
    kwargs: dict[str, Any] = {
        "continuous_batching": {"max_num_seqs": spec.batch_size, "max_model_len": spec.seq_len},
        # Required by save(sharded_weights=True) (NEURON_FACTS).
        "on_device_embedding": True,
    }
    if spec.quantized:
        kwargs["quant"] = {
            "quant_dtype": QUANT_DTYPE[spec.quantization_dtype],
            "dequant_dtype": AMP[spec.dtype],
            "quantize_method": spec.quantization_type,  # vocabulary not confirmed
        }
    if spec.on_device_sampling:
        s = spec.on_device_sampling
        kwargs["on_device_generation"] = {
            "max_length": spec.seq_len,
            "do_sample": s.do_sample,
            "top_k": s.top_k,
            "top_p": s.top_p,
            "temperature": s.temperature,
            "global_top_k": s.global_topk,
            "dynamic": s.dynamic,
            "deterministic": s.deterministic,
        }
    for key, value in spec.override_neuron_config.items():
        if key in SUB_CONFIGS and isinstance(value, dict):
            kwargs[key] = {**kwargs.get(key, {}), **value}
        else:
            kwargs[key] = value
    return kwargs


def vllm_override(spec: BuildSpec) -> dict[str, Any]:
    """What vLLM's --override-neuron-config gets for tnx: the plain keys only. vLLM builds the
    sub-configs itself from its own arguments (max_num_seqs, NEURON_QUANT_DTYPE, sampling), and
    a dict in their place would replace its config objects."""
    return {k: v for k, v in neuron_config_kwargs(spec).items() if k not in SUB_CONFIGS}
