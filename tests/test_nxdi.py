"""nxdi backend contract tests against the SDK stand-ins (tests/standins), plus the same
scenario against the real SDK under the `neuron` marker."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pytest
import torch

from neuronctl.backends import get_backend
from neuronctl.backends.nxdi.config import neuron_config_kwargs
from neuronctl.errors import BackendUnavailableError, BuildError, SpecError
from neuronctl.spec import ModelShape, build_spec, finalize
from neuronctl.store.manifest import read_manifest
from tests import standins

neuron_standins = standins.neuron_standins  # the stand-in SDK fixture

SPEC = {
    "backend": "nxdi",
    "tp_degree": 2,
    "batch_size": 3,
    "seq_len": 256,
    "max_context_length": 128,
    "dtype": "bfloat16",
    "context_buckets": "64,128",
    "token_gen_buckets": "128,256",
}
SHAPE = ModelShape(num_attention_heads=4, num_key_value_heads=2)


def spec_of(**fields: object):
    return finalize(build_spec({**SPEC, **fields}), SHAPE)


BASE_KWARGS = {
    "tp_degree": 2,
    "batch_size": 3,
    "ctx_batch_size": 1,
    "seq_len": 256,
    "max_context_length": 128,
    "torch_dtype": "bfloat16",
    "enable_bucketing": True,
    "context_encoding_buckets": [64, 128],
    "token_generation_buckets": [128, 256],
    "is_continuous_batching": True,
    "padding_side": "right",
    # The default: what vLLM's NxDI loaders compile themselves (vLLM 0.9
    # model_loader/neuronx_distributed.py:599-600; vllm-neuron 4fac6b7 loader :1067-1069).
    "on_device_sampling_config": {
        "do_sample": False, "top_k": 1, "top_p": 1.0, "temperature": 1.0,
        "dynamic": True, "deterministic": False, "global_topk": 256},
    "quantized": False,
    "save_sharded_checkpoint": True,
}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, BASE_KWARGS),
        (
            # f8e4m3fn (the TNx / torch name) is accepted and becomes NxDI's f8e4m3: the
            # QuantizedDtype member every SDK has (F8E4M3FN only from 2.27).
            {"quantized": True, "quantization_dtype": "f8e4m3fn"},
            {**BASE_KWARGS, "quantized": True, "quantization_dtype": "f8e4m3",
             "quantization_type": "per_tensor_symmetric"},
        ),
        (
            {"draft_model": "org/draft", "num_speculative_tokens": 4},
            {**BASE_KWARGS, "speculation_length": 4, "enable_fused_speculation": True},
        ),
        (
            {"on_device_sampling": {"do_sample": True, "top_k": 20}},
            {**BASE_KWARGS, "on_device_sampling_config": {
                "do_sample": True, "top_k": 20, "top_p": 1.0, "temperature": 1.0,
                "dynamic": False, "deterministic": False, "global_topk": 256}},
        ),
        (
            {"override_neuron_config": {"fused_qkv": True, "enable_bucketing": False}},
            {**BASE_KWARGS, "fused_qkv": True, "enable_bucketing": False},
        ),
        ({"on_device_sampling": "off"}, {**BASE_KWARGS, "on_device_sampling_config": None}),
    ],
    ids=["plain", "quantized", "speculation", "on-device-sampling", "override", "sampling-off"],
)
def test_neuron_config_kwargs(fields: dict, expected: dict) -> None:
    assert neuron_config_kwargs(spec_of(**fields)) == expected


@pytest.mark.parametrize("key", ["tp_degree", "seq_len", "torch_dtype", "save_sharded_checkpoint"])
def test_override_cannot_contradict_the_spec(key: str) -> None:
    with pytest.raises(SpecError, match=key):
        neuron_config_kwargs(spec_of(override_neuron_config={key: 1}))


def test_missing_sdk_says_how_to_install() -> None:
    with pytest.raises(BackendUnavailableError) as err:
        get_backend("nxdi").versions()
    assert "pip.repos.neuron.amazonaws.com" in str(err.value)


def test_check_refuses_unknown_model_type() -> None:
    with pytest.raises(SpecError, match="gpt2"):
        get_backend("nxdi").check(spec_of(), {"model_type": "gpt2"})


def compile_nxdi(model: Path, store: Path, **fields: object):
    from neuronctl.build import compile_model, resolve_build

    flags = {**SPEC, "seq_len": 128, "max_context_length": 64, "context_buckets": "32,64",
             "token_gen_buckets": "64,128", **fields}
    build = resolve_build(str(model), flags, store_dir=store)
    return build, compile_model(build, jobs=1)


def test_build_publishes_what_nxdi_and_vllm_load(neuron_standins, tiny_llama, tmp_path) -> None:
    """What neuronctl passes the SDK and what it publishes of the SDK's output; the stand-in's
    own files and call order are the stand-in's, not asserted here."""
    build, outcome = compile_nxdi(tiny_llama, tmp_path / "store", cc_flags="-O1")
    rec = neuron_standins
    calls = dict(rec.CALLS)  # by name: what neuronctl passed each SDK entry point
    assert rec.names().count("compile") == 1
    assert calls["NeuronConfig"] == {**BASE_KWARGS, "seq_len": 128, "max_context_length": 64,
                                     "context_encoding_buckets": [32, 64],
                                     "token_generation_buckets": [64, 128]}
    assert calls["load_pretrained_config"] == str(tiny_llama)
    assert calls["init"] == {"cls": "NeuronLlamaForCausalLM", "model_path": str(tiny_llama)}
    path = outcome.path
    manifest = read_manifest(path)
    # Published is what that one compile wrote (the stand-in stamps its output directory into
    # model.pt), every file of it in the manifest, beside neuronctl's own copies.
    assert (path / "model.pt").read_bytes() == b"standin torchscript " + calls["compile"].encode()
    on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}
    assert set(manifest.files) == on_disk - {"manifest.json"}
    assert {"neuron_config.json", "model.pt", "config.json", "tokenizer.json",
            "weights/tp0_sharded_checkpoint.safetensors"} <= set(manifest.files)
    assert manifest.graphs == ["model.pt"]
    assert manifest.backend_versions == {
        "neuronx-cc": "2.99.0+standin",
        "neuronx-distributed-inference": "0.99.0+standin",
        "torch-neuronx": "2.99.0+standin",
    }
    assert manifest.host["NEURON_CC_FLAGS"] == "-O1"
    saved = json.loads((path / "neuron_config.json").read_text())
    assert saved["neuron_config"]["tp_degree"] == 2
    assert saved["model_type"] == "llama"  # HF attributes come through load_pretrained_config


def test_sdk_failure_publishes_nothing(neuron_standins, tiny_llama, tmp_path) -> None:
    neuron_standins.FAIL.add("compile")
    store = tmp_path / "store"
    with pytest.raises(BuildError, match="stand-in SDK failure in compile"):
        compile_nxdi(tiny_llama, store)
    root = store / "neuron-compiled-artifacts"
    assert [p.name for p in root.iterdir() if not p.name.startswith(".")] == []
    staging = root / ".staging"
    assert not staging.exists() or list(staging.iterdir()) == []


def test_load_and_run_through_the_runner(neuron_standins, tiny_llama, tmp_path) -> None:
    _build, outcome = compile_nxdi(tiny_llama, tmp_path / "store")
    neuron_standins.reset()
    runner = get_backend("nxdi").load(outcome.path, read_manifest(outcome.path))
    # load() rebuilds the NeuronConfig from neuron_config.json, as the real InferenceConfig.load,
    # and loads the published artifact (not the staging directory it was compiled in).
    calls = dict(neuron_standins.CALLS)
    assert "NeuronConfig" in calls and calls["load"] == str(outcome.path)
    assert "compile" not in calls
    assert runner.model.config.neuron_config.torch_dtype is torch.bfloat16
    assert (runner.batch_size, runner.seq_len, runner.max_context_length) == (3, 128, 64)
    logits = runner.prefill(1, [5, 6, 7])
    assert logits.shape == (320,) and int(logits.argmax()) == 8
    call = neuron_standins.CALLS[-1][1]
    assert call["seq_ids"] == [1] and call["position_ids"] == [[0, 1, 2]]
    out = runner.decode([10, 20, 30], [3, -1, 5])
    assert out.shape == (3, 320)
    assert int(out[0].argmax()) == 11 and int(out[2].argmax()) == 31
    call = neuron_standins.CALLS[-1][1]
    # Slot 1 is idle: its row goes to its own next free position (3, after the prefill).
    assert call["seq_ids"] == [0, 1, 2] and call["position_ids"] == [[3], [3], [5]]
    assert call["mask"] == [3, 6]


def test_last_logits_reads_both_output_kinds() -> None:
    """What the nxdi and tnx runners hand the engine from a model's output: with on-device
    sampling the output is token ids, turned into one-hot rows the engine's greedy pick
    follows; otherwise the last position's logits, cut to the vocabulary, as float32."""
    from neuronctl.backends.neuron import last_logits

    sampled = last_logits(torch.tensor([[4], [1]]), 2, 6, sampled=True)
    assert sampled.shape == (2, 6) and sampled.argmax(-1).tolist() == [4, 1]
    assert sampled[0, 4] == 0 and bool(torch.isinf(sampled[0, 0]))
    padded = torch.arange(2 * 3 * 8, dtype=torch.bfloat16).reshape(2, 3, 8)
    got = last_logits(padded, 2, 6, sampled=False)
    assert got.dtype == torch.float32 and torch.equal(got, padded[:, -1, :6].float())


def test_runner_never_writes_into_a_live_slot(neuron_standins, tiny_llama, tmp_path) -> None:
    """Runner.decode's invariant (backends/base.py): the engine prefills a newly admitted slot
    and decodes the older ones in the same step, passing the new slot as idle (-1). The
    compiled batch writes every row (NxDI pads a short batch into the other slots:
    models/model_wrapper.py `_forward_with_pad`, v0.5.9230 :552-660), so the idle row must
    land past that slot's prompt, as NxDI parks its own inactive rows
    (modules/kvcache/kv_cache_manager.py :465-513, `garbage_pos`)."""
    from tests.fake_runner import KvCache, decode_beside_a_fresh_prefill

    _build, outcome = compile_nxdi(tiny_llama, tmp_path / "store")
    runner = get_backend("nxdi").load(outcome.path, read_manifest(outcome.path))
    neuron_standins.KV = kv = KvCache(runner.batch_size, runner.seq_len)
    decode_beside_a_fresh_prefill(runner, kv)
    assert kv.writes == 3 * runner.batch_size  # every row of every decode reached the cache


def test_kv_cache_model_fails_any_write_into_a_history() -> None:
    """The KV model FakeRunner and the stand-ins share: a write inside a slot's history fails,
    one at or past its next free position does not (and does not extend it), a full slot
    holds nothing that can still be decoded."""
    from tests.fake_runner import KvCache

    kv = KvCache(batch_size=2, seq_len=8)
    kv.prefill(0, [1, 2, 3])
    with pytest.raises(AssertionError, match="replaces a token of the 3-token sequence"):
        kv.write(0, 2)
    kv.write(0, 3)
    kv.write(0, 7)
    kv.write(1, 0)  # an empty slot
    kv.append(0, 3, 9)
    assert kv.history[0] == [1, 2, 3, 9]
    with pytest.raises(AssertionError, match="write at 5, but 4 filled"):
        kv.append(0, 5, 9)
    kv.prefill(1, list(range(8)))
    kv.write(1, 7)  # full: its sequence cannot decode any further


def test_load_refuses_an_incomplete_artifact(neuron_standins, tiny_llama, tmp_path) -> None:
    _build, outcome = compile_nxdi(tiny_llama, tmp_path / "store")
    (outcome.path / "weights/tp1_sharded_checkpoint.safetensors").unlink()
    with pytest.raises(Exception, match="tp1_sharded_checkpoint"):
        get_backend("nxdi").load(outcome.path, read_manifest(outcome.path))


def test_env_and_vllm_launch_on_a_built_artifact(neuron_standins, tiny_llama, tmp_path) -> None:
    from neuronctl.vllm.launch import serve_launch

    _build, outcome = compile_nxdi(tiny_llama, tmp_path / "store")
    launch = serve_launch(outcome.path, read_manifest(outcome.path))
    assert launch.env["NEURON_COMPILED_ARTIFACTS"] == str(outcome.path.resolve())
    assert "--tensor-parallel-size" in launch.argv


@pytest.mark.neuron
def test_real_sdk_build_load_decode(tiny_llama, tmp_path) -> None:
    pytest.importorskip("neuronx_distributed_inference")
    _build, outcome = compile_nxdi(tiny_llama, tmp_path / "store", tp_degree=1, dtype="float32")
    runner = get_backend("nxdi").load(outcome.path, read_manifest(outcome.path))
    logits = runner.prefill(0, [1, 2, 3])
    assert logits.shape == (320,)
    assert runner.decode([4, 0, 0], [3, -1, -1]).shape == (3, 320)


def test_quantized_build_quantizes_into_a_scratch_directory(
    neuron_standins, tiny_llama, tmp_path
) -> None:
    """NxDI torch.save()s ONE FILE at quantized_checkpoints_path unless it is an existing
    directory (application_base.save_quantized_state_dict); the scratch must be a directory
    and must not outlive the build, file or directory."""
    store = tmp_path / "store"
    _build, outcome = compile_nxdi(tiny_llama, store, quantized=True,
                                   quantization_dtype="f8e4m3fn")
    calls = dict(neuron_standins.CALLS)
    saved = calls["save_quantized_state_dict"]
    assert saved["is_dir"] is True
    assert calls["NeuronConfig"]["quantized_checkpoints_path"] == saved["path"]
    assert calls["NeuronConfig"]["quantization_dtype"] == "f8e4m3"
    assert not Path(saved["path"]).exists()
    leftovers = [p.name for p in (store / "neuron-compiled-artifacts").rglob("*.quantized")]
    assert leftovers == []
    loaded = json.loads((outcome.path / "neuron_config.json").read_text())["neuron_config"]
    assert (loaded["quantized"], loaded["quantization_dtype"]) == (True, "f8e4m3")


def test_quantized_scratch_left_as_a_file_is_removed(neuron_standins, tiny_llama, tmp_path,
                                                      monkeypatch) -> None:
    """Even an SDK that writes a file there (an older one, or a path it replaced) leaves
    nothing behind."""
    from neuronctl.backends import nxdi

    def save_as_file(cls, model_path, config):
        path = config.neuron_config.quantized_checkpoints_path
        Path(path).rmdir()
        Path(path).write_bytes(b"torch.save")

    base = __import__("neuronx_distributed_inference.models.base", fromlist=["x"])
    monkeypatch.setattr(base.StandinForCausalLM, "save_quantized_state_dict",
                        classmethod(save_as_file))
    store = tmp_path / "store"
    compile_nxdi(tiny_llama, store, quantized=True)
    assert list((store / "neuron-compiled-artifacts").rglob("*.quantized")) == []
    assert nxdi.remove_path(tmp_path / "absent") is None


@pytest.mark.parametrize(
    ("model_type", "config_cls"),
    [("llama", "NeuronConfig"), ("mistral", "NeuronConfig"), ("mixtral", "MoENeuronConfig"),
     ("dbrx", "NeuronDbrxConfig"), ("qwen2", "Qwen2NeuronConfig")],
)
def test_neuron_config_class_is_the_one_the_model_asks_for(
    neuron_standins, model_type: str, config_cls: str
) -> None:
    """InferenceConfig.load rebuilds neuron_config with get_neuron_config_cls(); building
    another class compiles something load() does not describe (DBRX forces fused_qkv)."""
    from neuronctl.backends.nxdi import sdk

    config = sdk.neuron_config(model_type, neuron_config_kwargs(spec_of()))
    assert type(config).__name__ == config_cls
    if model_type == "dbrx":
        assert config.fused_qkv is True


def test_mistral_uses_the_llama_classes(neuron_standins) -> None:
    from neuronctl.backends.nxdi import sdk

    model_cls, config_cls = sdk.model_classes("mistral")
    assert (model_cls.__name__, config_cls.__name__) == (
        "NeuronLlamaForCausalLM", "LlamaInferenceConfig")


def test_gemma3_is_keyed_by_its_hf_model_type() -> None:
    """transformers' Gemma3ForCausalLM config says model_type "gemma3_text"."""
    get_backend("nxdi").check(spec_of(), {"model_type": "gemma3_text"})
    with pytest.raises(SpecError):
        get_backend("nxdi").check(spec_of(), {"model_type": "gemma3"})


def test_model_class_missing_from_this_sdk_names_the_upgrade(neuron_standins) -> None:
    from neuronctl.backends.nxdi import sdk

    with pytest.raises(BackendUnavailableError, match="gemma3_text") as err:
        sdk.model_classes("gemma3_text")
    assert "upgrade neuronx-distributed-inference" in err.value.hint


@pytest.mark.parametrize("name", ["plain", "sampling", "quantized", "speculation"])
def test_build_kwargs_construct_without_warnings_and_keep_types(
    neuron_standins, caplog, name: str
) -> None:
    """The stand-in keeps the real types; neuronctl's kwargs are all real keys."""
    from neuronctl.backends.nxdi import sdk

    fields = {
        "plain": {},
        "sampling": {"on_device_sampling": {"do_sample": True, "top_k": 20, "dynamic": True}},
        "quantized": {"quantized": True, "quantization_type": "per_channel_symmetric"},
        "speculation": {"draft_model": "org/draft", "num_speculative_tokens": 4},
    }[name]
    kwargs = neuron_config_kwargs(spec_of(**fields))
    if "quantized" in fields:
        kwargs["quantized_checkpoints_path"] = "/scratch"
    with caplog.at_level("WARNING"):
        config = sdk.neuron_config("llama", kwargs)
    assert "Unexpected keyword" not in caplog.text
    assert config.torch_dtype is torch.bfloat16
    if name == "sampling":
        ods = config.on_device_sampling_config
        assert type(ods).__name__ == "OnDeviceSamplingConfig"
        assert (ods.do_sample, ods.top_k, ods.dynamic, ods.global_topk) == (True, 20, True, 256)


STANDIN_REJECTS = {
    # What the real NeuronConfig (NxDI 0.5, SDK 2.25) rejects (checked against its source).
    "quantized without quantized_checkpoints_path": ({"quantized": True}, AssertionError),
    "torch_dtype='bf16'": ({"torch_dtype": "bf16"}, AssertionError),
    "context bucket > max_context_length": (
        {"enable_bucketing": True, "context_encoding_buckets": [512, 2048]}, AssertionError),
    "token bucket > seq_len": ({"token_generation_buckets": [4096]}, AssertionError),
    "quantization_dtype='s4'": (
        {"quantized": True, "quantized_checkpoints_path": "/x",
         "quantization_dtype": "s4"}, AssertionError),
    "tp_degree 3 with attention_dp_degree 2": (
        {"tp_degree": 3, "attention_dp_degree": 2, "is_continuous_batching": True}, ValueError),
}
STANDIN_BASE = {"tp_degree": 2, "batch_size": 4, "seq_len": 2048, "max_context_length": 1024}


@pytest.mark.parametrize("label", list(STANDIN_REJECTS))
def test_standin_neuron_config_rejects_what_the_real_one_rejects(neuron_standins,
                                                                 label: str) -> None:
    config_mod = __import__("neuronx_distributed_inference.models.config", fromlist=["x"])
    extra, error = STANDIN_REJECTS[label]
    with pytest.raises(error):
        config_mod.NeuronConfig(**{**STANDIN_BASE, **extra})


def test_standin_accepts_f8e4m3fn_as_sdk_2_27_does(neuron_standins) -> None:
    """neuronx_distributed's QuantizedDtype gains F8E4M3FN at SDK 2.27 (the SDK of vllm-neuron
    0.2.2+; NxDI main models/config.py:696 asks `QuantizedDtype.has_dtype`), as the
    newest sources do."""
    config_mod = __import__("neuronx_distributed_inference.models.config", fromlist=["x"])
    config = config_mod.NeuronConfig(**STANDIN_BASE, quantized=True,
                                     quantized_checkpoints_path="/x",
                                     quantization_dtype="f8e4m3fn")
    assert config.quantization_dtype == "f8e4m3fn"


def test_standin_neuron_config_warns_on_unknown_keys_and_keeps_types(neuron_standins,
                                                                     caplog) -> None:
    config_mod = __import__("neuronx_distributed_inference.models.config", fromlist=["x"])
    with caplog.at_level("WARNING"):
        config = config_mod.NeuronConfig(**STANDIN_BASE, tp=2, torch_dtype="bfloat16",
                                         on_device_sampling_config={"top_k": 5})
    assert "Unexpected keyword arguments: {'tp': 2}" in caplog.text
    assert not hasattr(config, "tp")
    assert config.torch_dtype is torch.bfloat16
    assert isinstance(config.on_device_sampling_config, config_mod.OnDeviceSamplingConfig)
    assert config.on_device_sampling_config.top_k == 5


def test_neuron_config_json_round_trips_with_real_types(neuron_standins, tiny_llama,
                                                        tmp_path) -> None:
    """What compile() writes, load() rebuilds: dtype names -> torch.dtype, the sampling dict ->
    OnDeviceSamplingConfig, identical JSON after the round trip."""
    _build, outcome = compile_nxdi(
        tiny_llama, tmp_path / "store",
        on_device_sampling={"do_sample": True, "top_k": 20, "dynamic": True})
    modeling = __import__("neuronx_distributed_inference.models.llama.modeling_llama",
                          fromlist=["x"])
    text = (outcome.path / "neuron_config.json").read_text()
    assert json.loads(text)["neuron_config"]["torch_dtype"] == "bfloat16"
    back = modeling.LlamaInferenceConfig.load(str(outcome.path))
    assert back.neuron_config.torch_dtype is torch.bfloat16
    assert type(back.neuron_config.on_device_sampling_config).__name__ == \
        "OnDeviceSamplingConfig"
    assert back.to_json_string() + "\n" == text


@pytest.mark.parametrize("ours", ["--ours", None])
def test_the_compile_sees_the_spec_flags_and_the_process_keeps_its_own(
    neuron_standins, tiny_llama, tmp_path, monkeypatch, ours
) -> None:
    """NEURON_CC_FLAGS is part of the key and NxD Inference compiles in this process: it sees
    the spec's flags while it compiles, and this process's own value (or none) after."""
    if ours is None:
        monkeypatch.delenv("NEURON_CC_FLAGS", raising=False)
    else:
        monkeypatch.setenv("NEURON_CC_FLAGS", ours)
    application = importlib.import_module("neuronx_distributed_inference.models.base")
    seen = []
    real_compile = application.StandinForCausalLM.compile

    def compile(self, path: str) -> None:
        seen.append(os.environ.get("NEURON_CC_FLAGS"))
        real_compile(self, path)

    monkeypatch.setattr(application.StandinForCausalLM, "compile", compile)
    compile_nxdi(tiny_llama, tmp_path / "store", cc_flags="-O1")
    assert seen == ["-O1"]
    assert os.environ.get("NEURON_CC_FLAGS") == ours
