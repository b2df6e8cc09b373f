"""`config migrate` row by row against the AWS migration guide's table.

The guide: "Migrating from Transformers NeuronX to NxD Inference", section "Neuron Config
Migration" (aws-neuron/aws-neuron-sdk libraries/nxd-inference/developer_guides/migrate-from-tnx-to-nxdi.rst;
https://awsdocs-neuron.readthedocs-hosted.com/en/latest/libraries/nxd-inference/developer_guides/migrate-from-tnx-to-nxdi.html).

GUIDE_TABLE is the guide's rst list-table, transcribed as-is; the test parses it and checks
every row against neuronctl.migrate, so the implementation's own table is not the oracle.
"""

# ruff: noqa: E501  (GUIDE_TABLE is the guide's text verbatim)
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from neuronctl.cli.main import app
from neuronctl.errors import UsageError
from neuronctl.migrate import migrate_tnx, parse_override
from tests import standins

neuron_standins = standins.neuron_standins  # the stand-in SDK fixture

GUIDE_TABLE = """\
   * - Transformers NeuronX parameter
     - NxD Inference parameter
     - Notes
   * - sparse_attn
     - N/A
     - 
   * - quant.quant_dtype
     - quantization_dtype
     - To use quantization, set ``quantized`` to True, and provide the ``quantized_checkpoints_path`` where the quantized model is stored (or will be stored).
   * - quant.dequant_dtype
     - torch_dtype
     - NxD Inference uses the inference dtype as the dequant dtype.
   * - quant.quantize_method
     - quantization_type
     - 
   * - quant.quantize_attn
     - N/A
     - 
   * - quant.no_quantize_list
     - N/A
     - 
   * - kv_cache_quant.quant_dtype
     - N/A
     - NxD Inference uses FP8 (torch.float8_e4m3fn) for KV cache quantization. To use KV cache quantization, set ``kv_cache_quant`` to True.
   * - kv_cache_quant.dequant_dtype
     - torch_dtype
     - NxD Inference uses the inference dtype as the dequant dtype.
   * - kv_cache_quant.quantize_method
     - N/A
     - NxD Inference uses direct cast.
   * - continuous_batching.max_num_seqs
     - max_batch_size
     - To use continuous batching, set ``is_continous_batching`` to True, and set ``tkg_batch_size`` to the max batch size.
   * - continuous_batching.max_model_len
     - seq_len
     - 
   * - continuous_batching.optimized_paged_attention
     - N/A
     - 
   * - continuous_batching.block_size
     - N/A
     - 
   * - continuous_batching.num_blocks
     - N/A
     - 
   * - attention_layout
     - N/A
     - NxD Inference uses BHSD layout.
   * - collectives_layout
     - N/A
     - NxD Inference uses BHSD layout.
   * - cache_layout
     - N/A
     - NxD Inference uses BHSD layout.
   * - padding_side
     - padding_side
     - NxD Inference defaults to padding on the right side.
   * - group_query_attention
     - N/A
     - 
   * - sequence_parallel_norm
     - sequence_parallel_enabled
     - 
   * - sequence_parallel_norm_threshold
     - N/A
     - 
   * - bf16_rms_norm
     - N/A
     - NxD Inference upcasts RMS norm inputs to fp32.
   * - on_device_embedding
     - N/A
     - 
   * - on_device_generation
     - on_device_sampling_config
     - 
   * - on_device_generation.max_length
     - seq_len
     - NxD Inference uses the model's sequence length.
   * - on_device_generation.do_sample
     - on_device_sampling_config.do_sample
     - 
   * - on_device_generation.top_k
     - on_device_sampling_config.top_k
     - NxD Inference supports top_k through dynamic sampling. Pass the top_k values to the model inputs.
   * - on_device_generation.top_p
     - N/A
     - NxD Inference supports top_p through dynamic sampling. Pass the top_p values to the model inputs.
   * - on_device_generation.temperature
     - N/A
     - NxD Inference supports temperature through dynamic sampling. Pass the temperature values to the model inputs.
   * - on_device_generation.top_p_min_tokens
     - N/A
     - NxD Inference defaults to a minimum of 1 token.
   * - on_device_generation.global_top_k
     - on_device_sampling_config.global_topk
     - 
   * - on_device_generation.eos_token_id
     - N/A
     - NxD Inference sampling treats EOS like any other token.
   * - on_device_generation.dynamic
     - on_device_sampling_config.dynamic
     - 
   * - on_device_generation.deterministic
     - on_device_sampling_config.deterministic
     - 
   * - on_device_generation.per_batch_line
     - N/A
     - 
   * - all_reduce_dtype
     - rpl_reduce_dtype
     - NxD Inference applies this dtype to only the all_reduce in attention's ``o_proj`` layer.
   * - cast_logits_dtype
     - N/A
     - 
   * - fuse_qkv
     - fused_qkv
     - 
   * - qkv_tiling
     - N/A
     - 
   * - weight_tiling
     - N/A
     - 
   * - mlp_in_weight_tiling_permute_order
     - N/A
     - 
   * - mlp_out_weight_tiling_permute_order
     - N/A
     - 
   * - mlp_out_weight_transpose
     - N/A
     - 
   * - log_softmax_scores
     - N/A
     - 
   * - shard_over_sequence
     - flash_decoding_enabled
     - 
   * - duplicate_q_weight_sos
     - N/A
     - 
   * - output_all_logits
     - N/A
     - 
   * - fused_rmsnorm_qkv
     - qkv_kernel_enabled
     - 
   * - fused_rmsnorm_mlp
     - mlp_kernel_enabled
     - 
   * - attn_output_transposed
     - N/A
     - 
   * - compilation_worker_count
     - N/A
     -
"""


def seed_rows() -> list[tuple[str, str | None, str]]:
    rows = []
    for block in GUIDE_TABLE.split("   * - ")[2:]:  # [0] is empty, [1] the header
        cells = [c.strip() for c in re.split(r"\n     - ?", block)]
        tnx, nxdi, note = (cells + [""])[:3]
        note = " ".join(note.replace("``", "").split())
        rows.append((tnx, None if nxdi == "N/A" else nxdi, note))
    return rows


ROWS = seed_rows()


def nested(key: str, value: object) -> dict:
    """A TNx config with `key` (dotted for sub-configs) set, the way a user writes it."""
    parent, _, child = key.partition(".")
    return {parent: {child: value}} if child else {parent: value}


def lookup(config: dict, dotted: str) -> object:
    for part in dotted.split("."):
        config = config[part]
    return config


def test_seed_table_was_transcribed_whole() -> None:
    assert len(ROWS) == 51
    assert ROWS[0] == ("sparse_attn", None, "")
    assert ROWS[-1] == ("compilation_worker_count", None, "")


# A valid TNx value and its NxD Inference translation, where the vocabularies differ.
ROW_VALUES = {
    "quant.quant_dtype": ("f8e4m3fn", "f8e4m3"),
    "quant.quantize_method": ("vector_dynamic", "per_channel_symmetric"),
    "quant.dequant_dtype": ("bf16", "bfloat16"),
    "kv_cache_quant.dequant_dtype": ("f16", "float16"),
}


@pytest.mark.parametrize(("tnx", "nxdi", "note"), ROWS, ids=[r[0] for r in ROWS])
def test_every_row(tnx: str, nxdi: str | None, note: str) -> None:
    value, translated = ROW_VALUES.get(tnx, (7, 7))
    if nxdi == "on_device_sampling_config":
        value = translated = None
    result = migrate_tnx(nested(tnx, value))
    parent = tnx.split(".")[0]
    own = [m for m in result.mapped if m["tnx"] == tnx]
    switches = [m for m in result.mapped if m["tnx"] == parent and "." in tnx]
    if nxdi is None:
        assert result.dropped == [{"tnx": tnx, "value": value, "note": note}]
        assert own == []
    else:
        assert own[-1] == {"tnx": tnx, "nxdi": nxdi, "value": translated, "note": note}
        assert lookup(result.nxdi, nxdi) == translated
        assert result.dropped == []
    # The sub-config a dotted row belongs to is itself reported as the switch it maps to.
    assert ("." in tnx and parent in ("quant", "kv_cache_quant", "continuous_batching",
                                      "on_device_generation")) == bool(switches)
    for switch in switches:
        assert lookup(result.nxdi, switch["nxdi"]) == switch["value"]


def test_values_tnx_rejects_are_an_error() -> None:
    """TNx's QuantizationConfig raises NotImplementedError for anything but s8/f8e4m3fn and
    vector_dynamic/direct_cast; passing such a value on would only fail later in NxDI."""
    for bad in ({"quant": {"quant_dtype": "int8"}},
                {"quant": {"quantize_method": "per_tensor_symmetric"}}):
        with pytest.raises(UsageError, match="not a Transformers NeuronX value"):
            migrate_tnx(bad)


@pytest.mark.parametrize(
    ("tnx", "nxdi"),
    [
        ({"quant": {}}, {"quantized": True, "quantized_checkpoints_path": "quantized_checkpoint",
                         "quantization_dtype": "int8",
                         "quantization_type": "per_channel_symmetric"}),
        ({"kv_cache_quant": {}}, {"kv_cache_quant": True}),
        ({"on_device_generation": {"top_p": 0.9, "temperature": 0.7}},
         {"on_device_sampling_config": {}}),
        ({"continuous_batching": {"batch_size_for_shared_caches": 4}},
         {"is_continuous_batching": True, "tkg_batch_size": 4, "max_batch_size": 4}),
    ],
    ids=["quant", "kv_cache_quant", "on_device_generation", "batch_size_for_shared_caches"],
)
def test_a_sub_config_given_at_all_is_an_enablement(tnx: dict, nxdi: dict) -> None:
    """In TNx `quant=QuantizationConfig()` quantizes with its defaults (s8, vector_dynamic):
    `{"quant": {}}` is not nothing. Every NxDI setting made is reported as mapped."""
    result = migrate_tnx(tnx)
    assert result.nxdi == nxdi
    reported = {m["nxdi"].split(".")[0] for m in result.mapped}
    assert reported == set(nxdi)


def test_quantized_checkpoints_path_is_a_parameter() -> None:
    result = migrate_tnx({"quant": {"quant_dtype": "s8"}}, "/data/q")
    assert result.nxdi["quantized_checkpoints_path"] == "/data/q"


@pytest.mark.parametrize(
    "key",
    ["fuse_mlp", "is_eagle_target", "is_eagle_draft", "has_pre_attention_norm",
     "continuous_batching.enable_chunked_prefill",
     "continuous_batching.batch_size_for_shared_caches", "lhs_aligned", "use_2d_cache_ids"],
)
def test_every_real_tnx_key_is_accepted(key: str) -> None:
    """Keys the real TNx NeuronConfig / ContinuousBatchingConfig accept that the guide omits
    (transformers_neuronx/config.py, Dec 2024): mapped or dropped, never 'unknown'."""
    result = migrate_tnx(nested(key, True))
    assert key in [m["tnx"] for m in result.mapped] + [d["tnx"] for d in result.dropped]


def test_dtype_spellings_are_translated() -> None:
    result = migrate_tnx(
        {
            "quant": {"quant_dtype": "s8", "dequant_dtype": "bf16",
                      "quantize_method": "direct_cast"},
            "all_reduce_dtype": "f32",
        }
    )
    assert result.nxdi == {
        "quantized": True,
        "quantized_checkpoints_path": "quantized_checkpoint",
        "quantization_dtype": "int8",
        "torch_dtype": "bfloat16",
        "quantization_type": "per_tensor_symmetric",
        "rpl_reduce_dtype": "float32",
    }
    note = next(m["note"] for m in result.mapped if m["tnx"] == "quant.quantize_method")
    assert "no direct cast" in note


def test_companion_settings_from_the_notes() -> None:
    result = migrate_tnx(
        {
            "continuous_batching": {"max_num_seqs": 8, "max_model_len": 2048, "block_size": 2048},
            "kv_cache_quant": {"quant_dtype": "f8e4m3fn"},
        }
    )
    assert result.nxdi == {
        "is_continuous_batching": True,
        "tkg_batch_size": 8,
        "max_batch_size": 8,
        "seq_len": 2048,
        "kv_cache_quant": True,
    }
    assert [d["tnx"] for d in result.dropped] == [
        "continuous_batching.block_size",
        "kv_cache_quant.quant_dtype",
    ]
    assert {m["nxdi"] for m in result.mapped} == set(result.nxdi)


def test_on_device_generation_sub_keys_nest_under_sampling_config() -> None:
    result = migrate_tnx(
        {
            "on_device_generation": {
                "do_sample": True,
                "top_k": 50,
                "global_top_k": 256,
                "top_p": 0.9,
                "max_length": 512,
            }
        }
    )
    assert result.nxdi == {
        "on_device_sampling_config": {"do_sample": True, "top_k": 50, "global_topk": 256},
        "seq_len": 512,
    }


def test_conflicting_values_are_refused() -> None:
    with pytest.raises(UsageError, match="seq_len"):
        migrate_tnx(
            {
                "continuous_batching": {"max_model_len": 2048},
                "on_device_generation": {"max_length": 1024},
            }
        )


@pytest.mark.parametrize("bad", [{"no_such_key": 1}, {"quant": {"bogus": 1}}, {"quant.x": 2}])
def test_unknown_keys_are_an_error_naming_the_key(bad: dict) -> None:
    with pytest.raises(UsageError) as err:
        migrate_tnx(bad)
    name = next(iter(bad))
    sub = bad[name]
    expected = f"{name}.{next(iter(sub))}" if isinstance(sub, dict) else name
    assert repr(expected) in err.value.message


def test_dotted_input_keys_work_too() -> None:
    result = migrate_tnx({"quant.quantize_method": "direct_cast"})
    assert result.nxdi == migrate_tnx({"quant": {"quantize_method": "direct_cast"}}).nxdi
    assert result.nxdi["quantization_type"] == "per_tensor_symmetric"


def test_parse_vllm_cli_form() -> None:
    assert parse_override("shard_over_sequence:True, fuse_qkv:false") == {
        "shard_over_sequence": True,
        "fuse_qkv": False,
    }
    assert parse_override('{"fuse_qkv": true}') == {"fuse_qkv": True}
    with pytest.raises(UsageError):
        parse_override("{not json")


def test_cli_json_and_file(tmp_path) -> None:
    path = tmp_path / "o.json"
    path.write_text(json.dumps({"fuse_qkv": True, "bf16_rms_norm": True}))
    result = CliRunner().invoke(app, ["config", "migrate", str(path), "--from", "tnx", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["override_neuron_config"] == {"fused_qkv": True}
    assert data["dropped"][0]["note"] == "NxD Inference upcasts RMS norm inputs to fp32."


def test_cli_exit_code_for_unknown_key() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "neuronctl.cli.main",
            "config",
            "migrate",
            '{"nope": 1}',
            "--from",
            "tnx",
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert "'nope'" in out.stderr


MIGRATE_PROBES = {
    "quant s8 vector_dynamic": {"quant": {"quant_dtype": "s8", "quantize_method": "vector_dynamic"}},
    "quant f8e4m3fn direct_cast": {"quant": {"quant_dtype": "f8e4m3fn",
                                             "quantize_method": "direct_cast"}},
    "quant {}": {"quant": {}},
    "continuous_batching": {"continuous_batching": {"max_num_seqs": 8, "max_model_len": 2048}},
    "on_device_generation": {"on_device_generation": {"top_k": 1, "global_top_k": 256,
                                                      "dynamic": True}},
    "kernels/layout": {"fuse_qkv": True, "shard_over_sequence": True, "padding_side": "right",
                       "all_reduce_dtype": "bfloat16", "sequence_parallel_norm": True},
}


@pytest.mark.parametrize("name", list(MIGRATE_PROBES))
def test_migrated_override_constructs_a_neuron_config(neuron_standins, caplog,
                                                      name: str) -> None:
    """The migrated override merged over vLLM's default NxDI config:
    the stand-in rejects what the real NeuronConfig rejects (a quantized config without
    quantized_checkpoints_path, f8e4m3fn before SDK 2.27) and warns on unknown keys."""
    config_mod = __import__("neuronx_distributed_inference.models.config", fromlist=["x"])
    defaults = {"tp_degree": 2, "batch_size": 8, "max_context_length": 2048, "seq_len": 2048,
                "enable_bucketing": True, "is_continuous_batching": True,
                "torch_dtype": "bfloat16", "padding_side": "right"}
    override = json.loads(json.dumps(migrate_tnx(MIGRATE_PROBES[name]).nxdi))
    with caplog.at_level("WARNING"):
        config = config_mod.NeuronConfig(**{**defaults, **override})
    assert "Unexpected keyword" not in caplog.text
    if "quant" in name:
        assert config.quantized is True


ROUND_TRIP = {
    **{k: v for k, v in MIGRATE_PROBES.items() if k != "continuous_batching"},
    "continuous_batching": {"continuous_batching": {"max_num_seqs": 4, "max_model_len": 256}},
    "everything": {"quant": {"quant_dtype": "s8"}, "fuse_qkv": True, "padding_side": "right",
                   "continuous_batching": {"max_num_seqs": 2, "max_model_len": 256},
                   "on_device_generation": {"top_k": 4, "dynamic": True}},
}


@pytest.mark.parametrize("name", list(ROUND_TRIP))
def test_neuronctl_flags_round_trip_through_hash(neuron_standins, tiny_llama, tmp_path,
                                                 name: str) -> None:
    """`config migrate` prints flags for what the spec owns (nxdi/config.py SPEC_OWNED, which
    an override may not set) and --override-neuron-config for the rest; `neuronctl hash`
    takes them as they are, and the build compiles every migrated NxDI setting except the
    ones neuronctl always makes itself (continuous batching, sharded weights, its own
    quantization scratch directory)."""
    from neuronctl.backends.nxdi.config import neuron_config_kwargs
    from neuronctl.build import resolve_build
    from neuronctl.migrate import NEURONCTL_SETS

    migration = migrate_tnx(ROUND_TRIP[name])
    flags = migration.neuronctl_flags()
    store = ["--store", str(tmp_path / "store")]
    result = CliRunner().invoke(app, ["hash", str(tiny_llama), *flags, *store, "--json"])
    assert result.exit_code == 0, result.output
    spec_fields, override, _notes = migration.for_neuronctl()
    build = resolve_build(str(tiny_llama), {"backend": "nxdi", **spec_fields,
                                            "override_neuron_config": override},
                          store_dir=tmp_path / "store")
    assert json.loads(result.output)["graph_key"] == build.keys.graph
    compiled = json.loads(json.dumps(neuron_config_kwargs(build.spec)))
    for key, value in migration.nxdi.items():
        if key in NEURONCTL_SETS:
            continue
        if key in ("max_batch_size", "tkg_batch_size"):
            key = "batch_size"
        if isinstance(value, dict):
            assert {k: compiled[key][k] for k in value} == value, key
        else:
            assert compiled[key] == value, key


def test_spec_owned_keys_are_named_together_with_their_flags() -> None:
    from neuronctl.backends.nxdi.config import check_override
    from neuronctl.errors import SpecError

    with pytest.raises(SpecError) as err:
        check_override({"quantization_dtype": "int8", "fused_qkv": True, "tp_degree": 2})
    assert "quantization_dtype, tp_degree: are set by the build spec" in str(err.value)
    assert "--quantization-dtype, --tp-degree" in (err.value.hint or "")
