"""nxdi backend contract tests against the SDK stand-ins (tests/standins), plus the same
scenario against the real SDK under the `neuron` marker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
    "on_device_sampling_config": None,
    "quantized": False,
    "save_sharded_checkpoint": True,
}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, BASE_KWARGS),
        (
            {"quantized": True, "quantization_dtype": "f8e4m3fn"},
            {**BASE_KWARGS, "quantized": True, "quantization_dtype": "f8e4m3fn",
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
    ],
    ids=["plain", "quantized", "speculation", "on-device-sampling", "override"],
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
    build, outcome = compile_nxdi(tiny_llama, tmp_path / "store", cc_flags="-O1")
    rec = neuron_standins
    assert rec.names() == ["load_pretrained_config", "NeuronConfig", "init", "compile"]
    neuron_kwargs = rec.CALLS[1][1]
    assert neuron_kwargs == {**BASE_KWARGS, "seq_len": 128, "max_context_length": 64,
                             "context_encoding_buckets": [32, 64],
                             "token_generation_buckets": [64, 128]}
    assert rec.CALLS[0][1] == str(tiny_llama)
    assert rec.CALLS[2][1] == {"cls": "NeuronLlamaForCausalLM", "model_path": str(tiny_llama)}
    path = outcome.path
    manifest = read_manifest(path)
    for name in ("neuron_config.json", "model.pt", "config.json", "tokenizer.json",
                 "weights/tp0_sharded_checkpoint.safetensors",
                 "weights/tp1_sharded_checkpoint.safetensors"):
        assert (path / name).is_file(), name
        assert name in manifest.files
    assert not (path / "weights/tp2_sharded_checkpoint.safetensors").exists()
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
    assert neuron_standins.names() == ["init", "load"]
    assert neuron_standins.CALLS[1][1] == str(outcome.path)
    assert (runner.batch_size, runner.seq_len, runner.max_context_length) == (3, 128, 64)
    logits = runner.prefill(1, [5, 6, 7])
    assert logits.shape == (320,) and int(logits.argmax()) == 8
    call = neuron_standins.CALLS[-1][1]
    assert call["seq_ids"] == [1] and call["position_ids"] == [[0, 1, 2]]
    out = runner.decode([10, 20, 30], [3, -1, 5])
    assert out.shape == (3, 320)
    assert int(out[0].argmax()) == 11 and int(out[2].argmax()) == 31
    call = neuron_standins.CALLS[-1][1]
    assert call["seq_ids"] == [0, 1, 2] and call["position_ids"] == [[3], [0], [5]]


def test_load_refuses_an_incomplete_artifact(neuron_standins, tiny_llama, tmp_path) -> None:
    _build, outcome = compile_nxdi(tiny_llama, tmp_path / "store")
    (outcome.path / "weights/tp1_sharded_checkpoint.safetensors").unlink()
    with pytest.raises(Exception, match="tp1_sharded_checkpoint"):
        get_backend("nxdi").load(outcome.path, read_manifest(outcome.path))


def test_env_and_vllm_launch_on_a_built_artifact(neuron_standins, tiny_llama, tmp_path) -> None:
    from neuronctl import vllm

    _build, outcome = compile_nxdi(tiny_llama, tmp_path / "store")
    launch = vllm.serve_launch(outcome.path, read_manifest(outcome.path))
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
