"""Review regressions: what an artifact key covers, damaged graph donors, the store's trash."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from neuronctl.build import compile_model, resolve_build
from neuronctl.store.local import Store
from neuronctl.store.manifest import Manifest, Source, read_manifest
from tests.conftest import TINY_SPEC


def _compile(model: Path, store: Path):  # type: ignore[no-untyped-def]
    return compile_model(resolve_build(str(model), TINY_SPEC, store_dir=store), jobs=1)


def test_changed_generation_config_is_not_a_cache_hit_of_the_old_artifact(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """The artifact carries generation_config.json (EOS ids) and the tokenizer: a checkpoint
    that differs only there must not get the artifact built with the old files."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    store = tmp_path / "store"
    first = _compile(model, store)
    gen = model / "generation_config.json"
    data = json.loads(gen.read_text())
    data["eos_token_id"] = [data.get("eos_token_id", 2), 7]
    gen.write_text(json.dumps(data))
    second = _compile(model, store)
    assert not second.cache_hit
    assert second.path != first.path
    assert json.loads((second.path / "generation_config.json").read_text()) == data


def test_tiktoken_files_are_copied_into_the_artifact(tiny_llama: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    (model / "tokenizer.tiktoken").write_text("aGVsbG8= 0\n")
    out = _compile(model, tmp_path / "store")
    assert (out.path / "tokenizer.tiktoken").read_text() == "aGVsbG8= 0\n"


def test_a_damaged_graph_donor_is_not_copied_into_a_new_artifact(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """A donor's graph with a flipped byte (same size) must not become another artifact's
    graph under a fresh manifest that vouches for the damaged bytes."""
    store = tmp_path / "store"
    donor = _compile(tiny_llama, store).path
    graph = donor / read_manifest(donor).graphs[0]
    good = read_manifest(donor).files[read_manifest(donor).graphs[0]].sha256
    raw = bytearray(graph.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    graph.write_bytes(bytes(raw))

    tuned = tmp_path / "tuned"
    shutil.copytree(tiny_llama, tuned)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tuned / "model.safetensors"))
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1
    save_file(tensors, str(tuned / "model.safetensors"), metadata={"format": "pt"})

    out = _compile(tuned, store)
    assert out.path != donor
    rel = read_manifest(donor).graphs[0]
    assert read_manifest(out.path).files[rel].sha256 == good
    assert not out.graphs_reused


def _fake_manifest(key: str) -> Manifest:
    return Manifest(
        backend="torch",
        backend_versions={},
        spec={},
        keys={"graph_key": "g" * 64, "weights_key": "w" * 64, "artifact_key": key},
        source=Source(digest="d" * 64),
        architecture={},
    )


def test_removing_an_artifact_survives_a_concurrent_publish(tmp_path: Path) -> None:
    """Another process publishing over a broken directory must not delete the trash folder
    a concurrent `remove` is about to rename into."""
    store = Store(tmp_path)
    victim = store.publish("a" * 20, lambda s: _fake_manifest("a" * 64)).path
    broken = store.path("b" * 20)
    broken.mkdir(parents=True)
    (broken / "partial.bin").write_bytes(b"x")

    original = Store._private
    fired: list[bool] = []

    def private(self: Store, name: str) -> Path:
        path = original(self, name)
        if name == ".trash" and not fired:
            fired.append(True)  # another process replaces its broken dir right now
            Store(tmp_path).publish("b" * 20, lambda s: _fake_manifest("b" * 64))
        return path

    Store._private = private  # type: ignore[method-assign]
    try:
        store.remove(victim)
    finally:
        Store._private = original  # type: ignore[method-assign]
    assert fired and not victim.exists()
    assert (store.path("b" * 20) / "manifest.json").is_file()


