"""What compile reuses and what it rebuilds: the artifact key's coverage, graph donors, the
store's trash, and one verdict with validate (a cache hit is exactly a reusable artifact)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from neuronctl.build import compile_model, resolve_build
from neuronctl.store.local import Store
from neuronctl.store.manifest import Manifest, Source, read_manifest
from tests.conftest import SMALLEST_SPEC
from tests.helpers import fine_tuned_copy


def _compile(model: Path, store: Path, spec: dict = SMALLEST_SPEC):  # type: ignore[no-untyped-def]
    return compile_model(resolve_build(str(model), spec, store_dir=store), jobs=1)


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

    tuned = fine_tuned_copy(tiny_llama, tmp_path / "tuned")

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


def _copied_store(compiled_artifact: Path, tmp_path: Path) -> tuple[Path, Path]:
    store = tmp_path / "store"
    shutil.copytree(compiled_artifact.parent.parent, store)
    return store, store / "neuron-compiled-artifacts" / compiled_artifact.name


def _edit_spec(artifact: Path, **changes: object) -> None:
    path = artifact / "manifest.json"
    data = json.loads(path.read_text())
    data["spec"].update(changes)
    path.write_text(json.dumps(data))


def test_an_unlisted_graph_file_is_neither_reusable_nor_a_cache_hit(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """compile used to call this a hit while validate refused it, leaving the user stuck."""
    from neuronctl.store.manifest import is_intact
    from neuronctl.validate import quick_validate

    store = tmp_path / "store"
    artifact = _compile(tiny_llama, store).path  # the 2-graph spec: built twice here
    (artifact / "graphs" / "context_encoding_999.pt2").write_bytes(b"not a graph")
    assert not quick_validate(artifact).reusable and not is_intact(artifact)
    out = _compile(tiny_llama, store)
    assert not out.cache_hit and out.path == artifact  # rebuilt, replaced atomically
    assert quick_validate(artifact).reusable and is_intact(artifact)
    assert not (artifact / "graphs" / "context_encoding_999.pt2").exists()


def test_an_edited_spec_in_the_manifest_is_noticed_by_validate_and_compile(
    compiled_artifact: Path, tmp_path: Path
) -> None:
    from neuronctl.store.manifest import is_intact
    from neuronctl.validate import quick_validate

    _store, artifact = _copied_store(compiled_artifact, tmp_path)
    _edit_spec(artifact, batch_size=2)
    report = quick_validate(artifact)
    assert not report.reusable and "edited after the build" in report.summary()
    assert not is_intact(artifact)


def test_a_checkpoint_without_tokenizer_files_is_refused_before_compiling(
    tiny_llama: Path, tmp_path: Path
) -> None:
    import pytest

    from neuronctl.errors import CheckpointError

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (model / name).unlink(missing_ok=True)
    store = tmp_path / "store"
    with pytest.raises(CheckpointError, match="no tokenizer files") as caught:
        _compile(model, store)
    assert caught.value.hint and "tokenizer.json" in caught.value.hint
    assert not (store / "neuron-compiled-artifacts").exists() or not any(
        p for p in (store / "neuron-compiled-artifacts").iterdir() if not p.name.startswith(".")
    )
