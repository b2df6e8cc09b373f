"""The vLLM launch is built from the artifact's manifest only: every value is the compiled one."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from neuronctl import vllm
from neuronctl.errors import UsageError
from neuronctl.spec import ModelShape, build_spec, finalize
from neuronctl.store.manifest import Manifest, Source, write_manifest

ARCH = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 320,
}


def make_manifest(backend: str = "nxdi", **fields: object) -> Manifest:
    # Non-default values everywhere, so a value taken from a default cannot pass.
    values: dict[str, object] = {
        "backend": backend,
        "tp_degree": 4,
        "batch_size": 3,
        "seq_len": 1024,
        "max_context_length": 512,
        "dtype": "float16",
        "context_buckets": [96, 512],
        "token_gen_buckets": [384, 1024],
        "override_neuron_config": {"fused_qkv": True},
        "cc_flags": "--model-type=transformer -O1",
    }
    values.update(fields)
    spec = finalize(build_spec(values), ModelShape(num_attention_heads=8, num_key_value_heads=4))
    return Manifest(
        backend=backend,
        backend_versions={"neuronx-cc": "2.15.0"},
        spec=spec.model_dump(mode="json"),
        keys={"graph_key": "g", "weights_key": "w", "artifact_key": "a" * 64},
        source=Source(model="org/model", digest="d"),
        architecture=ARCH,
    )


def flags(argv: list[str]) -> dict[str, str]:
    """--name value pairs of an argv."""
    out = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            out[arg[2:]] = argv[i + 1]
    return out


def test_nxdi_serve_argv_and_env_come_from_the_artifact(tmp_path: Path) -> None:
    launch = vllm.serve_launch(tmp_path, make_manifest(), port=9123, served_model_name="m")
    assert launch.argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    f = flags(launch.argv)
    assert f["model"] == str(tmp_path.resolve())
    assert f["device"] == "neuron"
    assert f["tensor-parallel-size"] == "4"
    assert f["max-num-seqs"] == "3"
    assert f["max-model-len"] == "1024"
    assert f["block-size"] == "1024"
    assert f["dtype"] == "float16"
    assert f["port"] == "9123"
    assert f["served-model-name"] == "m"
    override = json.loads(f["override-neuron-config"])
    assert override["tp_degree"] == 4
    assert override["batch_size"] == 3
    assert override["seq_len"] == 1024
    assert override["max_context_length"] == 512
    assert override["torch_dtype"] == "float16"
    assert override["context_encoding_buckets"] == [96, 512]
    assert override["token_generation_buckets"] == [384, 1024]
    assert override["fused_qkv"] is True
    assert override["save_sharded_checkpoint"] is True
    assert "quantization" not in f and "speculative-model" not in f
    assert launch.env == {
        "NEURON_COMPILED_ARTIFACTS": str(tmp_path.resolve()),
        "VLLM_NEURON_FRAMEWORK": "neuronx-distributed-inference",
        "NEURON_CONTEXT_LENGTH_BUCKETS": "96,512",
        "NEURON_TOKEN_GEN_BUCKETS": "384,1024",
        "NEURON_CC_FLAGS": "--model-type=transformer -O1",
    }


def test_tnx_serve_sets_quantization_and_compile_cache(tmp_path: Path) -> None:
    manifest = make_manifest(
        "tnx", quantized=True, quantization_dtype="f8e4m3fn", override_neuron_config={}
    )
    launch = vllm.serve_launch(tmp_path, manifest)
    f = flags(launch.argv)
    assert f["block-size"] == f["max-model-len"] == "1024"
    assert f["quantization"] == "neuron_quant"
    assert json.loads(f["override-neuron-config"]) == {"on_device_embedding": True}
    assert launch.env["VLLM_NEURON_FRAMEWORK"] == "transformers-neuronx"
    assert launch.env["NEURON_QUANT_DTYPE"] == "f8e4m3fn"
    cache = tmp_path.resolve() / "neuron-compile-cache"
    assert launch.env["NEURON_COMPILE_CACHE_URL"] == str(cache)
    assert launch.env["NEURON_TOKEN_GEN_BUCKETS"] == "384,1024"


def test_nxdi_quantized_int8_exports_s8_and_overrides(tmp_path: Path) -> None:
    launch = vllm.serve_launch(
        tmp_path,
        make_manifest(quantized=True, quantization_type="per_channel_symmetric"),
    )
    override = json.loads(flags(launch.argv)["override-neuron-config"])
    assert override["quantized"] is True
    assert override["quantization_dtype"] == "int8"
    assert override["quantization_type"] == "per_channel_symmetric"
    assert launch.env["NEURON_QUANT_DTYPE"] == "s8"
    # vLLM's --quantization is for TNx only; NxDI takes it from the neuron config (seed 002).
    assert "quantization" not in flags(launch.argv)


def test_speculation_flags(tmp_path: Path) -> None:
    manifest = make_manifest(draft_model="org/draft", num_speculative_tokens=5)
    f = flags(vllm.serve_launch(tmp_path, manifest).argv)
    assert f["speculative-model"] == "org/draft"
    assert f["num-speculative-tokens"] == "5"
    assert f["speculative-max-model-len"] == "1024"
    override = json.loads(f["override-neuron-config"])
    assert override["speculation_length"] == 5


def test_relative_artifact_path_is_made_absolute(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    env = vllm.env_exports(Path("art"), make_manifest())
    assert env["NEURON_COMPILED_ARTIFACTS"] == str(tmp_path.resolve() / "art")


def test_extra_args_are_appended(tmp_path: Path) -> None:
    launch = vllm.serve_launch(tmp_path, make_manifest(), extra_args=["--enforce-eager"])
    assert launch.argv[-1] == "--enforce-eager"


@pytest.mark.parametrize(
    ("backend", "framework", "ok"),
    [
        ("nxdi", None, "neuronx-distributed-inference"),
        ("nxdi", "nxdi", "neuronx-distributed-inference"),
        ("tnx", "transformers-neuronx", "transformers-neuronx"),
        ("nxdi", "tnx", None),
        ("tnx", "nxdi", None),
        ("torch", None, None),
        ("nxdi", "cuda", None),
    ],
)
def test_framework_for(backend: str, framework: str | None, ok: str | None) -> None:
    manifest = make_manifest(backend) if backend != "torch" else make_manifest("nxdi")
    manifest = manifest.model_copy(update={"backend": backend})
    if ok is None:
        with pytest.raises(UsageError):
            vllm.framework_for(manifest, framework)
    else:
        assert vllm.framework_for(manifest, framework) == ok


def test_generate_launch_runs_the_offline_program(tmp_path: Path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    launch = vllm.generate_launch(
        tmp_path, make_manifest("tnx", override_neuron_config={}), prompts, sampling={"top_k": 7}
    )
    assert launch.argv[:4] == [sys.executable, "-m", "neuronctl.vllm", "generate"]
    f = flags(launch.argv)
    engine = json.loads(f["engine-args"])
    assert engine["max_num_seqs"] == 3
    assert engine["block_size"] == engine["max_model_len"] == 1024
    assert engine["tensor_parallel_size"] == 4
    assert json.loads(f["sampling"]) == {"top_k": 7}
    assert f["prompts"] == str(prompts.resolve())
    assert launch.env["VLLM_NEURON_FRAMEWORK"] == "transformers-neuronx"


def test_read_prompts_text_and_jsonl(tmp_path: Path) -> None:
    text = tmp_path / "p.txt"
    text.write_text("a b\n\nc\n")
    assert vllm.read_prompts(text) == ["a b", "c"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "x"}\n"y"\n')
    assert vllm.read_prompts(jsonl) == ["x", "y"]


def test_vllm_dirname_follows_the_nxdi_config(tmp_path: Path) -> None:
    spec = vllm.artifact_spec(make_manifest())
    name, exact = vllm.vllm_dirname_exact(spec, ARCH)
    assert len(name) == 32 and int(name, 16) >= 0
    assert not exact  # no SDK here
    other = vllm.artifact_spec(make_manifest(batch_size=2))
    assert vllm.vllm_dirname(other, ARCH) != name
    assert vllm.vllm_dirname(spec, ARCH) == name


def test_env_exports_work_from_a_written_manifest(tmp_path: Path) -> None:
    from neuronctl.store.manifest import read_manifest

    write_manifest(tmp_path, make_manifest())
    env = vllm.env_exports(tmp_path, read_manifest(tmp_path), "nxdi")
    assert env["NEURON_CONTEXT_LENGTH_BUCKETS"] == "96,512"
