"""tnx backend contract tests against the SDK stand-ins, plus the real SDK under `neuron`."""

from __future__ import annotations

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


def test_from_pretrained_and_neuron_config_kwargs() -> None:
    spec = spec_of(quantized=True, on_device_sampling={"top_k": 5, "global_topk": 64},
                   override_neuron_config={"fuse_qkv": True})
    assert tnx_config.from_pretrained_kwargs(spec) == {
        "batch_size": 3, "tp_degree": 2, "n_positions": [64, 128],
        "context_length_estimate": [32, 64], "amp": "f16",
    }
    assert tnx_config.neuron_config_kwargs(spec) == {
        "continuous_batching": {"max_num_seqs": 3, "max_model_len": 128},
        "on_device_embedding": True,
        "quant": {"quant_dtype": "s8", "dequant_dtype": "f16",
                  "quantize_method": "per_tensor_symmetric"},
        "on_device_generation": {"max_length": 128, "do_sample": False, "top_k": 5,
                                 "top_p": 1.0, "temperature": 1.0, "global_top_k": 64,
                                 "dynamic": False, "deterministic": False},
        "fuse_qkv": True,
    }


@pytest.mark.parametrize(
    ("fields", "config", "match"),
    [
        ({"override_neuron_config": {"continuous_batching": {"block_size": 8}}}, LLAMA,
         "block_size"),
        ({"token_gen_buckets": "64"}, LLAMA, "must equal seq_len"),
        ({}, {"model_type": "qwen2"}, "qwen2"),
        ({"cc_flags": "--cache_dir=/tmp/x"}, LLAMA, "cache_dir"),
    ],
    ids=["block-size-not-max-model-len", "short-last-bucket", "unsupported-model", "cache-dir"],
)
def test_check_refuses(fields: dict, config: dict, match: str) -> None:
    with pytest.raises(SpecError, match=match):
        get_backend("tnx").check(spec_of(**fields), config)


def test_block_size_equal_to_seq_len_is_accepted() -> None:
    spec = spec_of(override_neuron_config={"continuous_batching": {"block_size": 128}})
    get_backend("tnx").check(spec, LLAMA)


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
    assert call["neuron_config"] == {
        "continuous_batching": {"max_num_seqs": 3, "max_model_len": 128},
        "on_device_embedding": True,
    }
    staging_cache = rec.CALLS[3][1]["cache"]
    assert staging_cache.endswith("/neuron-compile-cache") and ".staging" in staging_cache
    assert rec.CALLS[4][1]["sharded_weights"] is True
    path = outcome.path
    manifest = read_manifest(path)
    neffs = sorted(p.name for p in path.glob("*.neff"))
    assert len(neffs) == 1 and manifest.graphs == neffs
    assert any(name.startswith("neuron-compile-cache/") for name in manifest.files)
    # TNx's own config.json (pre-sharded flag) is kept, the tokenizer is copied beside it.
    assert '"is_presharded_checkpoint": true' in (path / "config.json").read_text()
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
