"""Transformers NeuronX `override_neuron_config` -> NxD Inference, per the AWS migration guide.

The table below is seed 004_f2dcb61da4ce5066.txt ("Neuron Config Migration"), row by row:
TNx parameter (dotted for sub-configs), NxD Inference parameter (None = no equivalent, the
key is dropped and reported with the note), and the guide's note. Values are translated where
the two libraries spell them differently (TNx amp names 'bf16' -> NxDI dtype 'bfloat16',
quant dtype 's8' -> 'int8'); the notes that ask for a companion setting are applied
(quantized, kv_cache_quant, is_continuous_batching + tkg_batch_size).
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from neuronctl.errors import UsageError

# (tnx key, nxdi key or None, note) -- transcribed from seed 004, in its order.
TABLE: list[tuple[str, str | None, str]] = [
    ("sparse_attn", None, ""),
    ("quant.quant_dtype", "quantization_dtype",
     "To use quantization, set quantized to True, and provide the quantized_checkpoints_path "
     "where the quantized model is stored (or will be stored)."),
    ("quant.dequant_dtype", "torch_dtype",
     "NxD Inference uses the inference dtype as the dequant dtype."),
    ("quant.quantize_method", "quantization_type", ""),
    ("quant.quantize_attn", None, ""),
    ("quant.no_quantize_list", None, ""),
    ("kv_cache_quant.quant_dtype", None,
     "NxD Inference uses FP8 (torch.float8_e4m3fn) for KV cache quantization. To use KV cache "
     "quantization, set kv_cache_quant to True."),
    ("kv_cache_quant.dequant_dtype", "torch_dtype",
     "NxD Inference uses the inference dtype as the dequant dtype."),
    ("kv_cache_quant.quantize_method", None, "NxD Inference uses direct cast."),
    ("continuous_batching.max_num_seqs", "max_batch_size",
     "To use continuous batching, set is_continous_batching to True, and set tkg_batch_size to "
     "the max batch size."),
    ("continuous_batching.max_model_len", "seq_len", ""),
    ("continuous_batching.optimized_paged_attention", None, ""),
    ("continuous_batching.block_size", None, ""),
    ("continuous_batching.num_blocks", None, ""),
    ("attention_layout", None, "NxD Inference uses BHSD layout."),
    ("collectives_layout", None, "NxD Inference uses BHSD layout."),
    ("cache_layout", None, "NxD Inference uses BHSD layout."),
    ("padding_side", "padding_side", "NxD Inference defaults to padding on the right side."),
    ("group_query_attention", None, ""),
    ("sequence_parallel_norm", "sequence_parallel_enabled", ""),
    ("sequence_parallel_norm_threshold", None, ""),
    ("bf16_rms_norm", None, "NxD Inference upcasts RMS norm inputs to fp32."),
    ("on_device_embedding", None, ""),
    ("on_device_generation", "on_device_sampling_config", ""),
    ("on_device_generation.max_length", "seq_len",
     "NxD Inference uses the model's sequence length."),
    ("on_device_generation.do_sample", "on_device_sampling_config.do_sample", ""),
    ("on_device_generation.top_k", "on_device_sampling_config.top_k",
     "NxD Inference supports top_k through dynamic sampling. Pass the top_k values to the model "
     "inputs."),
    ("on_device_generation.top_p", None,
     "NxD Inference supports top_p through dynamic sampling. Pass the top_p values to the model "
     "inputs."),
    ("on_device_generation.temperature", None,
     "NxD Inference supports temperature through dynamic sampling. Pass the temperature values "
     "to the model inputs."),
    ("on_device_generation.top_p_min_tokens", None,
     "NxD Inference defaults to a minimum of 1 token."),
    ("on_device_generation.global_top_k", "on_device_sampling_config.global_topk", ""),
    ("on_device_generation.eos_token_id", None,
     "NxD Inference sampling treats EOS like any other token."),
    ("on_device_generation.dynamic", "on_device_sampling_config.dynamic", ""),
    ("on_device_generation.deterministic", "on_device_sampling_config.deterministic", ""),
    ("on_device_generation.per_batch_line", None, ""),
    ("all_reduce_dtype", "rpl_reduce_dtype",
     "NxD Inference applies this dtype to only the all_reduce in attention's o_proj layer."),
    ("cast_logits_dtype", None, ""),
    ("fuse_qkv", "fused_qkv", ""),
    ("qkv_tiling", None, ""),
    ("weight_tiling", None, ""),
    ("mlp_in_weight_tiling_permute_order", None, ""),
    ("mlp_out_weight_tiling_permute_order", None, ""),
    ("mlp_out_weight_transpose", None, ""),
    ("log_softmax_scores", None, ""),
    ("shard_over_sequence", "flash_decoding_enabled", ""),
    ("duplicate_q_weight_sos", None, ""),
    ("output_all_logits", None, ""),
    ("fused_rmsnorm_qkv", "qkv_kernel_enabled", ""),
    ("fused_rmsnorm_mlp", "mlp_kernel_enabled", ""),
    ("attn_output_transposed", None, ""),
    ("compilation_worker_count", None, ""),
]
ROWS = {tnx: (nxdi, note) for tnx, nxdi, note in TABLE}
# TNx sub-configs whose fields are rows of their own.
SUB_CONFIGS = {key.split(".")[0] for key in ROWS if "." in key}

# TNx spells dtypes as amp names; NxD Inference as torch dtype names.
AMP_TO_DTYPE = {"bf16": "bfloat16", "f16": "float16", "fp16": "float16", "f32": "float32",
                "fp32": "float32"}
QUANT_DTYPE = {"s8": "int8"}
DTYPE_KEYS = {"torch_dtype", "rpl_reduce_dtype"}


@dataclass
class Migration:
    nxdi: dict[str, Any] = field(default_factory=dict)
    # one entry per input key: {"tnx": key, "nxdi": key or None, "value": ..., "note": ...}
    mapped: list[dict[str, Any]] = field(default_factory=list)
    dropped: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"override_neuron_config": self.nxdi, "mapped": self.mapped,
                "dropped": self.dropped}


def flatten(config: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Sub-config dicts become dotted keys (`{"quant": {"quant_dtype": "s8"}}` ->
    `quant.quant_dtype`); dotted keys given as such pass through."""
    items: list[tuple[str, Any]] = []
    for key, value in config.items():
        if key in SUB_CONFIGS and isinstance(value, Mapping):
            if key in ROWS and not value:  # e.g. on_device_generation: {} is itself a row
                items.append((key, {}))
            items.extend((f"{key}.{sub}", v) for sub, v in value.items())
        else:
            items.append((key, value))
    return items


def translate(nxdi_key: str, tnx_key: str, value: Any) -> Any:
    if nxdi_key in DTYPE_KEYS and isinstance(value, str):
        return AMP_TO_DTYPE.get(value, value)
    if tnx_key == "quant.quant_dtype" and isinstance(value, str):
        return QUANT_DTYPE.get(value, value)
    return value


def _set(out: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    *parents, leaf = dotted.split(".")
    target = out
    for part in parents:
        target = target.setdefault(part, {})
        if not isinstance(target, dict):
            raise UsageError(f"{source}: {part} is set both as a value and as a sub-config")
    if leaf in target and target[leaf] != value:
        raise UsageError(
            f"{source} gives {dotted}={value!r}, but another key already set it to "
            f"{target[leaf]!r}",
            "make the TNx settings agree",
        )
    target[leaf] = value


# Settings the guide's notes ask for alongside a mapped key.
COMPANIONS = {
    "quant.quant_dtype": lambda v: {"quantized": True},
    "kv_cache_quant.quant_dtype": lambda v: {"kv_cache_quant": True},
    "continuous_batching.max_num_seqs": lambda v: {"is_continuous_batching": True,
                                                   "tkg_batch_size": v},
}


def migrate_tnx(config: Mapping[str, Any]) -> Migration:
    """Migrate a TNx override_neuron_config; an unknown key is a UsageError naming it."""
    result = Migration()
    for key, value in flatten(config):
        if key not in ROWS:
            raise UsageError(
                f"unknown Transformers NeuronX neuron config key {key!r}",
                "the migration table (AWS 'Migrating from Transformers NeuronX') has no such "
                "row; check the spelling",
            )
        nxdi_key, note = ROWS[key]
        for extra_key, extra in COMPANIONS.get(key, lambda v: {})(value).items():
            _set(result.nxdi, extra_key, extra, key)
        if nxdi_key is None:
            result.dropped.append({"tnx": key, "value": value, "note": note})
            continue
        new_value = translate(nxdi_key, key, value)
        _set(result.nxdi, nxdi_key, new_value, key)
        result.mapped.append({"tnx": key, "nxdi": nxdi_key, "value": new_value, "note": note})
    return result


def parse_override(text: str) -> dict[str, Any]:
    """A JSON object, or vLLM's `key:value,key:value` CLI form (seed 001)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(f"malformed JSON: {exc.msg} at position {exc.pos}") from None
        if not isinstance(value, dict):
            raise UsageError("the neuron config must be a JSON object")
        return value
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = part.partition(":")
        if not sep or not key.strip():
            raise UsageError(
                f"cannot read {part!r}", 'give a JSON object or key:value pairs, e.g. '
                '"shard_over_sequence:True"'
            )
        out[key.strip()] = _literal(raw.strip())
    return out


def _literal(raw: str) -> Any:
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return {"true": True, "false": False}.get(raw.lower(), raw)
