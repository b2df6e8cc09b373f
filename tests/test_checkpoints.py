"""Checkpoint reading, bad inputs, the architecture registry, content digests, `inspect`."""

from __future__ import annotations

import ast
import json
import logging
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

import neuronctl.checkpoints
from neuronctl.checkpoints import digest as digest_mod
from neuronctl.checkpoints import open_checkpoint
from neuronctl.checkpoints.registry import check_supported, supported_backends
from neuronctl.errors import CheckpointError, NotFoundError, UsageError
from tests.helpers import cli, cli_in_process, make_checkpoint


@pytest.fixture(scope="module")
def sharded_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("idx") / "m", "qwen2", sharded=True)


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_reads_config_shape_and_tensors(tiny_llama: Path) -> None:
    ckpt = open_checkpoint(str(tiny_llama))
    assert ckpt.revision is None and ckpt.path == tiny_llama
    assert ckpt.architecture == "LlamaForCausalLM"
    shape = ckpt.shape()
    assert (shape.num_attention_heads, shape.num_key_value_heads) == (4, 2)
    assert (shape.max_position_embeddings, shape.dtype) == (512, "float32")
    assert [p.name for p in ckpt.weight_files()] == ["model.safetensors"]
    assert "model.layers.0.self_attn.q_proj.weight" in ckpt.tensor_names()
    t = ckpt.tensor("model.layers.0.self_attn.q_proj.weight")
    assert t.shape == (64, 64) and t.dtype == torch.float32


def test_index_sharded_checkpoint_lists_every_tensor(sharded_ckpt: Path) -> None:
    ckpt = open_checkpoint(str(sharded_ckpt))
    index = json.loads((sharded_ckpt / "model.safetensors.index.json").read_text())
    assert set(ckpt.tensor_names()) == set(index["weight_map"])
    assert len(ckpt.weight_files()) > 1
    name = "model.layers.1.self_attn.k_proj.bias"
    assert ckpt.tensor(name).shape == ckpt.tensor_info(name).shape


def test_legacy_torch_dtype_and_default_kv_heads(tiny_llama: Path, tmp_path: Path) -> None:
    path = copy(tiny_llama, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["torch_dtype"] = config.pop("dtype")
    del config["num_key_value_heads"]
    (path / "config.json").write_text(json.dumps(config))
    shape = open_checkpoint(str(path)).shape()
    assert shape.dtype == "float32" and shape.num_key_value_heads == 4


def test_missing_config(tiny_llama: Path, tmp_path: Path) -> None:
    path = copy(tiny_llama, tmp_path / "m")
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="has no config.json"):
        open_checkpoint(str(path))


def test_truncated_safetensors(tiny_llama: Path, tmp_path: Path) -> None:
    path = copy(tiny_llama, tmp_path / "m")
    weights = path / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 100)
    with pytest.raises(CheckpointError, match="does not match its header: truncated") as info:
        open_checkpoint(str(path))
    assert_one_line(info.value, weights)
    os.truncate(weights, 5)
    with pytest.raises(CheckpointError, match="shorter than a safetensors header") as info:
        open_checkpoint(str(path))
    assert_one_line(info.value, weights)


def write_with_header(path: Path, header: bytes, body: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + body)


@pytest.mark.parametrize(
    ("header", "body", "why"),
    [
        (b"{not json}", b"", "invalid JSON in header"),
        (b"[1, 2]", b"", "invalid JSON in header"),
        (b'{"w": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}}', b"0000", "Q7"),
        (b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}', b"0000", "invalid"),
    ],
    ids=["not-json", "not-an-object", "unknown-dtype", "shape-vs-offsets"],
)
def test_damaged_safetensors_header(
    tiny_llama: Path, tmp_path: Path, header: bytes, body: bytes, why: str
) -> None:
    path = copy(tiny_llama, tmp_path / "m")
    weights = path / "model.safetensors"
    write_with_header(weights, header, body)
    with pytest.raises(CheckpointError, match="is not a valid safetensors file") as info:
        open_checkpoint(str(path))
    assert why in str(info.value)
    assert_one_line(info.value, weights)


def test_dtype_neuronctl_does_not_read(tiny_llama: Path, tmp_path: Path) -> None:
    path = copy(tiny_llama, tmp_path / "m")
    header = b'{"w": {"dtype": "U16", "shape": [2], "data_offsets": [0, 4]}}'
    write_with_header(path / "model.safetensors", header, b"0000")
    with pytest.raises(CheckpointError, match="tensor w has dtype U16, which neuronctl does not"):
        open_checkpoint(str(path))


def test_header_length_past_the_end(tiny_llama: Path, tmp_path: Path) -> None:
    path = copy(tiny_llama, tmp_path / "m")
    weights = path / "model.safetensors"
    weights.write_bytes(struct.pack("<Q", 4096) + b"{}")
    with pytest.raises(CheckpointError, match="header length is past the end of the file"):
        open_checkpoint(str(path))


def test_header_gives_names_shapes_dtypes_metadata_in_file_order(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from neuronctl.checkpoints.safetensors_format import read_header

    file = tmp_path / "w.safetensors"
    tensors = {
        "b": torch.zeros(3, 2, dtype=torch.bfloat16),
        "a": torch.zeros(5, dtype=torch.int64),
        "c": torch.zeros(0, 4, dtype=torch.float16),
    }
    save_file(tensors, str(file), metadata={"format": "pt", "note": "x"})
    infos, metadata = read_header(file)
    assert metadata == {"format": "pt", "note": "x"}
    assert {n: (i.dtype, i.shape) for n, i in infos.items()} == {
        n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()
    }
    offsets = json.loads(file.read_bytes()[8 : 8 + struct.unpack("<Q", file.read_bytes()[:8])[0]])
    by_offset = sorted(tensors, key=lambda n: offsets[n]["data_offsets"][0])
    assert list(infos) == by_offset  # the sharder reads in file order


def assert_one_line(error: CheckpointError, file: Path) -> None:
    assert str(file) in str(error) and "\n" not in str(error)
    assert "download it again" in (error.hint or "")


def test_index_pointing_at_a_missing_shard(sharded_ckpt: Path, tmp_path: Path) -> None:
    path = copy(sharded_ckpt, tmp_path / "m")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (path / victim).unlink()
    with pytest.raises(CheckpointError, match=f"names {victim}, which is missing"):
        open_checkpoint(str(path))


def test_unsupported_architecture_lists_each_backend(tiny_llama: Path, tmp_path: Path) -> None:
    path = copy(tiny_llama, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(str(path))
    text = str(info.value)
    assert "FancyNewForCausalLM is not supported" in text
    assert "torch: LlamaForCausalLM" in text and "nxdi:" in text and "tnx:" in text


def test_missing_path_and_revision_on_local_dir(tiny_llama: Path, tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        open_checkpoint(str(tmp_path / "nope"))
    with pytest.raises(UsageError, match="--revision"):
        open_checkpoint(str(tiny_llama), revision="main")


def test_pickle_refused_unless_allowed(tiny_llama: Path, tmp_path: Path) -> None:
    src = open_checkpoint(str(tiny_llama))
    state = {name: src.tensor(name) for name in src.tensor_names()}
    path = tmp_path / "pickled"
    path.mkdir()
    shutil.copy(tiny_llama / "config.json", path / "config.json")
    torch.save(state, path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="only pickle weights") as info:
        open_checkpoint(str(path))
    assert "safetensors" in (info.value.hint or "") and "--allow-pickle" in (info.value.hint or "")
    ckpt = open_checkpoint(str(path), allow_pickle=True)
    assert set(ckpt.tensor_names()) == set(state)
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(ckpt.tensor(name), state[name])


def test_registry() -> None:
    assert supported_backends("LlamaForCausalLM") == ["torch", "nxdi", "tnx"]
    assert supported_backends("DbrxForCausalLM") == ["nxdi"]
    assert supported_backends("GPT2LMHeadModel") == []  # TNx has it, but not with vLLM
    check_supported("Qwen2ForCausalLM", "nxdi")
    with pytest.raises(CheckpointError, match="supported by: nxdi") as info:
        check_supported("MixtralForCausalLM", "torch")
    assert info.value.hint == "use --backend nxdi"
    with pytest.raises(CheckpointError) as info:
        check_supported("FancyNew", "torch")
    assert "torch: LlamaForCausalLM" in (info.value.hint or "")


def test_digest_is_cached_and_rehashes_changed_files(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = copy(tiny_llama, tmp_path / "m")
    read: list[str] = []
    real = digest_mod.sha256_file
    monkeypatch.setattr(
        digest_mod, "sha256_file", lambda p, *a: read.append(Path(p).name) or real(p, *a)
    )
    ckpt = open_checkpoint(str(path))
    first = ckpt.digest()
    assert sorted(read) == ["config.json", "model.safetensors"]
    read.clear()
    assert open_checkpoint(str(path)).digest() == first
    assert read == []  # second call reads no bytes
    os.utime(path / "config.json", ns=(1, 1))  # touched, same content
    assert open_checkpoint(str(path)).digest() == first
    assert read == ["config.json"]
    read.clear()
    assert ckpt.digest(rehash=True) == first
    assert sorted(read) == ["config.json", "model.safetensors"]


def test_digest_logs_why_it_hashes_or_not(
    tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = copy(tiny_llama, tmp_path / "m")
    caplog.set_level(logging.DEBUG, logger="neuronctl.checkpoints.digest")
    open_checkpoint(str(path)).digest()
    assert "model.safetensors" in caplog.text and "not in the digest cache" in caplog.text
    caplog.clear()
    open_checkpoint(str(path)).digest()
    assert "digest cache hit" in caplog.text and "hashing" not in caplog.text
    caplog.clear()
    os.utime(path / "config.json", ns=(1, 1))
    open_checkpoint(str(path)).digest()
    assert "changed since it was cached" in caplog.text


def imported_modules(source: Path) -> set[str]:
    """Every module a file imports, at the top, in functions or under TYPE_CHECKING."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_checkpoint_imports_point_one_way() -> None:
    """digest sits below reader (no cycle), and nothing under checkpoints/ imports the CLI."""
    package = Path(neuronctl.checkpoints.__file__).parent
    assert "neuronctl.checkpoints.reader" not in imported_modules(package / "digest.py")
    for source in package.glob("*.py"):
        cli_imports = {m for m in imported_modules(source) if m.startswith("neuronctl.cli")}
        assert not cli_imports, f"{source.name} imports {cli_imports}"


def test_digest_follows_content_not_location(tiny_llama: Path, tmp_path: Path) -> None:
    a = open_checkpoint(str(copy(tiny_llama, tmp_path / "a"))).digest()
    assert a == open_checkpoint(str(copy(tiny_llama, tmp_path / "b"))).digest()
    config = tmp_path / "b" / "config.json"
    config.write_text(config.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    assert open_checkpoint(str(tmp_path / "b")).digest() != a
    # Tokenizer files are not weights: changing them does not change the weights digest.
    (tmp_path / "a" / "tokenizer_config.json").write_text("{}")
    assert open_checkpoint(str(tmp_path / "a")).digest() == a


def test_inspect_cli(tiny_llama: Path, tmp_path: Path) -> None:
    out = cli_in_process("inspect", str(tiny_llama), "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["architecture"] == "LlamaForCausalLM"
    ckpt = open_checkpoint(str(tiny_llama))
    assert info["parameters"] == sum(ckpt.tensor(n).numel() for n in ckpt.tensor_names())
    assert info["backends"] == ["torch", "nxdi", "tnx"]
    assert (info["tp_degrees"], info["max_tp_degree"]) == ([1, 2, 4], 4)
    assert info["size_bytes"] == (tiny_llama / "model.safetensors").stat().st_size
    human = cli_in_process("inspect", str(tiny_llama))
    assert human.returncode == 0 and "LlamaForCausalLM" in human.stdout
    bad = cli("inspect", str(tmp_path))  # a real process: one line, no traceback
    assert bad.returncode == 1 and "no config.json" in bad.stderr and "Traceback" not in bad.stderr
