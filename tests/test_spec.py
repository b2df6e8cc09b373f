"""The build spec: precedence, provenance, and every refusal names the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from neuronctl.errors import SpecError
from neuronctl.spec import BuildSpec, ModelShape, auto_buckets, finalize, resolve_spec

SHAPE = ModelShape(num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "neuronctl.toml"
    path.write_text(text)
    return path


def test_precedence_flag_over_file_over_env_over_default(tmp_path: Path) -> None:
    cfg = write_toml(tmp_path, "seq_len = 512\nbatch_size = 4\ncontext_buckets = [128, 256]\n")
    env = {"NEURON_CONTEXT_LENGTH_BUCKETS": "64", "NEURON_TOKEN_GEN_BUCKETS": "256,512"}
    spec, sources = resolve_spec({"batch_size": 8}, cfg, env)
    assert spec.batch_size == 8 and sources["batch_size"] == "flag"
    assert spec.seq_len == 512 and sources["seq_len"] == f"file:{cfg}"
    assert spec.context_buckets == [128, 256] and sources["context_buckets"] == f"file:{cfg}"
    assert spec.token_gen_buckets == [256, 512] and sources["token_gen_buckets"] == "env"
    assert spec.tp_degree == 1 and sources["tp_degree"] == "default"


def test_env_maps_vllm_names() -> None:
    env = {
        "VLLM_NEURON_FRAMEWORK": "transformers-neuronx",
        "NEURON_QUANT_DTYPE": "s8",
        "NEURON_CC_FLAGS": "--auto-cast=none",
    }
    spec, _ = resolve_spec({}, None, env)
    assert spec.backend == "tnx"
    assert spec.cc_flags == "--auto-cast=none"
    assert spec.compiler is None  # meaningless outside the torch backend


@pytest.mark.parametrize(
    ("flags", "env", "field"),
    [
        ({"context_buckets": "256,128"}, {}, "context_buckets"),
        ({"context_buckets": "64,64"}, {}, "context_buckets"),
        ({"seq_len": 128, "token_gen_buckets": "64,256"}, {}, "token_gen_buckets"),
        ({"seq_len": 128, "max_context_length": 256}, {}, "seq_len"),
        ({"dtype": "float8"}, {}, "dtype"),
        ({"override_neuron_config": "{not json"}, {}, "override_neuron_config"),
        ({"override_neuron_config": "[1, 2]"}, {}, "override_neuron_config"),
        ({}, {"NEURON_TOKEN_GEN_BUCKETS": "128,big"}, "NEURON_TOKEN_GEN_BUCKETS"),
        ({}, {"NEURON_QUANT_DTYPE": "int4"}, "NEURON_QUANT_DTYPE"),
        ({}, {"VLLM_NEURON_FRAMEWORK": "tensorrt"}, "VLLM_NEURON_FRAMEWORK"),
        ({"tp_degree": 0}, {}, "tp_degree"),
        ({"num_speculative_tokens": 4}, {}, "num_speculative_tokens"),
        ({"backend": "torch", "draft_model": "d", "num_speculative_tokens": 2}, {}, "backend"),
    ],
)
def test_invalid_values_are_refused_naming_the_field(flags, env, field) -> None:
    with pytest.raises(SpecError) as info:
        resolve_spec(flags, None, env)
    assert info.value.field == field
    assert field in str(info.value)


def test_unknown_toml_key_is_refused_with_the_known_keys(tmp_path: Path) -> None:
    cfg = write_toml(tmp_path, "seq_length = 512\n")
    with pytest.raises(SpecError, match="unknown key 'seq_length'") as info:
        resolve_spec({}, cfg, {})
    assert "seq_len" in (info.value.hint or "")


def test_malformed_toml_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="not valid TOML"):
        resolve_spec({}, write_toml(tmp_path, "seq_len = = 3"), {})


def test_toml_accepts_dashed_keys(tmp_path: Path) -> None:
    spec, _ = resolve_spec({}, write_toml(tmp_path, "tp-degree = 2\n"), {})
    assert spec.tp_degree == 2


def test_finalize_fills_auto_from_the_model() -> None:
    spec, _ = resolve_spec({"seq_len": 1024, "max_context_length": 512}, None, {})
    shape = SHAPE.model_copy(update={"dtype": "float16"})
    final = finalize(spec, shape)
    assert final.dtype == "float16"
    assert final.context_buckets == [128, 256, 512]
    assert final.token_gen_buckets == [128, 256, 512, 1024]


def test_auto_buckets_follow_nxdi() -> None:
    assert auto_buckets(64) == [64]
    assert auto_buckets(128) == [128]
    assert auto_buckets(300) == [128, 256, 300]


@pytest.mark.parametrize("tp", [3, 16])
def test_tp_that_does_not_divide_heads_is_refused(tp: int) -> None:
    spec, _ = resolve_spec({"tp_degree": tp}, None, {})
    with pytest.raises(SpecError, match="tp_degree") as info:
        finalize(spec, SHAPE)
    assert "attention heads" in str(info.value) or "KV heads" in str(info.value)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tp_over_kv_heads_replicates_them(tp: int) -> None:
    spec, _ = resolve_spec({"tp_degree": tp, "backend": "nxdi"}, None, {})
    assert finalize(spec, SHAPE).tp_degree == tp


def test_seq_len_over_max_positions_is_refused() -> None:
    spec, _ = resolve_spec({"seq_len": 8192}, None, {})
    with pytest.raises(SpecError, match="max_position_embeddings"):
        finalize(spec, SHAPE)


@pytest.mark.parametrize("kind", ["directory", "binary"])
def test_unreadable_config_file_is_a_spec_error_not_a_crash(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "cfg"
    if kind == "directory":
        path.mkdir()
    else:
        path.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(SpecError, match="cannot read the config file"):
        resolve_spec({}, path)


NEW_FIELD_PROBE = '''
import json, sys
from pathlib import Path

from neuronctl.keys import compute_keys
from neuronctl.spec import ModelShape, finalize, resolve_spec
from neuronctl.store.manifest import Manifest, Source, read_manifest, write_manifest
from neuronctl.validate import check_spec

shape = ModelShape(num_attention_heads=4, num_key_value_heads=2)
config = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2}
out = {}
for value in (1.0, 2.0):
    spec, _ = resolve_spec({"rope_scaling": value}, env={})
    spec = finalize(spec, shape)
    keys = compute_keys(spec, config, {"torch": "x"}, "d" * 64)
    out[str(value)] = keys.graph
root = Path(sys.argv[1])
manifest = Manifest(
    backend="torch", backend_versions={"torch": "x"}, spec=spec, keys=keys,
    source=Source(digest="d" * 64), architecture=config,
)
write_manifest(root, manifest)
read = read_manifest(root)
out["read_back"] = read.spec.rope_scaling
requested, sources = resolve_spec({"rope_scaling": 1.0}, env={})
out["checks"] = {c.name: c.ok for c in check_spec(read, requested, sources)}
print(json.dumps(out))
'''


def test_a_new_spec_field_touches_only_spec_py(tmp_path: Path) -> None:
    """Add a graph-changing field by editing spec.py alone (a copy of the package): the keys,
    the manifest round trip and validate's spec comparison all carry it, with no other edit."""
    import json
    import shutil
    import subprocess
    import sys

    import neuronctl

    package = tmp_path / "src" / "neuronctl"
    shutil.copytree(Path(neuronctl.__file__).parent, package)
    spec_py = package / "spec.py"
    text = spec_py.read_text()
    field = '    cc_flags: str = ""\n'
    text = text.replace(field, field + "    rope_scaling: float = 1.0\n", 1)
    text = text.replace('    "cc_flags",\n)', '    "cc_flags",\n    "rope_scaling",\n)', 1)
    assert "rope_scaling" in text and text.count("rope_scaling") == 2
    spec_py.write_text(text)
    (tmp_path / "artifact").mkdir()
    result = subprocess.run(
        [sys.executable, "-c", NEW_FIELD_PROBE, str(tmp_path / "artifact")],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(tmp_path / "src"), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,  # `-c` puts the cwd first on sys.path: not the source tree
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["1.0"] != out["2.0"]  # the graph key covers it
    assert out["read_back"] == 2.0  # the typed manifest carries it
    assert out["checks"]["spec.rope_scaling"] is False  # validate compares it


@pytest.mark.parametrize(
    "given, dtype",
    [("half", "float16"), ("fp16", "float16"), ("float", "float32"), ("bf16", "bfloat16"),
     ("float32", "float32"), ("bfloat16", "bfloat16"), ("auto", "auto")],
)  # fmt: skip
def test_vllm_dtype_spellings_name_the_same_spec(given: str, dtype: str) -> None:
    """vLLM's --dtype takes auto, half, float16, bfloat16, float, float32 (vllm/config/model.py
    ModelDType); an alias is the same spec, so the same keys and artifact."""
    assert BuildSpec(dtype=given).dtype == dtype  # type: ignore[arg-type]
    assert BuildSpec(dtype=given) == BuildSpec(dtype=dtype)  # type: ignore[arg-type]
