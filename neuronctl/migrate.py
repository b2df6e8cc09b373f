"""Transformers NeuronX `override_neuron_config` -> NxD Inference, per the AWS migration guide.

The table below is the "Neuron Config Migration" table of the AWS guide "Migrating from
Transformers NeuronX to NxD Inference", row by row
(https://awsdocs-neuron.readthedocs-hosted.com/en/latest/libraries/nxd-inference/developer_guides/migrate-from-tnx-to-nxdi.html;
its source is aws-neuron/aws-neuron-sdk,
libraries/nxd-inference/developer_guides/migrate-from-tnx-to-nxdi.rst):
TNx parameter (dotted for sub-configs), NxD Inference parameter (None = no equivalent, the
key is dropped and reported with the note), and the guide's note. EXTRA_ROWS covers the keys
the real TNx NeuronConfig / ContinuousBatchingConfig accept that the guide omits.

Values are translated where the two libraries spell them differently (TNx amp names 'bf16' ->
NxDI dtype 'bfloat16', quant dtype 's8' -> 'int8' and 'f8e4m3fn' -> 'f8e4m3', quantize_method
'vector_dynamic' -> 'per_channel_symmetric'); a value TNx itself rejects is an error. Giving a
TNx sub-config at all enables the feature (`{"quant": {}}` quantizes with TNx's defaults), so
each sub-config maps to its NxDI switch, and the settings the guide's notes ask for alongside
(quantized_checkpoints_path, kv_cache_quant, is_continuous_batching + tkg_batch_size) are set.
Every switch and companion set is reported in `mapped`, every key without an equivalent in
`dropped`.
"""

from __future__ import annotations

import ast
import copy
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from neuronctl.errors import UsageError

# (tnx key, nxdi key or None, note) -- transcribed from the guide's table, in its order.
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
# Keys the real TNx configs accept (transformers_neuronx/config.py, Dec 2024) that the guide's
# table leaves out; the NxDI names exist in NxDI 0.5 (SDK 2.25) and main (models/config.py).
EXTRA_ROWS: list[tuple[str, str | None, str]] = [
    ("continuous_batching.batch_size_for_shared_caches", "max_batch_size",
     "TNx's other name for continuous_batching.max_num_seqs."),
    ("continuous_batching.enable_chunked_prefill", None,
     "NxD Inference configures chunked prefill with chunked_prefill_config "
     "(a ChunkedPrefillConfig); neuronctl does not translate it."),
    ("fuse_mlp", None, "NxD Inference has no such switch; its MLP kernels (mlp_kernel_enabled) "
     "fuse the MLP."),
    ("is_eagle_target", "enable_eagle_speculation",
     "NxD Inference takes the EAGLE draft model through fused_spec_config."),
    ("is_eagle_draft", "is_eagle_draft", ""),
    ("has_pre_attention_norm", None,
     "An EAGLE draft layout setting; NxD Inference derives it from the draft model."),
    ("use_2d_cache_ids", None,
     "Deprecated in TNx for padding_side='right'; NxD Inference pads on the right by default."),
    ("lhs_aligned", None,
     "Deprecated in TNx for padding_side='right'; NxD Inference pads on the right by default."),
]
ROWS = {tnx: (nxdi, note) for tnx, nxdi, note in TABLE + EXTRA_ROWS}
# TNx sub-configs whose fields are rows of their own.
SUB_CONFIGS = {key.split(".")[0] for key in ROWS if "." in key}

# TNx spells dtypes as amp names; NxD Inference as torch dtype names.
AMP_TO_DTYPE = {"bf16": "bfloat16", "f16": "float16", "fp16": "float16", "f32": "float32",
                "fp32": "float32"}
DTYPE_KEYS = {"torch_dtype", "rpl_reduce_dtype"}
# TNx value -> NxD Inference value, for the keys whose vocabularies differ. TNx accepts only
# these (QuantizationConfig raises NotImplementedError otherwise); the NxDI names are the
# neuronx_distributed QuantizedDtype / QuantizationType members every SDK has (F8E4M3FN only
# from SDK 2.27, so f8e4m3).
VALUES: dict[str, dict[Any, Any]] = {
    "quant.quant_dtype": {"s8": "int8", "f8e4m3fn": "f8e4m3"},
    # vector_dynamic scales each output channel; direct_cast casts without a scale, which
    # NxDI does not offer: one scale per tensor is the nearest.
    "quant.quantize_method": {"vector_dynamic": "per_channel_symmetric",
                              "direct_cast": "per_tensor_symmetric"},
}
VALUE_NOTES = {
    ("quant.quantize_method", "direct_cast"):
        "NxD Inference has no direct cast for weights; per_tensor_symmetric is the nearest.",
}
# Where NxDI puts a quantized checkpoint (or quantizes into); the guide's note asks for one.
QUANTIZED_CHECKPOINTS_PATH = "quantized_checkpoint"


# NxD Inference keys a neuronctl build spec owns (backends/nxdi/config.py SPEC_OWNED refuses
# them in an override) -> the spec field, whose flag is --<field with dashes>.
SPEC_FIELDS = {
    "tp_degree": "tp_degree",
    "batch_size": "batch_size",
    "max_batch_size": "batch_size",  # NxDI's max_batch_size / tkg_batch_size default to it
    "tkg_batch_size": "batch_size",
    "seq_len": "seq_len",
    "max_context_length": "max_context_length",
    "torch_dtype": "dtype",
    "context_encoding_buckets": "context_buckets",
    "token_generation_buckets": "token_gen_buckets",
    "on_device_sampling_config": "on_device_sampling",
    "quantized": "quantized",
    "quantization_dtype": "quantization_dtype",
    "quantization_type": "quantization_type",
    "speculation_length": "num_speculative_tokens",
}
# NxD Inference settings every neuronctl nxdi build makes itself (backends/nxdi/config.py).
NEURONCTL_SETS = {
    "is_continuous_batching": (True, "neuronctl always compiles continuous batching"),
    "save_sharded_checkpoint": (True, "the artifact always carries its sharded weights"),
    "quantized_checkpoints_path": (None, "neuronctl quantizes into a scratch directory of its "
                                         "own and keeps the sharded result in the artifact"),
}


@dataclass
class Migration:
    nxdi: dict[str, Any] = field(default_factory=dict)
    # one entry per input key: {"tnx": key, "nxdi": key or None, "value": ..., "note": ...}
    mapped: list[dict[str, Any]] = field(default_factory=list)
    dropped: list[dict[str, Any]] = field(default_factory=list)

    def for_neuronctl(self) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
        """(spec fields, override_neuron_config, notes): what a neuronctl nxdi build takes
        as spec flags, what it takes as --override-neuron-config, and why anything of the
        NxDI config is in neither."""
        spec: dict[str, Any] = {}
        override: dict[str, Any] = {}
        notes: list[str] = []
        for key, value in self.nxdi.items():
            name = SPEC_FIELDS.get(key)
            if name is not None:
                if name in spec and spec[name] != value:
                    raise UsageError(
                        f"{key}={value!r} disagrees with {spec[name]!r} for --"
                        f"{name.replace('_', '-')}",
                        "make the TNx batch settings agree",
                    )
                spec[name] = value
            elif key in NEURONCTL_SETS:
                always, why = NEURONCTL_SETS[key]
                if always is not None and value != always:
                    raise UsageError(f"{key}={value!r}: {why}, it cannot be turned off")
                notes.append(f"{key}: not passed, {why}")
            else:
                override[key] = value
        if "num_speculative_tokens" in spec:
            notes.append("num_speculative_tokens: add --draft-model (the TNx config has none)")
        return spec, override, notes

    def neuronctl_flags(self) -> list[str]:
        """`neuronctl compile/hash` flags for this config: the spec's own flags, the rest in
        one --override-neuron-config."""
        spec, override, _notes = self.for_neuronctl()
        flags = ["--backend", "nxdi"]
        for name, value in spec.items():
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                flags.append(flag if value else "--no-" + flag[2:])
            elif isinstance(value, list):
                flags += [flag, ",".join(str(v) for v in value)]
            elif isinstance(value, dict):
                flags += [flag, json.dumps(value, sort_keys=True)]
            else:
                flags += [flag, str(value)]
        if override:
            flags += ["--override-neuron-config", json.dumps(override, sort_keys=True)]
        return flags

    def as_dict(self) -> dict[str, Any]:
        spec, override, notes = self.for_neuronctl()
        return {"override_neuron_config": self.nxdi, "mapped": self.mapped,
                "dropped": self.dropped,
                "neuronctl": {"spec": spec, "override_neuron_config": override,
                              "flags": self.neuronctl_flags(), "notes": notes}}


def flatten(config: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Sub-config dicts become dotted keys (`{"quant": {"quant_dtype": "s8"}}` ->
    `quant.quant_dtype`), each preceded by the sub-config itself (its enablement); dotted keys
    given as such pass through."""
    items: list[tuple[str, Any]] = []
    for key, value in config.items():
        if key in SUB_CONFIGS and isinstance(value, Mapping):
            items.append((key, dict(value)))
            items.extend((f"{key}.{sub}", v) for sub, v in value.items())
        else:
            items.append((key, value))
    return items


def translate(nxdi_key: str, tnx_key: str, value: Any) -> Any:
    if tnx_key in VALUES:
        table = VALUES[tnx_key]
        if value not in table:
            raise UsageError(
                f"{tnx_key}={value!r} is not a Transformers NeuronX value "
                f"(it accepts {', '.join(map(repr, table))})",
                "TNx raises NotImplementedError for it; fix the TNx config first",
            )
        return table[value]
    if nxdi_key in DTYPE_KEYS and isinstance(value, str):
        return AMP_TO_DTYPE.get(value, value)
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
COMPANIONS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "continuous_batching.max_num_seqs": lambda v: {"is_continuous_batching": True,
                                                   "tkg_batch_size": v},
    "continuous_batching.batch_size_for_shared_caches": lambda v: {
        "is_continuous_batching": True, "tkg_batch_size": v},
}
# A TNx sub-config given at all, even {}, switches the feature on: its NxDI switch, and the
# TNx defaults (QuantizationConfig: s8, vector_dynamic) where NxDI's differ.
ENABLES: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    "quant": ({"quantized": True, "quantized_checkpoints_path": QUANTIZED_CHECKPOINTS_PATH},
              {"quant_dtype": "s8", "quantize_method": "vector_dynamic"},
              "To use quantization, set quantized to True, and provide the "
              "quantized_checkpoints_path where the quantized model is stored (or will be "
              "stored). TNx's default dequant_dtype (f16) is not carried over: NxD Inference "
              "dequantizes to torch_dtype."),
    "kv_cache_quant": ({"kv_cache_quant": True}, {},
                       "NxD Inference uses FP8 (torch.float8_e4m3fn) for KV cache quantization."),
    "continuous_batching": ({"is_continuous_batching": True}, {},
                            "To use continuous batching, set is_continous_batching to True."),
    "on_device_generation": ({"on_device_sampling_config": {}}, {},
                             "On-device sampling, with NxD Inference's defaults for the "
                             "settings not mapped below."),
}


def migrate_tnx(config: Mapping[str, Any],
                quantized_checkpoints_path: str = QUANTIZED_CHECKPOINTS_PATH) -> Migration:
    """Migrate a TNx override_neuron_config; an unknown key or a value TNx itself rejects is a
    UsageError naming it."""
    result = Migration()
    reported: set[str] = set()

    def switch(key: str, values: Mapping[str, Any], note: str) -> None:
        for nxdi_key, value in copy.deepcopy(dict(values)).items():
            if nxdi_key == "quantized_checkpoints_path":
                value = quantized_checkpoints_path
            _set(result.nxdi, nxdi_key, value, key)
            if nxdi_key not in reported:
                reported.add(nxdi_key)
                result.mapped.append({"tnx": key, "nxdi": nxdi_key, "value": value,
                                      "note": note})

    items = flatten(config)
    given = {key for key, _ in items}
    dotted_parents = {key.split(".")[0] for key in given if "." in key}
    items = [(parent, {}) for parent in sorted(dotted_parents - given) if parent in ENABLES] + items
    for key, value in list(items):
        if key in ENABLES and isinstance(value, Mapping):
            given = {k.split(".", 1)[1] for k, _ in items if k.startswith(key + ".")}
            items += [(f"{key}.{k}", v) for k, v in ENABLES[key][1].items() if k not in given]
    for key, value in items:
        if key not in ROWS and not (key in ENABLES and isinstance(value, Mapping)):
            raise UsageError(
                f"unknown Transformers NeuronX neuron config key {key!r}",
                "neither the migration table (AWS 'Migrating from Transformers NeuronX') nor "
                "the TNx NeuronConfig has it; check the spelling",
            )
        if key in ENABLES and isinstance(value, Mapping):
            switch(key, ENABLES[key][0], ENABLES[key][2])
            continue
        nxdi_key, note = ROWS[key]
        switch(key, COMPANIONS.get(key, lambda v: {})(value), note)
        if nxdi_key is None:
            result.dropped.append({"tnx": key, "value": value, "note": note})
            continue
        new_value = translate(nxdi_key, key, value)
        note = " ".join(filter(None, (note, VALUE_NOTES.get((key, value), ""))))
        _set(result.nxdi, nxdi_key, new_value, key)
        reported.add(nxdi_key)
        result.mapped.append({"tnx": key, "nxdi": nxdi_key, "value": new_value, "note": note})
    return result


def parse_override(text: str) -> dict[str, Any]:
    """A JSON object, or vLLM's `key:value,key:value` CLI form (the TNx continuous-batching
    guide's `--override-neuron-config` examples for vLLM 0.6.2)."""
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
