"""Remote stores against a real S3-protocol server (moto, on 127.0.0.1) and a shared mount,
through the same s3fs code path users hit."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from neuronctl.store.local import Store
from neuronctl.store.manifest import MANIFEST, Manifest, Source, read_manifest
from neuronctl.store.remote.client import open_remote
from neuronctl.store.remote.errors import RemoteArtifactError
from neuronctl.store.remote.urls import resolve_artifacts_arg, split_artifact_url
from neuronctl.store.signing import (
    PROVENANCE,
    SIGNATURE,
    SIGNED,
    SIGNING_KEY_ENV,
    TRUSTED_KEYS_ENV,
    Signer,
    TrustedKey,
    TrustPolicy,
    check_origin,
    differs_from,
    key_id,
)
from tests.s3server import S3Server, new_bucket

ROOT = Path(__file__).resolve().parents[1]
# The publisher's key: tests push signed, and every pull trusts it (through the environment,
# so subprocesses and the CLI trust it too; see `trusted_env`).
_KEY = ec.generate_private_key(ec.SECP256R1())
SIGNER = Signer(_KEY, key_id(_KEY.public_key()))
TRUST = TrustPolicy((TrustedKey(_KEY.public_key(), SIGNER.key_id, "tests"),))


def write_keypair(key: Any, prefix: Path) -> tuple[Path, Path]:
    private, public = prefix.with_suffix(".key"), prefix.with_suffix(".pub")
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, public


@pytest.fixture(autouse=True)
def trusted_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """The test publisher's key pair on disk, named by the environment variables users set."""
    private, public = write_keypair(_KEY, tmp_path / "publisher")
    monkeypatch.setenv(SIGNING_KEY_ENV, str(private))
    monkeypatch.setenv(TRUSTED_KEYS_ENV, str(public))
    return private, public


@pytest.fixture(scope="module")
def s3server() -> Iterator[S3Server]:
    server = S3Server().start()
    yield server
    server.stop()


@pytest.fixture()
def bucket(s3server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    for name, value in s3server.env().items():
        monkeypatch.setenv(name, value)
    name = new_bucket(s3server)
    s3server.reset_counts()
    return name


def make_artifact(root: Path, files: dict[str, bytes], seed: str = "a") -> Path:
    """A synthetic artifact published the way compile publishes: push/pull ignore contents."""
    key = hashlib.sha256(seed.encode()).hexdigest()
    manifest = Manifest(
        backend="torch",
        backend_versions={"torch": "test"},
        spec={"tp_degree": 1},
        keys={"graph_key": "g" * 64, "weights_key": "w" * 64, "artifact_key": key},
        source=Source(digest="d" * 64),
        architecture={"model_type": "llama"},
    )

    def build(staging: Path) -> Manifest:
        for rel, data in files.items():
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            (staging / rel).write_bytes(data)
        return manifest

    return Store(root).publish(key[:20], build).path


def sample_files(big: int = 3 * 1024 * 1024) -> dict[str, bytes]:
    rng = os.urandom
    return {
        "config.json": b'{"model_type": "llama"}',
        "graphs/ctx_128.pt2": rng(big),
        "graphs/tkg_128.pt2": rng(100_000),
        "weights/tp0_sharded_checkpoint.safetensors": rng(big // 2),
        "empty.txt": b"",
    }


def tree_bytes(root: Path) -> dict[str, bytes]:
    """The artifact's own files, bit for bit (not the store's records: the manifest, which a
    pull re-records, and the provenance a pull adds)."""
    files = sorted(p for p in root.rglob("*") if p.is_file())
    rels = {p.relative_to(root).as_posix(): p for p in files}
    return {rel: p.read_bytes() for rel, p in rels.items() if rel not in (MANIFEST, PROVENANCE)}


def visible(store: Store) -> list[str]:
    return [p.name for p, _m in store.iter_artifacts()]


def _client() -> Any:
    """A plain boto3 client, independent of the code under test, to inspect or damage objects."""
    import boto3

    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])


def boto_client_keys(bucket: str) -> set[str]:
    pages = _client().get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return {obj["Key"] for page in pages for obj in page.get("Contents", [])}


def test_s3_push_pull_round_trip_is_bit_for_bit(tmp_path: Path, bucket: str) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files())
    remote = open_remote(f"s3://{bucket}/team")
    assert not remote.has(artifact.name)

    pushed = remote.push(artifact, signer=SIGNER)
    assert remote.has(artifact.name)
    assert pushed.uploaded[-1] == MANIFEST
    keys = boto_client_keys(bucket)
    assert f"team/neuron-compiled-artifacts/{artifact.name}/graphs/ctx_128.pt2" in keys

    dest = Store(tmp_path / "b")
    published = remote.pull(artifact.name, dest)
    assert not published.cache_hit
    assert published.path == dest.path(artifact.name)
    assert tree_bytes(published.path) == tree_bytes(artifact)
    assert not list((dest.artifacts / ".staging").iterdir())
    vouch = check_origin(published.path, read_manifest(published.path), TRUST)
    assert (vouch.kind, vouch.key_id) == (SIGNED, SIGNER.key_id)
    assert differs_from(read_manifest(published.path), (artifact / MANIFEST).read_bytes()) is None


def test_repush_uploads_nothing(tmp_path: Path, bucket: str, s3server: S3Server) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files())
    first = open_remote(f"s3://{bucket}").push(artifact, signer=SIGNER)
    assert first.uploaded_bytes == read_manifest(artifact).total_size()
    s3server.reset_counts()

    again = open_remote(f"s3://{bucket}").push(artifact, signer=SIGNER)

    assert again.noop and again.uploaded_bytes == 0
    assert s3server.uploads() == 0 and s3server.bytes_uploaded == 0


def test_interrupted_push_resumes_from_object_metadata(
    tmp_path: Path, bucket: str, s3server: S3Server
) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files())
    remote = open_remote(f"s3://{bucket}")
    remote.push(artifact, signer=SIGNER)
    # A push killed before its last step: every file there, no manifest.
    _client().delete_object(
        Bucket=bucket, Key=f"neuron-compiled-artifacts/{artifact.name}/{MANIFEST}"
    )
    assert not remote.has(artifact.name)
    s3server.reset_counts()

    resumed = remote.push(artifact, signer=SIGNER)

    assert resumed.uploaded == [SIGNATURE, MANIFEST]
    assert s3server.requests["PUT"] == 2
    assert remote.has(artifact.name)


def test_push_after_remote_damage_reuploads_only_the_damaged_file(
    tmp_path: Path, bucket: str
) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files())
    remote = open_remote(f"s3://{bucket}")
    remote.push(artifact, signer=SIGNER)
    _client().put_object(
        Bucket=bucket,
        Key=f"neuron-compiled-artifacts/{artifact.name}/graphs/tkg_128.pt2",
        Body=b"short",
    )

    repaired = remote.push(artifact, signer=SIGNER)

    assert repaired.uploaded == ["graphs/tkg_128.pt2", SIGNATURE, MANIFEST]
    pulled = remote.pull(artifact.name, Store(tmp_path / "b"))
    assert tree_bytes(pulled.path) == tree_bytes(artifact)


def test_corrupted_remote_object_is_refused_naming_the_file(tmp_path: Path, bucket: str) -> None:
    files = sample_files()
    artifact = make_artifact(tmp_path / "a", files)
    remote = open_remote(f"s3://{bucket}")
    remote.push(artifact, signer=SIGNER)
    rel = "weights/tp0_sharded_checkpoint.safetensors"
    flipped = bytearray(files[rel])
    flipped[1000] ^= 0xFF  # same size: only a hash can tell
    _client().put_object(
        Bucket=bucket, Key=f"neuron-compiled-artifacts/{artifact.name}/{rel}", Body=bytes(flipped)
    )
    dest = Store(tmp_path / "b")

    with pytest.raises(RemoteArtifactError, match=rel):
        remote.pull(artifact.name, dest)

    assert visible(dest) == []
    assert not list((dest.artifacts / ".staging").iterdir())


def test_truncated_remote_object_is_refused_before_download(tmp_path: Path, bucket: str) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files())
    remote = open_remote(f"s3://{bucket}")
    remote.push(artifact, signer=SIGNER)
    _client().delete_object(
        Bucket=bucket, Key=f"neuron-compiled-artifacts/{artifact.name}/graphs/ctx_128.pt2"
    )
    with pytest.raises(RemoteArtifactError, match="graphs/ctx_128.pt2.*missing"):
        remote.pull(artifact.name, Store(tmp_path / "b"))


def test_incomplete_remote_artifact_is_refused(tmp_path: Path, bucket: str) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files())
    remote = open_remote(f"s3://{bucket}")
    remote.push(artifact, signer=SIGNER)
    _client().delete_object(
        Bucket=bucket, Key=f"neuron-compiled-artifacts/{artifact.name}/{MANIFEST}"
    )
    with pytest.raises(RemoteArtifactError, match="incomplete"):
        remote.pull(artifact.name, Store(tmp_path / "b"))
    with pytest.raises(Exception, match="no artifact"):
        remote.pull("0" * 20, Store(tmp_path / "b"))


def test_pull_of_a_local_artifact_is_a_cache_hit_without_download(
    tmp_path: Path, bucket: str, s3server: S3Server
) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files())
    remote = open_remote(f"s3://{bucket}")
    remote.push(artifact, signer=SIGNER)
    dest = Store(tmp_path / "b")
    remote.pull(artifact.name, dest)
    s3server.reset_counts()

    again = remote.pull(artifact.name, dest)

    assert again.cache_hit
    assert s3server.bytes_downloaded == 0


PULL_SCRIPT = """
import json, sys, time
from pathlib import Path
from neuronctl.store.local import Store
from neuronctl.store.remote.client import open_remote

url, dirname, store_dir, marker, go, pause = sys.argv[1:7]

class Pausing:
    def task(self, description, total=None):
        def advance(n):
            if not Path(marker).exists():
                Path(marker).touch()
                time.sleep(float(pause))
        return advance

while not Path(go).exists():
    time.sleep(0.01)
published = open_remote(url).pull(dirname, Store(Path(store_dir)), Pausing())
print(json.dumps({"cache_hit": published.cache_hit, "path": str(published.path)}))
"""


def pull_process(
    url: str, dirname: str, store: Path, marker: Path, go: Path, pause: float
) -> subprocess.Popen[str]:
    args = [url, dirname, str(store), str(marker), str(go), str(pause)]
    return subprocess.Popen(
        [sys.executable, "-c", PULL_SCRIPT, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )


def wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"timed out waiting for {path}"
        time.sleep(0.02)


def test_pull_killed_with_sigkill_leaves_no_visible_artifact(tmp_path: Path, bucket: str) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files())
    url = f"s3://{bucket}"
    open_remote(url).push(artifact, signer=SIGNER)
    store_dir, marker, go = tmp_path / "b", tmp_path / "marker", tmp_path / "go"
    go.touch()
    proc = pull_process(url, artifact.name, store_dir, marker, go, pause=120)
    wait_for(marker)  # mid-download: some bytes are in staging

    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)

    store = Store(store_dir)
    assert visible(store) == []
    assert len(store.stale_staging()) == 1  # the lock died with the process
    published = open_remote(url).pull(artifact.name, store)
    assert tree_bytes(published.path) == tree_bytes(artifact)


def test_two_concurrent_pulls_download_once(
    tmp_path: Path, bucket: str, s3server: S3Server
) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files())
    url = f"s3://{bucket}"
    open_remote(url).push(artifact, signer=SIGNER)
    size = read_manifest(artifact).total_size()
    store_dir, go = tmp_path / "b", tmp_path / "go"
    s3server.reset_counts()
    # The first to download pauses mid-way, so the other surely finds the key locked.
    procs = [
        pull_process(url, artifact.name, store_dir, tmp_path / "marker", go, pause=1.0)
        for _ in range(2)
    ]
    go.touch()
    outputs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]

    assert all(p.returncode == 0 for p in procs)
    assert sorted(o["cache_hit"] for o in outputs) == [False, True]
    # Data bytes crossed the wire once (plus two small manifest reads).
    assert size <= s3server.bytes_downloaded < size + 64 * 1024
    assert tree_bytes(Path(outputs[0]["path"])) == tree_bytes(artifact)


def test_shared_mount_round_trip(tmp_path: Path) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files(big=200_000))
    mount = tmp_path / "mount"
    remote = open_remote(f"file://{mount}")

    pushed = remote.push(artifact, signer=SIGNER)
    again = remote.push(artifact, signer=SIGNER)
    published = open_remote(str(mount)).pull(artifact.name, Store(tmp_path / "b"))

    assert (mount / "neuron-compiled-artifacts" / artifact.name / MANIFEST).is_file()
    assert pushed.uploaded_bytes > 0 and again.noop
    assert tree_bytes(published.path) == tree_bytes(artifact)
    assert not list(mount.rglob("*.tmp-*"))


def test_resolve_artifacts_arg_pulls_remote_urls(tmp_path: Path, bucket: str) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files(big=10_000))
    open_remote(f"s3://{bucket}/p").push(artifact, signer=SIGNER)
    store = Store(tmp_path / "b")

    short = resolve_artifacts_arg(f"s3://{bucket}/p/{artifact.name[:6]}", store)
    full = resolve_artifacts_arg(
        f"s3://{bucket}/p/neuron-compiled-artifacts/{read_manifest(artifact).artifact_key}", store
    )

    assert short == full == store.path(artifact.name)
    assert resolve_artifacts_arg(str(artifact), store) == artifact


def test_split_artifact_url() -> None:
    assert split_artifact_url("s3://b/p/KEY") == ("s3://b/p", "KEY")
    assert split_artifact_url("s3://b/neuron-compiled-artifacts/KEY/") == ("s3://b", "KEY")
    with pytest.raises(Exception, match="does not name"):
        split_artifact_url("s3://bucket")


def test_real_compiled_artifact_round_trip_validates(
    tmp_path: Path, bucket: str, compiled_artifact: Path
) -> None:
    from neuronctl.validate import validate_artifact

    url = f"s3://{bucket}/fleet"
    open_remote(url).push(compiled_artifact, signer=SIGNER)

    pulled = resolve_artifacts_arg(f"{url}/{compiled_artifact.name}", Store(tmp_path / "host"))

    assert tree_bytes(pulled) == tree_bytes(compiled_artifact)
    report = validate_artifact(pulled, deep=True)
    assert report.reusable, report.summary()


# -- bounded reads and writes: a hostile remote cannot exhaust memory, disk or time ----------


def _pushed_to_mount(tmp_path: Path, files: dict[str, bytes] | None = None) -> tuple[Path, Path]:
    artifact = make_artifact(tmp_path / "a", files or sample_files(big=20_000))
    mount = tmp_path / "mount"
    open_remote(str(mount)).push(artifact, signer=SIGNER)
    return artifact, mount / "neuron-compiled-artifacts" / artifact.name


@pytest.mark.parametrize("name", [SIGNATURE, MANIFEST])
def test_a_huge_sparse_metadata_file_is_refused_unread(tmp_path: Path, name: str) -> None:
    """A 3 GiB sparse manifest.sig took 4 GB of memory: metadata was read whole before any
    check. Now its size is checked first and at most the cap is ever read."""
    artifact, remote_dir = _pushed_to_mount(tmp_path)
    os.truncate(remote_dir / name, 256 * 1024**2)  # sparse: costs no disk

    with pytest.raises(RemoteArtifactError, match="over the .*-byte limit"):
        open_remote(str(tmp_path / "mount")).pull(artifact.name, Store(tmp_path / "b"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rel", [MANIFEST, SIGNATURE])
def test_a_fifo_in_a_shared_mount_is_refused_not_waited_on(tmp_path: Path, rel: str) -> None:
    """A FIFO named like a remote file hung pull forever (an open() that never returns)."""
    artifact, remote_dir = _pushed_to_mount(tmp_path)
    (remote_dir / rel).unlink()
    os.mkfifo(remote_dir / rel)

    with pytest.raises(RemoteArtifactError, match="not a regular file"):
        open_remote(str(tmp_path / "mount")).pull(artifact.name, Store(tmp_path / "b"))


def test_a_download_stops_at_the_signed_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An object grown after its size was checked (512 MiB fetched for a 463 KB object)."""
    from neuronctl.store.remote.client import RemoteStore

    artifact, remote_dir = _pushed_to_mount(tmp_path)
    signed = read_manifest(artifact).files
    rel = "graphs/tkg_128.pt2"
    with open(remote_dir / rel, "ab") as f:
        f.write(os.urandom(4 * 1024 * 1024))
    # The size check saw the signed sizes: the object grows between the check and the read.
    sizes = {r: e.size for r, e in signed.items()}
    monkeypatch.setattr(RemoteStore, "sizes", lambda self, dirname: sizes)
    store = Store(tmp_path / "b")

    with pytest.raises(RemoteArtifactError, match=f"{rel} changed size during the pull"):
        open_remote(str(tmp_path / "mount")).pull(artifact.name, store)
    kept = [p for p in (store.artifacts / ".failed").rglob("tkg_128.pt2")]
    assert all(p.stat().st_size <= signed[rel].size for p in kept)


def test_failed_pulls_keep_one_copy_not_one_per_attempt(tmp_path: Path) -> None:
    artifact, remote_dir = _pushed_to_mount(tmp_path)
    rel = "weights/tp0_sharded_checkpoint.safetensors"
    data = bytearray((remote_dir / rel).read_bytes())
    data[10] ^= 0xFF  # same size: the pull downloads it all before the hash says no
    (remote_dir / rel).write_bytes(bytes(data))
    store = Store(tmp_path / "b")
    for _attempt in range(3):
        with pytest.raises(RemoteArtifactError, match="is corrupted"):
            open_remote(str(tmp_path / "mount")).pull(artifact.name, store)
    assert len(list((store.artifacts / ".failed").iterdir())) == 1


def test_push_refuses_a_same_size_damaged_file_and_s3_metadata_is_the_sent_hash(
    tmp_path: Path, bucket: str
) -> None:
    """push uploaded and signed a same-size-damaged artifact, stamping x-amz-meta-sha256 from
    the manifest's claim: the next healthy push was a no-op and the remote stayed poisoned."""
    artifact = make_artifact(tmp_path / "a", sample_files(big=20_000))
    rel = "graphs/ctx_128.pt2"
    good = (artifact / rel).read_bytes()
    bad = bytearray(good)
    bad[5] ^= 0xFF
    (artifact / rel).write_bytes(bytes(bad))
    remote = open_remote(f"s3://{bucket}")

    with pytest.raises(RemoteArtifactError, match="refusing to push a damaged artifact"):
        remote.push(artifact, signer=SIGNER)
    assert not remote.has(artifact.name)

    (artifact / rel).write_bytes(good)
    assert not remote.push(artifact, signer=SIGNER).noop
    key = f"neuron-compiled-artifacts/{artifact.name}/{rel}"
    head = _client().head_object(Bucket=bucket, Key=key)
    assert head["Metadata"]["sha256"] == hashlib.sha256(good).hexdigest()


def test_a_full_or_read_only_local_disk_is_not_blamed_on_the_remote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    import neuronctl.store.remote.pull as pull_module
    from neuronctl.store.remote.errors import LocalDiskError

    artifact, _ = _pushed_to_mount(tmp_path)
    remote = open_remote(str(tmp_path / "mount"))
    real_open = pull_module.open_output
    monkeypatch.setattr(pull_module, "open_output", lambda dest: open("/dev/full", "wb"))
    with pytest.raises(LocalDiskError, match="on this host: No space left") as full:
        remote.pull(artifact.name, Store(tmp_path / "b"))
    assert "check the URL" not in str(full.value)
    monkeypatch.setattr(pull_module, "open_output", real_open)

    def read_only(self: Store, dirname: str) -> Path:
        raise OSError(errno.EROFS, "Read-only file system", str(self.artifacts / ".staging"))

    monkeypatch.setattr(Store, "new_staging", read_only)
    with pytest.raises(LocalDiskError, match="Read-only file system") as ro:
        remote.pull(artifact.name, Store(tmp_path / "c"))
    assert "--store" in str(ro.value)
