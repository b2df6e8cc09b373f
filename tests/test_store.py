"""The store publishes atomically: killed processes leave nothing that looks like an artifact,
and concurrent builders of one key do the work once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neuronctl.errors import BuildError, NotFoundError, UsageError
from neuronctl.store.gc import collect, parse_duration, parse_size
from neuronctl.store.local import Store, default_store_root
from neuronctl.store.manifest import Manifest, Source, read_manifest

ROOT = Path(__file__).resolve().parents[1]
KEY = "0123456789abcdef0123"


def worker(store: Path, pause_at: str, tmp: Path, key: str = KEY) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.publish_worker",
            str(store),
            key,
            pause_at,
            str(tmp / f"marker-{pause_at}"),
            str(tmp / "builds.log"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )


def wait_for(path: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {path}")
        time.sleep(0.05)


def manifest(key: str = KEY) -> Manifest:
    return Manifest(
        backend="torch",
        backend_versions={"torch": "test"},
        spec={},
        keys={"graph_key": "g", "weights_key": "w", "artifact_key": key},
        source=Source(digest="d"),
        architecture={},
    )


@pytest.mark.parametrize("pause_at", ["mid-build", "built", "files-synced", "manifest-written"])
def test_sigkill_at_any_point_leaves_no_visible_artifact(tmp_path: Path, pause_at: str) -> None:
    store_dir = tmp_path / "store"
    proc = worker(store_dir, pause_at, tmp_path)
    wait_for(tmp_path / f"marker-{pause_at}")
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    store = Store(store_dir)
    assert not store.path(KEY).exists()
    assert list(store.iter_artifacts()) == []
    report = collect(store)
    assert len(report.leftovers) == 1  # the killed process's staging dir
    assert list((store.artifacts / ".staging").iterdir()) == []
    assert collect(store).leftovers == []

    # The key is not poisoned: the next publish (here, this process) builds it.
    def build(staging: Path) -> Manifest:
        (staging / "model.pt").write_bytes(b"x")
        return manifest()

    assert store.publish(KEY, build).cache_hit is False
    assert read_manifest(store.path(KEY)).files


def test_two_processes_publishing_one_key_build_once(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    procs = [worker(store_dir, "none", tmp_path) for _ in range(2)]
    results = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(r["cache_hit"] for r in results) == [False, True]
    assert len((tmp_path / "builds.log").read_text().splitlines()) == 1
    assert results[0]["path"] == results[1]["path"]


def test_manifest_records_every_file_with_size_and_sha256(tmp_path: Path) -> None:
    store = Store(tmp_path)

    def build(staging: Path) -> Manifest:
        (staging / "graphs").mkdir()
        (staging / "graphs" / "g.pt2").write_bytes(b"abc")
        return manifest()

    published = store.publish(KEY, build)
    files = read_manifest(published.path).files
    assert set(files) == {"graphs/g.pt2"}
    assert files["graphs/g.pt2"].size == 3
    assert files["graphs/g.pt2"].sha256.startswith("ba7816bf")  # sha256("abc")


def test_failed_build_publishes_nothing_and_keeps_its_logs_for_gc(tmp_path: Path) -> None:
    store = Store(tmp_path)

    def build(staging: Path) -> Manifest:
        (staging / "report").mkdir()
        (staging / "report" / "ctx_64.log").write_text("compiler said no")
        raise BuildError("bucket ctx_64 failed")

    with pytest.raises(BuildError) as info:
        store.publish(KEY, build)
    assert not store.path(KEY).exists()
    assert ".failed" in (info.value.hint or "")
    kept = list((store.artifacts / ".failed").iterdir())
    assert (kept[0] / "report" / "ctx_64.log").read_text() == "compiler said no"
    assert collect(store).leftovers == kept
    assert list((store.artifacts / ".failed").iterdir()) == []


def test_broken_artifact_is_replaced_not_merged(tmp_path: Path) -> None:
    store = Store(tmp_path)
    broken = store.path(KEY)
    broken.mkdir(parents=True)
    (broken / "stray").write_text("half a build from another tool")

    def build(staging: Path) -> Manifest:
        (staging / "model.pt").write_bytes(b"x")
        return manifest()

    published = store.publish(KEY, build)
    assert published.cache_hit is False
    assert sorted(p.name for p in broken.iterdir()) == ["manifest.json", "model.pt"]


def test_find_by_prefix_and_errors(tmp_path: Path) -> None:
    store = Store(tmp_path)
    for key in ("aaaa1111", "aaaa2222"):
        store.publish(key, lambda staging, key=key: manifest(key))
    assert store.find("aaaa1").name == "aaaa1111"
    with pytest.raises(UsageError, match="several"):
        store.find("aaaa")
    with pytest.raises(NotFoundError):
        store.find("bbbb")


def test_gc_policies(tmp_path: Path) -> None:
    store = Store(tmp_path)
    for i in range(4):
        store.publish(f"k{i}", lambda staging, i=i: _sized(staging, i))
        _set_created(store.path(f"k{i}"), f"2026-01-0{i + 1}T00:00:00+00:00")
    dry = collect(store, keep_last=2, dry_run=True)
    assert [p.name for p in dry.removed] == ["k1", "k0"]
    assert len(list(store.iter_artifacts())) == 4
    report = collect(store, max_size=2500)  # each artifact is 1000 bytes
    assert [p.name for p in report.removed] == ["k1", "k0"]
    assert [p.name for p, _ in store.iter_artifacts()] == ["k2", "k3"]
    assert [p.name for p in collect(store, older_than=parse_duration("1d")).removed] == ["k3", "k2"]


def _sized(staging: Path, i: int) -> Manifest:
    (staging / "w.bin").write_bytes(bytes(1000))
    return manifest(f"k{i}")


def _set_created(path: Path, created: str) -> None:
    data = json.loads((path / "manifest.json").read_text())
    data["created"] = created
    (path / "manifest.json").write_text(json.dumps(data))


def test_parse_size_and_duration() -> None:
    assert parse_size("1G") == parse_size("1GiB") == 1024**3
    assert parse_size("500") == 500
    assert parse_duration("12h").total_seconds() == 43200
    with pytest.raises(UsageError):
        parse_size("lots")
    with pytest.raises(UsageError):
        parse_duration("soon")


def test_one_default_store_for_every_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert default_store_root() == tmp_path / "xdg-cache" / "neuronctl"
    monkeypatch.setenv("NEURONCTL_STORE", str(tmp_path / "s"))
    assert default_store_root() == tmp_path / "s"


def test_a_store_is_named_by_its_root_or_its_artifacts_dir(tmp_path: Path) -> None:
    store = Store(tmp_path)
    path = store.publish("k" * 20, lambda staging: manifest()).path
    by_dir = Store(tmp_path / "neuron-compiled-artifacts")
    assert by_dir.root == store.root and by_dir.find("kkk") == path


def test_a_store_path_is_refused_where_an_artifact_is_expected(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.publish("k" * 20, lambda staging: manifest())
    for ref in (str(tmp_path), str(store.artifacts)):
        with pytest.raises(UsageError, match="is an artifact store, not an artifact"):
            store.resolve(ref)


def test_rm_racing_gc_is_a_not_found_error_not_an_internal_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(tmp_path)
    path = store.publish("k" * 20, lambda staging: manifest()).path
    stale = list(store.iter_artifacts())
    store.remove(path)  # `rm` wins the race
    with pytest.raises(NotFoundError, match="already removed"):
        store.remove(path)
    monkeypatch.setattr(Store, "iter_artifacts", lambda self: iter(stale))
    report = collect(store, keep_last=0)  # `gc` listed it before `rm` removed it
    assert report.removed == []
