"""tnx backend contract tests against the SDK stand-ins, plus the real SDK under `neuron`."""

from __future__ import annotations

import json

import pytest

from neuronctl.backends import get_backend
from neuronctl.backends.tnx import config as tnx_config
from neuronctl.errors import BackendUnavailableError, BuildError, NeuronctlError, SpecError
from neuronctl.spec import ModelShape, build_spec, finalize
from neuronctl.store.manifest import read_manifest
from tests import standins

neuron_standins = standins.neuron_standins  # the stand-in SDK fixture

SPEC = {
    "backend": "tnx",
    "tp_degree": 2,
    "batch_size": 3,
    "seq_len": 128,
    "max_context_length": 64,
    "dtype": "float16",
    "context_buckets": "32,64",
    "token_gen_buckets": "64,128",
}
SHAPE = ModelShape(num_attention_heads=4, num_key_value_heads=2)
LLAMA = {"model_type": "llama"}


def spec_of(**fields: object):
    return finalize(build_spec({**SPEC, **fields}), SHAPE)


SAMPLING = {"do_sample": True, "top_k": 5, "dynamic": True}


def test_from_pretrained_and_neuron_config_kwargs() -> None:
    """The NeuronConfig vLLM's TNx loader builds (model_loader/neuron.py
    _get_default_neuron_config: BSH layouts, fuse_qkv, batch_size_for_shared_caches,
    vector_dynamic quant + weight_tiling; neuron_model_runner._init_neuron_sampling for
    on-device generation), so the persistent NEFF cache hits."""
    spec = spec_of(quantized=True, on_device_sampling=SAMPLING,
                   override_neuron_config={"sequence_parallel_norm": True})
    assert tnx_config.from_pretrained_kwargs(spec) == {
        "batch_size": 3, "tp_degree": 2, "n_positions": [64, 128],
        "context_length_estimate": [32, 64], "amp": "f16",
    }
    assert tnx_config.neuron_config_kwargs(spec) == {
        "continuous_batching": {"max_num_seqs": 3},
        "attention_layout": "BSH",
        "collectives_layout": "BSH",
        "fuse_qkv": True,
        "on_device_embedding": True,
        "quant": {"quant_dtype": "s8", "dequant_dtype": "f16",
                  "quantize_method": "vector_dynamic"},
        "weight_tiling": True,
        "on_device_generation": {"max_length": 128, "do_sample": True, "per_batch_line": True,
                                 "top_k": [256] * 3, "top_p": [1.0] * 3,
                                 "temperature": [1.0] * 3, "dynamic": True,
                                 "global_top_k": 256},
        "sequence_parallel_norm": True,
    }
    # TNx quantizes one way (vector_dynamic, per output channel): the spec says so.
    assert spec.quantization_type == "per_channel_symmetric"
    assert tnx_config.runtime_generation_config(spec)["top_k"] == [5] * 3


@pytest.mark.parametrize(
    ("fields", "config", "match"),
    [
        ({"override_neuron_config": {"continuous_batching": {"block_size": 8}}}, LLAMA,
         "block_size"),
        ({"token_gen_buckets": "64"}, LLAMA, "must equal seq_len"),
        ({}, {"model_type": "qwen2"}, "qwen2"),
        ({"cc_flags": "--cache_dir=/tmp/x"}, LLAMA, "cache_dir"),
        ({"override_neuron_config": {"continuous_batching": {"page_size": 8}}}, LLAMA,
         "page_size"),
        ({"override_neuron_config": {"continuous_batching": {"max_num_seqs": 8}}}, LLAMA,
         "max_num_seqs"),
        ({"on_device_sampling": {"do_sample": True}}, LLAMA, "dynamic"),
        ({"on_device_sampling": {"dynamic": True, "global_topk": 64}}, LLAMA, "global_topk"),
    ],
    ids=["block-size-not-max-model-len", "short-last-bucket", "unsupported-model", "cache-dir",
         "unknown-cb-key", "max-num-seqs-not-batch", "sampling-not-dynamic",
         "sampling-global-topk"],
)
def test_check_refuses(fields: dict, config: dict, match: str) -> None:
    with pytest.raises(SpecError, match=match):
        get_backend("tnx").check(spec_of(**fields), config)


def test_block_size_equal_to_seq_len_is_accepted_and_not_passed(neuron_standins) -> None:
    """ContinuousBatchingConfig asserts on block_size (vLLM sets it via init_cache_engine):
    the TNx continuous-batching guide's block_size == max_model_len (its vLLM 0.3.3 / 0.5.0
    examples) is accepted and left out of the constructor."""
    from neuronctl.backends.tnx import make_neuron_config, sdk

    spec = spec_of(override_neuron_config={"continuous_batching": {"block_size": 128}})
    get_backend("tnx").check(spec, LLAMA)
    config = make_neuron_config(sdk(), spec)
    assert neuron_standins.CALLS[0] == ("ContinuousBatchingConfig", {"max_num_seqs": 3})
    assert config.continuous_batching.block_size is None
    assert tnx_config.vllm_override(spec)["continuous_batching"] == {"max_num_seqs": 3}


def test_missing_sdk_says_how_to_install() -> None:
    with pytest.raises(BackendUnavailableError, match="transformers-neuronx"):
        get_backend("tnx").versions()


def compile_tnx(model, store, **fields: object):
    from neuronctl.build import compile_model, resolve_build

    build = resolve_build(str(model), {**SPEC, **fields}, store_dir=store)
    return compile_model(build, jobs=1)


def test_build_sequence_and_published_files(neuron_standins, tiny_llama, tmp_path) -> None:
    outcome = compile_tnx(tiny_llama, tmp_path / "store", cc_flags="-O2")
    rec = neuron_standins
    assert rec.names() == ["ContinuousBatchingConfig", "NeuronConfig", "from_pretrained",
                           "to_neuron", "save"]
    call = rec.CALLS[2][1]
    assert call["cls"] == "LlamaForSampling" and call["path"] == str(tiny_llama)
    assert (call["batch_size"], call["tp_degree"], call["amp"]) == (3, 2, "f16")
    assert call["n_positions"] == [64, 128] and call["context_length_estimate"] == [32, 64]
    compiled = call["neuron_config"]
    assert compiled["continuous_batching"]["max_num_seqs"] == 3
    assert compiled["continuous_batching"]["max_model_len"] is None
    assert (compiled["attention_layout"], compiled["collectives_layout"]) == ("BSH", "BSH")
    assert compiled["fuse_qkv"] is True and compiled["on_device_embedding"] is True
    assert compiled["on_device_generation"] is None and compiled["quant"] is None
    staging_cache = rec.CALLS[3][1]["cache"]
    assert staging_cache.endswith("/neuron-compile-cache") and ".staging" in staging_cache
    assert rec.CALLS[4][1]["sharded_weights"] is True
    path = outcome.path
    manifest = read_manifest(path)
    neffs = sorted(p.name for p in path.glob("*.neff"))
    assert len(neffs) == 1 and manifest.graphs == neffs
    assert any(name.startswith("neuron-compile-cache/") for name in manifest.files)
    # TNx's save() writes its own config object without `architectures`; the artifact's
    # config.json is the checkpoint's with the pre-sharded flag, usable as vLLM's --model.
    saved = json.loads((path / "config.json").read_text())
    assert saved["is_presharded_checkpoint"] is True
    assert saved["architectures"] == ["LlamaForCausalLM"] and saved["model_type"] == "llama"
    assert "amp" not in saved
    assert (path / "tokenizer.json").is_file()
    assert manifest.backend_versions["transformers-neuronx"] == "0.99.0+standin"


def test_sdk_failure_publishes_nothing(neuron_standins, tiny_llama, tmp_path) -> None:
    neuron_standins.FAIL.add("to_neuron")
    with pytest.raises(BuildError, match="stand-in SDK failure"):
        compile_tnx(tiny_llama, tmp_path / "store")
    root = tmp_path / "store" / "neuron-compiled-artifacts"
    assert [p.name for p in root.iterdir() if not p.name.startswith(".")] == []


def test_load_runs_and_finds_its_neffs(neuron_standins, tiny_llama, tmp_path) -> None:
    outcome = compile_tnx(tiny_llama, tmp_path / "store")
    neuron_standins.reset()
    runner = get_backend("tnx").load(outcome.path, read_manifest(outcome.path))
    assert neuron_standins.names()[-3:] == ["from_pretrained", "load", "to_neuron"]
    assert neuron_standins.CALLS[-1][1]["load_dir"] == str(outcome.path)
    assert int(runner.prefill(2, [4, 5]).argmax()) == 6
    assert neuron_standins.CALLS[-1][1]["start_ids"] == [2]
    out = runner.decode([1, 2, 3], [2, -1, 7])
    assert out.shape == (3, 320) and int(out[2].argmax()) == 4
    assert neuron_standins.CALLS[-1][1]["cache_ids"] == [[2], [0], [7]]


def test_runner_never_writes_into_a_live_slot(neuron_standins, tiny_llama, tmp_path) -> None:
    """Runner.decode's invariant (backends/base.py): TNx continuous batching writes every
    row of its batch at `cache_ids` of slot `start_ids` (as vLLM's TNx worker calls
    forward), so an idle row must not land inside a prompt prefilled in the same step."""
    from tests.fake_runner import KvCache, decode_beside_a_fresh_prefill

    outcome = compile_tnx(tiny_llama, tmp_path / "store")
    runner = get_backend("tnx").load(outcome.path, read_manifest(outcome.path))
    neuron_standins.KV = kv = KvCache(runner.batch_size, runner.seq_len)
    decode_beside_a_fresh_prefill(runner, kv)
    assert kv.writes == 3 * runner.batch_size


def test_load_with_a_changed_setting_finds_no_neff(neuron_standins, tiny_llama, tmp_path) -> None:
    outcome = compile_tnx(tiny_llama, tmp_path / "store")
    manifest = read_manifest(outcome.path)
    # what a mismatched host or flag would do
    manifest.spec = manifest.spec.model_copy(update={"batch_size": 2})
    with pytest.raises(NeuronctlError, match="no matching NEFF"):
        get_backend("tnx").load(outcome.path, manifest)


@pytest.mark.neuron
def test_real_sdk_build_load_decode(tiny_llama, tmp_path) -> None:
    pytest.importorskip("transformers_neuronx")
    outcome = compile_tnx(tiny_llama, tmp_path / "store", tp_degree=1, dtype="float32")
    runner = get_backend("tnx").load(outcome.path, read_manifest(outcome.path))
    assert runner.prefill(0, [1, 2, 3]).shape == (320,)


def vllm_tnx_neuron_config(tnx, spec, sampling_disabled: bool):
    """vLLM's TNx loader for `--max-num-seqs B --dtype D [--quantization neuron_quant]` and
    neuronctl's override, transcribed from upstreaming-to-vllm (dd417b3, same in the
    v0.6.x-neuron and neuron-2.24 v0.7.2 branches):
    model_loader/neuron.py _get_default_neuron_config (BSH layouts, fuse_qkv,
    ContinuousBatchingConfig(batch_size_for_shared_caches=max_num_seqs), quant via
    neuron_quant.py QuantizationConfig(quant_dtype=$NEURON_QUANT_DTYPE, dequant_dtype=amp,
    quantize_method="vector_dynamic"), weight_tiling=bool(quantization)),
    worker/neuron_model_runner.py _init_neuron_sampling (unless
    NEURON_ON_DEVICE_SAMPLING_DISABLED), then _get_neuron_config_after_override."""
    from neuronctl.backends.tnx.config import AMP, QUANT_DTYPE

    classes = tnx.config
    n = spec.batch_size
    sampling = None if sampling_disabled else classes.GenerationConfig(
        max_length=spec.seq_len, do_sample=True, per_batch_line=True, top_k=[256] * n,
        top_p=[1.0] * n, temperature=[1.0] * n, dynamic=True, global_top_k=256)
    quant = classes.QuantizationConfig(
        quant_dtype=QUANT_DTYPE[spec.quantization_dtype], dequant_dtype=AMP[spec.dtype],
        quantize_method="vector_dynamic") if spec.quantized else None
    default = dict(collectives_layout="BSH", attention_layout="BSH", fuse_qkv=True, quant=quant,
                   continuous_batching=classes.ContinuousBatchingConfig(
                       batch_size_for_shared_caches=n),
                   weight_tiling=spec.quantized, on_device_generation=sampling)
    override = json.loads(json.dumps(tnx_config.vllm_override(spec)))
    for key, cls_name in (("continuous_batching", "ContinuousBatchingConfig"),
                          ("quant", "QuantizationConfig"),
                          ("on_device_generation", "GenerationConfig")):
        value = override.pop(key, {})
        if value:
            override[key] = getattr(classes, cls_name)(**value)
    return tnx.NeuronConfig(**{**default, **override})


@pytest.mark.parametrize(
    "fields",
    [{}, {"quantized": True}, {"quantized": True, "quantization_dtype": "f8e4m3fn"},
     {"on_device_sampling": SAMPLING},
     {"override_neuron_config": {"sequence_parallel_norm": True,
                                 "continuous_batching": {"block_size": 128}}}],
    ids=["plain", "int8", "fp8", "sampling", "override"],
)
def test_compiled_neuron_config_is_the_one_vllm_builds(neuron_standins, fields: dict) -> None:
    """Same NeuronConfig -> same HLO -> vLLM's persistent-cache lookup finds neuronctl's
    NEFFs. Sampling off is NEURON_ON_DEVICE_SAMPLING_DISABLED=1 on the vLLM side."""
    from neuronctl.backends.tnx import make_neuron_config, sdk

    tnx = sdk()
    spec = spec_of(**fields)
    ours = make_neuron_config(tnx, spec).to_json()
    theirs = vllm_tnx_neuron_config(tnx, spec, sampling_disabled=spec.on_device_sampling is None)
    assert ours == theirs.to_json()


TNX_STANDIN_REJECTS = {
    # What the real transformers-neuronx configs reject (checked against its source).
    "per_tensor_symmetric": ("QuantizationConfig", {"quantize_method": "per_tensor_symmetric"},
                             NotImplementedError),
    "quant_dtype int8": ("QuantizationConfig", {"quant_dtype": "int8"}, NotImplementedError),
    "cb block_size": ("ContinuousBatchingConfig",
                      {"max_num_seqs": 4, "max_model_len": 2048, "block_size": 2048},
                      AssertionError),
    "cb without max_num_seqs": ("ContinuousBatchingConfig", {}, KeyError),
    "cb max_model_len None": ("ContinuousBatchingConfig",
                              {"max_num_seqs": 4, "max_model_len": None}, AssertionError),
    "global_topk": ("GenerationConfig", {"global_topk": 256}, TypeError),
    "padding_side middle": ("NeuronConfig", {"padding_side": "middle"}, AssertionError),
    "cast_logits_dtype bf16": ("NeuronConfig", {"cast_logits_dtype": "bf16"}, AssertionError),
    "unknown key": ("NeuronConfig", {"fuse_mlps": True}, AssertionError),
}


@pytest.mark.parametrize("label", list(TNX_STANDIN_REJECTS))
def test_standin_tnx_configs_reject_what_the_real_ones_reject(neuron_standins,
                                                             label: str) -> None:
    from neuronctl.backends.tnx import sdk

    cls_name, kwargs, error = TNX_STANDIN_REJECTS[label]
    with pytest.raises(error):
        getattr(sdk().config, cls_name)(**kwargs)


def test_standin_tnx_neuron_config_accepts_every_real_key(neuron_standins) -> None:
    from neuronctl.backends.tnx import sdk

    config = sdk().NeuronConfig(fuse_mlp=True, is_eagle_target=True, is_eagle_draft=False,
                                has_pre_attention_norm=False, duplicate_q_weight_sos=False,
                                compilation_worker_count=2, qkv_tiling=True, fuse_qkv=True)
    assert config.to_json()["fuse_mlp"] is True


def test_quantized_build_constructs_the_real_quantization_config(neuron_standins, tiny_llama,
                                                                  tmp_path) -> None:
    compile_tnx(tiny_llama, tmp_path / "store", quantized=True, quantization_dtype="f8e4m3fn")
    calls = dict(neuron_standins.CALLS)
    assert calls["QuantizationConfig"] == {"quant_dtype": "f8e4m3fn", "dequant_dtype": "f16",
                                           "quantize_method": "vector_dynamic"}
    assert calls["from_pretrained"]["neuron_config"]["weight_tiling"] is True


def test_on_device_sampling_build_and_load(neuron_standins, tiny_llama, tmp_path) -> None:
    """Compiled with vLLM's dynamic per-batch-line config; after load the spec's values are
    set per line with update_generation_config, and the runner reads token ids."""
    outcome = compile_tnx(tiny_llama, tmp_path / "store",
                          on_device_sampling={"do_sample": False, "top_k": 5, "dynamic": True})
    compiled = dict(neuron_standins.CALLS)["from_pretrained"]["neuron_config"]
    assert compiled["on_device_generation"]["top_k"] == [256] * 3
    neuron_standins.reset()
    runner = get_backend("tnx").load(outcome.path, read_manifest(outcome.path))
    update = dict(neuron_standins.CALLS)["update_generation_config"]
    assert update["top_k"] == [1] * 3 and update["dynamic"] and update["per_batch_line"]
    logits = runner.prefill(0, [4, 5])
    assert logits.shape == (320,) and int(logits.argmax()) == 6
