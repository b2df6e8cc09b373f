"""oci:// remotes against a real registry (Debian's docker-registry, the CNCF distribution
registry) on 127.0.0.1: push and pull through the registry API, tags and digests, layer
dedup, resume after SIGKILL, damage refused, credentials from a docker config."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from neuronctl.errors import NeuronctlError, UsageError
from neuronctl.keys import KEY_LENGTH
from neuronctl.store.local import Store
from neuronctl.store.manifest import read_manifest
from neuronctl.store.remote.client import open_remote
from neuronctl.store.remote.errors import RemoteArtifactError, RemoteUnreachableError
from neuronctl.store.remote.oci import BLOB_CACHE, OciStore
from neuronctl.store.remote.oci_layout import (
    ARTIFACT_TYPE,
    CONFIG_TYPE,
    FILE_TYPE,
    KEY_ANNOTATION,
    OLD_SIGNATURE_TYPE,
    TITLE,
    Blob,
)
from neuronctl.store.remote.oci_ref import PLAIN_HTTP_ENV, parse_oci_url
from neuronctl.store.remote.oci_referrers import (
    SIGNATURE_ARTIFACT_TYPE,
    attach,
    referrers_tag,
    signatures,
)
from neuronctl.store.remote.urls import resolve_artifacts_arg, split_artifact_url
from neuronctl.store.signing import SIGNATURE, SignatureError, TrustPolicy
from tests.helpers import cli, cli_in_process, make_checkpoint
from tests.ociregistry import OciRegistry, registry_binary
from tests.test_plan import push_entry
from tests.test_remote import (  # noqa: F401 - trusted_env is an autouse fixture
    ROOT,
    SIGNER,
    make_artifact,
    sample_files,
    tree_bytes,
    trusted_env,
)

pytestmark = pytest.mark.skipif(
    registry_binary() is None,
    reason="docker-registry is not installed (`make install` installs it: apt-get install "
    "docker-registry)",
)


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OciRegistry]:
    server = OciRegistry(tmp_path_factory.mktemp("registry")).start()
    yield server
    server.stop()


@pytest.fixture()
def repo(registry: OciRegistry) -> str:
    """A fresh repository per test: tests never see each other's tags."""
    return f"oci://{registry.host}/t{uuid.uuid4().hex[:10]}/models"


def manifest_of(store: OciStore, reference: str) -> dict:
    found = store.registry.get_manifest(reference)
    assert found is not None
    return json.loads(found[0])


def referred_signatures(store: OciStore, reference: str) -> list[bytes]:
    artifact = store.fetch(reference)
    assert artifact is not None
    return signatures(store.registry, Blob(artifact.digest, artifact.size), "test")


def test_push_pull_round_trip_is_bit_for_bit(tmp_path: Path, repo: str) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files())
    pushed = open_remote(repo).push(artifact, signer=SIGNER)
    assert pushed.signed_by == SIGNER.key_id
    remote = open_remote(repo)
    assert isinstance(remote, OciStore)
    assert remote.has(artifact.name)
    published = remote.pull(artifact.name, Store(tmp_path / "b"))
    assert tree_bytes(published.path) == tree_bytes(artifact)
    assert remote.downloaded_bytes == read_manifest(artifact).total_size()
    assert not list((tmp_path / "b" / "neuron-compiled-artifacts" / BLOB_CACHE).iterdir())


def test_one_layer_per_file_config_is_the_manifest_and_annotations(
    tmp_path: Path, repo: str
) -> None:
    """The registry holds an image-spec 1.1 artifact: config = manifest.json's bytes, each file
    a titled layer whose digest is the manifest's sha256; the signature is not a layer of it
    (it is a referrer: test_the_signature_is_a_referrer_listed_under_the_tag_schema)."""
    artifact = make_artifact(tmp_path / "a", sample_files())
    remote = open_remote(repo)
    assert isinstance(remote, OciStore)
    remote.push(artifact, signer=SIGNER)
    document = manifest_of(remote, artifact.name)
    local = read_manifest(artifact)
    assert document["artifactType"] == ARTIFACT_TYPE
    assert document["config"]["mediaType"] == CONFIG_TYPE
    config = remote.registry.read_blob(document["config"]["digest"],
                                       document["config"]["size"], "config")
    assert json.loads(config)["keys"]["artifact_key"] == local.artifact_key
    files = {layer["annotations"][TITLE]: layer for layer in document["layers"]
             if layer["mediaType"] == FILE_TYPE}
    assert {rel: (f["digest"], f["size"]) for rel, f in files.items()} == {
        rel: (f"sha256:{e.sha256}", e.size) for rel, e in local.files.items()}
    assert {layer["mediaType"] for layer in document["layers"]} == {FILE_TYPE}
    notes = document["annotations"]
    assert notes[KEY_ANNOTATION] == local.artifact_key
    assert notes["dev.neuronctl.backend"] == "torch"
    assert notes["dev.neuronctl.version.torch"] == "test"


def test_tag_and_digest_references(tmp_path: Path, repo: str) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files(big=100_000))
    store_url = repo + ":stable"  # push adds the URL's tag next to the key's
    open_remote(store_url).push(artifact, signer=SIGNER)
    remote = open_remote(repo)
    assert isinstance(remote, OciStore)
    found = remote.registry.get_manifest(artifact.name)
    assert found is not None
    digest = found[1]
    for n, url in enumerate([f"{repo}:{artifact.name}", f"{repo}:stable", f"{repo}@{digest}",
                             f"{repo}:{artifact.name[:6]}"]):
        path = resolve_artifacts_arg(url, Store(tmp_path / f"s{n}"))
        assert tree_bytes(path) == tree_bytes(artifact), url
    assert split_artifact_url(f"{repo}@{digest}") == (repo, f"@{digest}")
    key = read_manifest(artifact).artifact_key
    path = resolve_artifacts_arg(f"{repo}:{key}", Store(tmp_path / "full"))
    assert tree_bytes(path) == tree_bytes(artifact)
    wrong = key[:KEY_LENGTH] + ("0" if key[KEY_LENGTH] != "0" else "1") + key[KEY_LENGTH + 1:]
    with pytest.raises(RemoteArtifactError, match="is for artifact"):
        resolve_artifacts_arg(f"{repo}:{wrong}", Store(tmp_path / "wrong"))
    with pytest.raises(NeuronctlError, match="no artifact"):
        resolve_artifacts_arg(f"{repo}:0000000", Store(tmp_path / "none"))


def test_a_digest_the_registry_does_not_hold_is_not_found(tmp_path: Path, repo: str) -> None:
    with pytest.raises(NeuronctlError, match="no artifact"):
        resolve_artifacts_arg(f"{repo}@sha256:{'0' * 64}", Store(tmp_path / "s"))


def test_unchanged_layers_are_stored_once_across_two_artifacts(
    tmp_path: Path, repo: str, registry: OciRegistry
) -> None:
    files = sample_files()
    first = make_artifact(tmp_path / "a", files, seed="one")
    files2 = dict(files, **{"graphs/ctx_128.pt2": os.urandom(50_000)})
    second = make_artifact(tmp_path / "b", files2, seed="two")
    open_remote(repo).push(first, signer=SIGNER)
    result = open_remote(repo).push(second, signer=SIGNER)
    assert result.uploaded == ["graphs/ctx_128.pt2", SIGNATURE, "manifest.json"]
    assert "weights/tp0_sharded_checkpoint.safetensors" in result.skipped
    again = open_remote(repo).push(second, signer=SIGNER)
    assert again.noop


def test_push_refuses_a_digest_and_the_url_must_name_an_artifact(
    tmp_path: Path, repo: str
) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files(big=1000))
    with pytest.raises(UsageError, match="digest"):
        open_remote(f"{repo}@sha256:{'1' * 64}").push(artifact)
    with pytest.raises(UsageError, match="names a repository"):
        split_artifact_url(repo)


def test_a_tampered_blob_is_refused_and_nothing_is_published(
    tmp_path: Path, repo: str, registry: OciRegistry
) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files(big=200_000))
    open_remote(repo).push(artifact, signer=SIGNER)
    entry = read_manifest(artifact).files["graphs/ctx_128.pt2"]
    blob = registry.blob_path(f"sha256:{entry.sha256}")
    data = bytearray(blob.read_bytes())
    data[100] ^= 1  # same size: only the hash can tell
    blob.write_bytes(bytes(data))
    store = Store(tmp_path / "b")
    with pytest.raises(RemoteArtifactError, match="ctx_128.pt2 is corrupted"):
        open_remote(repo).pull(artifact.name, store)
    assert [p.name for p, _m in store.iter_artifacts()] == []


def test_an_unsigned_artifact_is_refused_before_any_layer_is_read(
    tmp_path: Path, repo: str, registry: OciRegistry
) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files(big=100_000))
    open_remote(repo).push(artifact)  # no signer
    before = registry.served_blob_bytes()
    with pytest.raises(SignatureError):
        open_remote(repo).pull(artifact.name, Store(tmp_path / "b"))
    served = registry.served_blob_bytes()
    layers = {f"sha256:{e.sha256}" for e in read_manifest(artifact).files.values()}
    assert all(served.get(d, 0) == before.get(d, 0) for d in layers)
    allowed = open_remote(repo).pull(artifact.name, Store(tmp_path / "c"),
                                     policy=TrustPolicy((), allow_unsigned=True))
    assert tree_bytes(allowed.path) == tree_bytes(artifact)


def test_path_like_layer_titles_are_refused(tmp_path: Path, repo: str) -> None:
    """A registry's titles are claims: one that leaves the artifact is refused."""
    from neuronctl.store.remote.oci_layout import parse_oci_manifest

    layer = {"mediaType": FILE_TYPE, "digest": "sha256:" + "a" * 64, "size": 1,
             "annotations": {TITLE: "../../etc/passwd"}}
    document = {"schemaVersion": 2, "config": {"mediaType": CONFIG_TYPE,
                "digest": "sha256:" + "b" * 64, "size": 2}, "layers": [layer]}
    with pytest.raises(RemoteArtifactError, match="etc/passwd"):
        parse_oci_manifest(json.dumps(document).encode(), "sha256:x", "here")
    layer["annotations"] = {TITLE: "weights/x"}
    layer["size"] = -1
    with pytest.raises(RemoteArtifactError, match="size"):
        parse_oci_manifest(json.dumps(document).encode(), "sha256:x", "here")


def test_oci_never_reaches_fsspec(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                  repo: str) -> None:
    """fsspec maps oci:// to Oracle Cloud Object Storage (ocifs): fsspec/registry.py,
    known_implementations["oci"] = "ocifs.OCIFileSystem"."""
    import fsspec.core

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("oci:// reached fsspec")

    monkeypatch.setattr(fsspec.core, "url_to_fs", refuse)
    artifact = make_artifact(tmp_path / "a", sample_files(big=1000))
    open_remote(repo).push(artifact, signer=SIGNER)
    path = resolve_artifacts_arg(f"{repo}:{artifact.name}", Store(tmp_path / "b"))
    assert tree_bytes(path) == tree_bytes(artifact)
    from neuronctl.store.remote.transport import open_fs

    with pytest.raises(UsageError, match="registry"):
        open_fs(repo)


def test_oracle_object_storage_urls_are_refused_with_the_way_to_reach_them() -> None:
    with pytest.raises(UsageError, match="Oracle") as info:
        open_remote("oci://my-bucket@my-namespace/prefix")
    assert "s3://" in (info.value.hint or "")


def test_plain_http_only_for_loopback_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PLAIN_HTTP_ENV, raising=False)
    assert parse_oci_url("oci://127.0.0.1:5000/r").plain_http()
    assert parse_oci_url("oci://localhost:5000/r").plain_http()
    assert parse_oci_url("oci://[::1]:5000/r").plain_http()
    assert not parse_oci_url("oci://registry.example.com/r").plain_http()
    assert not parse_oci_url("oci://127.0.0.1.nip.io/r").plain_http()
    monkeypatch.setenv(PLAIN_HTTP_ENV, "1")
    assert parse_oci_url("oci://registry.example.com/r").plain_http()
    monkeypatch.setenv(PLAIN_HTTP_ENV, "0")
    assert not parse_oci_url("oci://127.0.0.1:5000/r").plain_http()


def test_cli_push_and_pull_take_an_oci_url(tmp_path: Path, repo: str) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files(big=1000))
    store = tmp_path / "b"
    pushed = cli("artifacts", "push", str(artifact), repo, "--store", str(tmp_path / "a"),
                 "--json")
    assert pushed.returncode == 0, pushed.stderr
    result = cli("artifacts", "pull", f"{repo}:{artifact.name}", "--store", str(store), "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["artifact_key"] == read_manifest(artifact).artifact_key
    remote = open_remote(repo)
    assert remote.has(artifact.name) and not remote.has("0" * 20)


def test_an_unreachable_registry_is_one_line_not_a_retry_loop(tmp_path: Path) -> None:
    started = time.monotonic()
    result = cli("artifacts", "pull", "oci://127.0.0.1:9/none/repo:0123456789abcdef0123",
                 "--store", str(tmp_path / "s"))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and "127.0.0.1:9" in result.stderr
    assert time.monotonic() - started < 30


# -- credentials ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def auth_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OciRegistry]:
    server = OciRegistry(tmp_path_factory.mktemp("auth-registry"),
                         users={"ci": "s3cret"}).start()
    yield server
    server.stop()


def test_credentials_from_a_docker_config(
    tmp_path: Path, auth_registry: OciRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """oras-py reads `auths` of a docker config.json (oras/auth/base.py, _load_auth) and
    sends basic auth to a registry that challenges with `Basic` (oras/auth/basic.py)."""
    repo = f"oci://{auth_registry.host}/secured/models"
    artifact = make_artifact(tmp_path / "a", sample_files(big=1000))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))
    monkeypatch.delenv("ORAS_USER", raising=False)
    with pytest.raises(RemoteUnreachableError, match="refused the credentials"):
        open_remote(repo).push(artifact, signer=SIGNER)
    (tmp_path / "docker").mkdir()
    token = base64.b64encode(b"ci:s3cret").decode()
    (tmp_path / "docker" / "config.json").write_text(
        json.dumps({"auths": {auth_registry.host: {"auth": token}}}))
    open_remote(repo).push(artifact, signer=SIGNER)
    path = resolve_artifacts_arg(f"{repo}:{artifact.name}", Store(tmp_path / "b"))
    assert tree_bytes(path) == tree_bytes(artifact)


def test_credentials_from_the_environment(
    tmp_path: Path, auth_registry: OciRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = f"oci://{auth_registry.host}/env/models"
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "none"))
    monkeypatch.setenv("ORAS_USER", "ci")
    monkeypatch.setenv("ORAS_PASS", "wrong")
    artifact = make_artifact(tmp_path / "a", sample_files(big=1000))
    with pytest.raises(RemoteUnreachableError, match="refused the credentials"):
        open_remote(repo).push(artifact, signer=SIGNER)
    monkeypatch.setenv("ORAS_PASS", "s3cret")
    assert open_remote(repo).push(artifact, signer=SIGNER).signed_by == SIGNER.key_id


# -- resume --------------------------------------------------------------------------------

SLOW_PULL = """
import sys, time
import neuronctl.store.remote.oci as oci
from neuronctl.cli.main import main

plain = oci.blob_chunks

def slow(registry, blob, rel, start=0):
    for chunk in plain(registry, blob, rel, start):
        if blob.size > 1_000_000:
            time.sleep(0.05)
        yield chunk

oci.blob_chunks = slow
sys.argv = ["neuronctl", *sys.argv[1:]]
main()
"""


def killed_pull(tmp_path: Path, repo: str) -> tuple[str, Path, dict, Path]:
    """A CLI pull SIGKILLed while the big layer downloads (slowed to ~20 chunks/s), once the
    small layers are verified: its URL, store, manifest entries and the big layer's part."""
    files = {"config.json": b"{}", "small.bin": os.urandom(300_000),
             "weights/big.safetensors": os.urandom(8 * 1024 * 1024)}
    artifact = make_artifact(tmp_path / "a", files)
    open_remote(repo).push(artifact, signer=SIGNER)
    store = tmp_path / "b"
    cache = store / "neuron-compiled-artifacts" / BLOB_CACHE
    url = f"{repo}:{artifact.name}"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_PULL, "artifacts", "pull", url,
                             "--store", str(store)], cwd=ROOT, env=os.environ.copy(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    entries = read_manifest(artifact).files
    big = entries["weights/big.safetensors"].sha256
    kept = [e.sha256 for e in entries.values() if e.sha256 != big]
    deadline = time.monotonic() + 60
    while not (all((cache / sha).exists() for sha in kept)
               and sum(p.stat().st_size for p in cache.glob(f"{big}.partial-*")) > 1_000_000):
        assert proc.poll() is None and time.monotonic() < deadline, "pull did not start"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert [p.name for p, _m in Store(store).iter_artifacts()] == []
    (part,) = cache.glob(f"{big}.partial-*")
    return url, store, entries, part


def test_a_pull_killed_mid_layer_resumes_keeping_verified_layers(
    tmp_path: Path, repo: str, registry: OciRegistry
) -> None:
    """The re-run downloads neither the layers verified before the kill nor the part of
    the big one already written (a ranged GET), as the registry's own access log counts;
    the whole layer is hashed before it is used."""
    url, store, entries, part = killed_pull(tmp_path, repo)
    head = part.stat().st_size
    big = entries["weights/big.safetensors"]
    before = registry.served_blob_bytes()
    result = cli("artifacts", "pull", url, "--store", str(store), "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    served = registry.served_blob_bytes()
    again = {d: served.get(d, 0) - before.get(d, 0) for d in served}
    assert again.get(f"sha256:{entries['small.bin'].sha256}", 0) == 0
    assert again[f"sha256:{big.sha256}"] == big.size - head
    assert data["downloaded_bytes"] == big.size - head
    assert data["reused_bytes"] == entries["small.bin"].size + entries["config.json"].size + head
    assert tree_bytes(Path(data["path"])) == tree_bytes(tmp_path / "a" / "neuron-compiled-artifacts"
                                                        / Path(data["path"]).name)
    assert not any((store / "neuron-compiled-artifacts" / BLOB_CACHE).iterdir())


def test_a_damaged_part_left_by_a_killed_pull_is_downloaded_again(
    tmp_path: Path, repo: str, registry: OciRegistry
) -> None:
    """Resumed bytes are hashed with the rest: a head that is not the layer's costs one
    full download, never a wrong file."""
    url, store, entries, part = killed_pull(tmp_path, repo)
    data = bytearray(part.read_bytes())
    data[10] ^= 1
    part.write_bytes(bytes(data))
    big = entries["weights/big.safetensors"]
    before = registry.served_blob_bytes()
    result = cli("artifacts", "pull", url, "--store", str(store), "--json")
    assert result.returncode == 0, result.stderr
    served = registry.served_blob_bytes()
    sent = served[f"sha256:{big.sha256}"] - before.get(f"sha256:{big.sha256}", 0)
    assert sent == big.size - len(data) + big.size
    pulled = Path(json.loads(result.stdout)["path"])
    assert tree_bytes(pulled) == tree_bytes(tmp_path / "a" / "neuron-compiled-artifacts"
                                            / pulled.name)


def test_a_dry_run_names_an_oci_artifact_not_pulled_yet(tmp_path: Path, repo: str) -> None:
    from neuronctl.store.resolve import NotPulledError, resolve_artifact

    artifact = make_artifact(tmp_path / "a", sample_files(big=1000))
    open_remote(repo).push(artifact, signer=SIGNER)
    with pytest.raises(NotPulledError):
        resolve_artifact(f"{repo}:{artifact.name}", tmp_path / "b", fetch=False)
    unsigned = make_artifact(tmp_path / "u", sample_files(big=10), seed="u")
    open_remote(repo).push(unsigned)
    with pytest.raises(SignatureError):  # a dry run still refuses what a pull would
        resolve_artifact(f"{repo}:{unsigned.name}", tmp_path / "b", fetch=False)


def test_another_tools_oci_artifact_is_refused_as_not_neuronctl(
    tmp_path: Path, repo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An artifact `oras push` made (oras-py's Registry.push, its default config media type
    application/vnd.unknown.config.v1+json: oras/defaults.py) is not read as one of ours."""
    import oras.client

    (tmp_path / "model.bin").write_bytes(b"weights")
    target = f"{repo.removeprefix('oci://')}:other"
    monkeypatch.chdir(tmp_path)  # oras-py pushes only files under the working directory
    oras.client.OrasClient(insecure=True).push(target=target, files=["model.bin"])
    with pytest.raises(RemoteArtifactError, match="not a neuronctl artifact"):
        resolve_artifacts_arg(f"{repo}:other", Store(tmp_path / "s"))


def test_a_manifest_whose_layers_differ_from_the_signed_list_is_refused_unread(
    tmp_path: Path, repo: str, registry: OciRegistry
) -> None:
    """The signature covers manifest.json (the config), not the registry's manifest: a
    layer re-pointed at other bytes is refused before any layer is downloaded."""
    artifact = make_artifact(tmp_path / "a", sample_files(big=100_000))
    remote = open_remote(repo)
    assert isinstance(remote, OciStore)
    remote.push(artifact, signer=SIGNER)
    document = manifest_of(remote, artifact.name)
    layers = [x for x in document["layers"] if x["mediaType"] == FILE_TYPE]
    small = next(x for x in layers if x["annotations"][TITLE] == "config.json")
    target = next(x for x in layers if x["annotations"][TITLE] == "graphs/ctx_128.pt2")
    target.update(digest=small["digest"], size=small["size"])
    (signature,) = referred_signatures(remote, artifact.name)
    forged = json.dumps(document).encode()
    remote.registry.put_manifest(forged, artifact.name)
    # the genuine signature, attached to the forged manifest as anyone with push rights could
    attach(remote.registry, Blob(f"sha256:{hashlib.sha256(forged).hexdigest()}", len(forged)),
           signature)
    before = registry.served_blob_bytes()
    with pytest.raises(RemoteArtifactError, match="ctx_128.pt2 is .* the signed manifest says"):
        open_remote(repo).pull(artifact.name, Store(tmp_path / "b"))
    served = registry.served_blob_bytes()
    assert all(served.get(x["digest"], 0) == before.get(x["digest"], 0) for x in layers)


def test_a_blob_longer_than_its_size_is_cut_off_not_read_whole(
    tmp_path: Path, repo: str, registry: OciRegistry
) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files(big=100_000))
    open_remote(repo).push(artifact, signer=SIGNER)
    entry = read_manifest(artifact).files["graphs/ctx_128.pt2"]
    with open(registry.blob_path(f"sha256:{entry.sha256}"), "ab") as blob:
        blob.write(os.urandom(5 * 1024 * 1024))
    with pytest.raises(RemoteArtifactError, match="over 100000 bytes"):
        open_remote(repo).pull(artifact.name, Store(tmp_path / "b"))


def test_gc_removes_the_layers_killed_pulls_kept_unless_a_pull_runs(tmp_path: Path) -> None:
    from neuronctl.store.gc import collect

    store = Store(tmp_path / "s")
    cache = store.artifacts / BLOB_CACHE
    cache.mkdir(parents=True)
    (cache / f"{'a' * 64}.partial-999999-0000").write_bytes(b"x" * 10)
    (cache / ("b" * 64)).write_bytes(b"y" * 5)
    running = store.new_staging("c" * 20)
    with store.lock("c" * 20):
        assert collect(store).leftovers == []  # a pull holds its lock: it may link them
        assert len(list(cache.iterdir())) == 2
    kept = set(cache.iterdir())
    report = collect(store)
    assert set(report.leftovers) == {running, *kept}
    assert report.freed_bytes == 15
    assert not any(cache.iterdir())


@pytest.fixture(scope="module")
def token_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OciRegistry]:
    from tests.ociregistry import TokenServer

    root = tmp_path_factory.mktemp("token-registry")
    tokens = TokenServer(root, {"ci": "t0ken-pass"})
    server = OciRegistry(root, tokens=tokens).start()
    yield server
    server.stop()
    tokens.stop()


def test_bearer_token_registries_push_and_pull(
    tmp_path: Path, token_registry: OciRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The flow of Docker Hub, GHCR and Harbor: a `Bearer realm=...,scope=...` challenge,
    a token for that scope from the realm with the docker config's credentials (oras-py,
    oras/auth/token.py request_token); a push needs a second token, of push scope."""
    repo = f"oci://{token_registry.host}/bearer/models"
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))
    (tmp_path / "docker").mkdir()
    token = base64.b64encode(b"ci:t0ken-pass").decode()
    (tmp_path / "docker" / "config.json").write_text(
        json.dumps({"auths": {token_registry.host: {"auth": token}}}))
    artifact = make_artifact(tmp_path / "a", sample_files(big=100_000))
    open_remote(repo).push(artifact, signer=SIGNER)
    assert token_registry.tokens is not None
    assert any("push" in scope for scope in token_registry.tokens.scopes)
    path = resolve_artifacts_arg(f"{repo}:{artifact.name}", Store(tmp_path / "b"))
    assert tree_bytes(path) == tree_bytes(artifact)
    (tmp_path / "docker" / "config.json").write_text(json.dumps({"auths": {}}))
    with pytest.raises(NeuronctlError):
        resolve_artifacts_arg(f"{repo}:{artifact.name}", Store(tmp_path / "c"))


def test_plan_says_which_builds_the_registry_has(tmp_path: Path, repo: str) -> None:
    make_checkpoint(tmp_path / "models" / "llama", "llama")
    builds = tmp_path / "builds.toml"
    builds.write_text('[[build]]\nmodel = "./models/llama"\nmatrix = { batch_size = [1, 2] }\n')
    present = push_entry(builds, 1, repo, tmp_path)
    result = cli_in_process("plan", "builds.toml", "--remote", repo, "--json",
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert [b["remote"] for b in data["builds"]] == [False, True]
    assert data["builds"][1]["key"] == present
    assert data["remote"] == repo


def test_validate_takes_an_oci_url_and_names_it_as_the_origin(tmp_path: Path, repo: str) -> None:
    """Commands that take --artifacts or a path take the URL too: pulled, verified, and the
    trust check names the pinned manifest it came from."""
    artifact = make_artifact(tmp_path / "a", sample_files(big=1000))
    open_remote(repo).push(artifact, signer=SIGNER)
    result = cli("validate", f"{repo}:{artifact.name}", "--json",
                 env={"NEURONCTL_STORE": str(tmp_path / "s")})
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["trust"]["ok"], checks["trust"]
    assert f"{repo}@sha256:" in checks["trust"]["reason"]
    assert (tmp_path / "s" / "neuron-compiled-artifacts" / artifact.name).is_dir()


def test_a_layer_another_pull_dropped_from_the_cache_is_fetched_again(
    tmp_path: Path, repo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two pulls (two artifacts, one shared layer) share the layer cache: when the other
    publishes and drops the cached copy between this one's check and its link, the layer is
    downloaded again, not reported as a disk failure."""
    import neuronctl.store.remote.oci as oci

    artifact = make_artifact(tmp_path / "a", sample_files(big=10_000))
    open_remote(repo).push(artifact, signer=SIGNER)
    plain, dropped = oci._link_or_copy, []

    def raced(source: Path, dest: Path) -> None:
        if not dropped:
            dropped.append(source)
            source.unlink()  # what the other pull's publish does
        plain(source, dest)

    monkeypatch.setattr(oci, "_link_or_copy", raced)
    published = open_remote(repo).pull(artifact.name, Store(tmp_path / "b"))
    assert dropped and tree_bytes(published.path) == tree_bytes(artifact)


def test_an_interrupted_push_is_invisible_and_resumes_with_the_layers_sent(
    tmp_path: Path, repo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tag is put last: a push that died after some layers leaves no artifact, and the
    next one sends only the layers the registry lacks."""
    from neuronctl.store.remote.oci_registry import Registry

    artifact = make_artifact(tmp_path / "a", sample_files(big=100_000))
    plain, sent = Registry.put_blob, []

    def dies_after_two(self: Registry, source: Path, digest: str, size: int) -> None:
        if len(sent) == 2:
            raise RemoteUnreachableError("connection lost")
        sent.append(source)
        plain(self, source, digest, size)

    monkeypatch.setattr(Registry, "put_blob", dies_after_two)
    monkeypatch.setattr("neuronctl.store.remote.transport.TRANSFER_THREADS", 1)
    with pytest.raises(RemoteUnreachableError):
        open_remote(repo).push(artifact, signer=SIGNER)
    assert not open_remote(repo).has(artifact.name)
    monkeypatch.setattr(Registry, "put_blob", plain)
    result = open_remote(repo).push(artifact, signer=SIGNER)
    files = read_manifest(artifact).files
    assert len(result.skipped) == 2
    assert len(result.uploaded) == len(files) - 2 + 2  # the rest, manifest.sig, manifest.json
    assert open_remote(repo).has(artifact.name)


# -- the signature as a referrer -------------------------------------------------------------
# distribution-spec (opencontainers/distribution-spec spec.md at 967efdc0): "Pushing Manifests
# with Subject" (lines 544-557: without an OCI-Subject header on the PUT, the client appends a
# descriptor, artifactType and annotations copied, to the index at the referrers tag),
# "Listing Referrers" (lines 617-632, 676-710: a registry with the API never answers 404; on a
# 404 the client reads the tag), "Referrers Tag Schema" (lines 787-805: `sha256-<hex>`). The
# same steps in oras-go (oras-project/oras-go registry/remote/repository.go at 19db72b1:
# pushWithIndexing line 1526, indexReferrersForPush 1562, updateReferrersIndex 1619;
# referrers.go buildReferrersTag line 107), which `oras attach` and `oras discover` run.


def referrers_index(store: OciStore, reference: str) -> dict:
    artifact = store.fetch(reference)
    assert artifact is not None
    found = store.registry.get_manifest(referrers_tag(artifact.digest),
                                        accept="application/vnd.oci.image.index.v1+json")
    assert found is not None
    return json.loads(found[0])


def test_the_signature_is_a_referrer_listed_under_the_tag_schema(
    tmp_path: Path, repo: str
) -> None:
    """distribution 2.8 has no referrers API (it answers 404): the push keeps the
    `sha256-<hex>` index, whose entry names a manifest with `subject` = the artifact's
    manifest, artifactType the sigstore bundle type, and model.sig as its one layer."""
    import requests

    artifact = make_artifact(tmp_path / "a", sample_files(big=1000))
    remote = open_remote(repo)
    assert isinstance(remote, OciStore)
    remote.push(artifact, signer=SIGNER)
    held = remote.fetch(artifact.name)
    assert held is not None
    api = f"http://{remote.ref.registry}/v2/{remote.ref.repository}/referrers/{held.digest}"
    assert requests.get(api, timeout=10).status_code == 404
    index = referrers_index(remote, artifact.name)
    assert index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    (entry,) = index["manifests"]
    assert entry["artifactType"] == SIGNATURE_ARTIFACT_TYPE
    assert entry["annotations"]["dev.neuronctl.signature.key"] == SIGNER.key_id[:16]
    found = remote.registry.get_manifest(entry["digest"])
    assert found is not None and len(found[0]) == entry["size"]
    document = json.loads(found[0])
    assert document["subject"] == {"mediaType": "application/vnd.oci.image.manifest.v1+json",
                                   "digest": held.digest, "size": held.size}
    assert document["config"]["mediaType"] == "application/vnd.oci.empty.v1+json"
    (layer,) = document["layers"]
    assert layer["annotations"][TITLE] == SIGNATURE
    bundle = remote.registry.read_blob(layer["digest"], layer["size"], "sig")
    assert json.loads(bundle)["mediaType"] == SIGNATURE_ARTIFACT_TYPE
    assert referred_signatures(remote, artifact.name) == [bundle]
    published = remote.pull(artifact.name, Store(tmp_path / "b"))
    record = json.loads((published.path / "provenance.json").read_text())
    assert record["signature"] == bundle.decode() and "verified_with" in record


def test_a_second_signature_is_added_and_the_one_a_trusted_key_made_is_used(
    tmp_path: Path, repo: str
) -> None:
    """Re-signed by another key: both referrers stay listed (newest last); a pull uses the
    first, newest first, that a key trusted there made, and says how many failed when none
    did. A signature that does not match the manifest is never the one used."""
    from neuronctl.store.signing import TrustedKey, public_pem, sign
    from tests.test_remote import TRUST
    from tests.test_signing import STRANGER, STRANGER_KEY

    artifact = make_artifact(tmp_path / "a", sample_files(big=1000))
    remote = open_remote(repo)
    assert isinstance(remote, OciStore)
    remote.push(artifact, signer=SIGNER)
    again = open_remote(repo).push(artifact, signer=STRANGER)
    assert again.uploaded == [SIGNATURE] and again.signed_by == STRANGER.key_id
    assert open_remote(repo).push(artifact, signer=STRANGER).uploaded == []  # already there
    index = referrers_index(remote, artifact.name)
    assert [e["annotations"]["dev.neuronctl.signature.key"] for e in index["manifests"]] == [
        SIGNER.key_id[:16], STRANGER.key_id[:16]]
    stranger = TrustPolicy((TrustedKey(STRANGER_KEY.public_key(), STRANGER.key_id, "t"),))
    for n, (policy, signer) in enumerate([(TRUST, SIGNER), (stranger, STRANGER)]):
        published = open_remote(repo).pull(artifact.name, Store(tmp_path / f"s{n}"),
                                           policy=policy)
        record = json.loads((published.path / "provenance.json").read_text())
        assert record["verified_with"] == public_pem(signer.key.public_key())
    with pytest.raises(SignatureError, match="and 1 more signatures, none by a trusted key"):
        open_remote(repo).pull(artifact.name, Store(tmp_path / "none"), policy=TrustPolicy())
    # the newest signature vouches for other bytes (another build's): the older one is used
    other = make_artifact(tmp_path / "o", sample_files(big=1000), seed="other")
    held = remote.fetch(artifact.name)
    assert held is not None
    attach(remote.registry, Blob(held.digest, held.size),
           sign((other / "manifest.json").read_bytes(), SIGNER))
    assert len(referred_signatures(remote, artifact.name)) == 3
    published = open_remote(repo).pull(artifact.name, Store(tmp_path / "t"), policy=TRUST)
    assert tree_bytes(published.path) == tree_bytes(artifact)


def test_a_listed_referrer_of_another_manifest_vouches_for_nothing(
    tmp_path: Path, repo: str
) -> None:
    """The referrers list is the registry's (or any pusher's) claim: a listed signature whose
    `subject` is another manifest is not this manifest's signature, even when it covers the
    same manifest.json. Here a copy of the artifact's manifest (one annotation more, so
    another digest) lists the original's signature under its own referrers tag."""
    artifact = make_artifact(tmp_path / "a", sample_files(big=1000))
    remote = open_remote(repo)
    assert isinstance(remote, OciStore)
    remote.push(artifact, signer=SIGNER)
    document = manifest_of(remote, artifact.name)
    document["annotations"]["org.example.copy"] = "1"
    copy = json.dumps(document).encode()
    remote.registry.put_manifest(copy, "copy")
    copy_digest = f"sha256:{hashlib.sha256(copy).hexdigest()}"
    index = referrers_index(remote, artifact.name)
    remote.registry.put_manifest(json.dumps(index).encode(), referrers_tag(copy_digest),
                                 "application/vnd.oci.image.index.v1+json")
    with pytest.raises(SignatureError, match="is not signed"):
        resolve_artifacts_arg(f"{repo}:copy", Store(tmp_path / "b"))
    assert tree_bytes(resolve_artifacts_arg(f"{repo}:{artifact.name}", Store(tmp_path / "c"))) \
        == tree_bytes(artifact)


def test_the_referrers_api_answer_is_used_and_checked_like_the_tag(
    tmp_path: Path, repo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A registry with the referrers API answers the GET: its list is used
    instead of the tag's, and is as much a claim. distribution 2.8 has no such API, so its
    answer is played here: first a list naming a manifest that does not exist, then the
    real one. The query names the signature's artifactType (spec lines 676-683)."""
    from neuronctl.store.remote.oci_registry import Registry

    artifact = make_artifact(tmp_path / "a", sample_files(big=1000))
    remote = open_remote(repo)
    assert isinstance(remote, OciStore)
    remote.push(artifact, signer=SIGNER)
    real = json.dumps(referrers_index(remote, artifact.name)).encode()
    asked: list[tuple[str, str]] = []
    bogus = {"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "size": 10,
        "digest": "sha256:" + "e" * 64, "artifactType": SIGNATURE_ARTIFACT_TYPE}]}
    answer = [json.dumps(bogus).encode()]

    def api(self: Registry, digest: str, artifact_type: str) -> bytes:
        asked.append((digest, artifact_type))
        return answer[0]

    monkeypatch.setattr(Registry, "referrers", api)
    with pytest.raises(SignatureError, match="is not signed"):
        open_remote(repo).pull(artifact.name, Store(tmp_path / "b"))
    held = remote.fetch(artifact.name)
    assert held is not None and asked[0] == (held.digest, SIGNATURE_ARTIFACT_TYPE)
    answer[0] = real
    published = open_remote(repo).pull(artifact.name, Store(tmp_path / "c"))
    assert tree_bytes(published.path) == tree_bytes(artifact)


def test_a_signature_over_its_size_limit_is_refused_unread(
    tmp_path: Path, repo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import neuronctl.store.remote.oci_referrers as referrers

    artifact = make_artifact(tmp_path / "a", sample_files(big=1000))
    open_remote(repo).push(artifact, signer=SIGNER)
    monkeypatch.setattr(referrers, "MAX_SIGNATURE_BYTES", 100)
    with pytest.raises(RemoteArtifactError, match="model.sig is over the size limit"):
        open_remote(repo).pull(artifact.name, Store(tmp_path / "b"))


def test_an_artifact_signed_the_earlier_way_is_refused_until_signed_again(
    tmp_path: Path, repo: str
) -> None:
    """Earlier releases pushed the signature as a layer of the artifact's manifest; it is not
    read: the refusal says how to sign it as a referrer, and that push does it."""
    artifact = make_artifact(tmp_path / "a", sample_files(big=1000))
    remote = open_remote(repo)
    assert isinstance(remote, OciStore)
    remote.push(artifact)  # unsigned
    document = manifest_of(remote, artifact.name)
    from neuronctl.store.signing import sign

    old = sign((artifact / "manifest.json").read_bytes(), SIGNER)
    document["layers"].append({"mediaType": OLD_SIGNATURE_TYPE, "size": len(old),
                               "digest": remote.registry.put_bytes(old),
                               "annotations": {TITLE: SIGNATURE}})
    remote.registry.put_manifest(json.dumps(document).encode(), artifact.name)
    with pytest.raises(RemoteArtifactError, match="inside its manifest") as info:
        open_remote(repo).pull(artifact.name, Store(tmp_path / "b"))
    assert "--sign-key" in (info.value.hint or "")
    assert open_remote(repo).push(artifact, signer=SIGNER).uploaded == [SIGNATURE]
    published = open_remote(repo).pull(artifact.name, Store(tmp_path / "c"))
    assert tree_bytes(published.path) == tree_bytes(artifact)


def test_a_legacy_manifest_sig_is_not_pushed_to_a_registry(tmp_path: Path, repo: str) -> None:
    """An artifact pulled with an earlier release's ed25519 manifest.sig is pushed with that
    signature elsewhere; a registry carries only model-signing bundles: refused before any
    upload, with the way to sign it."""
    from neuronctl.store.signing import Provenance

    artifact = make_artifact(tmp_path / "a", sample_files(big=1000))
    legacy = json.dumps({"format": "neuronctl-signature/1", "signature": "AA=="}).encode()
    record = Provenance("s3://b/p", (artifact / "manifest.json").read_bytes(), legacy)
    (artifact / "provenance.json").write_text(record.to_json())
    with pytest.raises(RemoteArtifactError, match="earlier release's format") as info:
        open_remote(repo).push(artifact)
    assert "--sign-key" in (info.value.hint or "")
    assert not open_remote(repo).has(artifact.name)


def test_no_tag_index_is_kept_where_the_registry_indexes_subjects_itself(
    tmp_path: Path, repo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A registry with the referrers API answers the PUT of a manifest with a `subject` with
    an `OCI-Subject` header (spec lines 544-546; oras-go checkOCISubjectHeader): the client
    keeps no `sha256-<hex>` index then. distribution 2.8 never sends it, so here it is
    added to its answer."""
    from neuronctl.store.remote.oci_registry import Registry

    plain = Registry.put_manifest

    def indexing(self: Registry, data: bytes, reference: str, *args: str) -> bool:
        plain(self, data, reference, *args)
        return b'"subject"' in data

    monkeypatch.setattr(Registry, "put_manifest", indexing)
    artifact = make_artifact(tmp_path / "a", sample_files(big=1000))
    remote = open_remote(repo)
    assert isinstance(remote, OciStore)
    remote.push(artifact, signer=SIGNER)
    held = remote.fetch(artifact.name)
    assert held is not None
    assert remote.registry.get_manifest(referrers_tag(held.digest),
                                        accept="application/vnd.oci.image.index.v1+json") is None


def test_the_referrers_query_over_http() -> None:
    """What goes over the wire to a registry with the referrers API: `GET
    /v2/<repo>/referrers/<digest>?artifactType=<type, URL-encoded>` accepting an image index
    (spec lines 617, 676-683); its answer read capped; a 404 means no API."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from neuronctl.store.remote.oci_registry import Registry

    seen: list[tuple[str, str]] = []
    body = b'{"schemaVersion": 2, "manifests": []}'

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            seen.append((self.path, self.headers.get("Accept", "")))
            found = self.path == "/v2/" or "/api/" in self.path
            self.send_response(200 if found else 404)
            self.send_header("Content-Length", str(len(body) if found else 0))
            self.end_headers()
            if found:
                self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        host = f"127.0.0.1:{server.server_address[1]}"
        digest = "sha256:" + "a" * 64
        with_api = Registry(parse_oci_url(f"oci://{host}/with/api"))
        assert with_api.referrers(digest, SIGNATURE_ARTIFACT_TYPE) == body
        assert seen[-1] == (
            f"/v2/with/api/referrers/{digest}?artifactType="
            "application%2Fvnd.dev.sigstore.bundle.v0.3%2Bjson",
            "application/vnd.oci.image.index.v1+json")
        assert Registry(parse_oci_url(f"oci://{host}/none")).referrers(digest, "x") is None
    finally:
        server.shutdown()
