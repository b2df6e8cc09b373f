"""`neuronctl install SOURCE_URI DEST_DIR` and the record it shares with pull: an artifact is
installed verified, loads afterwards with no flag, and stops loading once its key is revoked.

The install runs as a real process (it is what a container's entrypoint runs); KServe's
storage-initializer contract it takes: kserve/kserve
python/storage-initializer/scripts/initializer-entrypoint lines 10-15 (SOURCE_URI DEST_DIR
pairs) and 25-32 (exit 1 on any failure)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from neuronctl.store.install import WORK_DIR
from neuronctl.store.local import Store
from neuronctl.store.manifest import MANIFEST, read_manifest, record_files, write_manifest
from neuronctl.store.remote.client import open_remote
from neuronctl.store.remote.errors import RemoteArtifactError
from neuronctl.store.signing import (
    PROVENANCE,
    REVOKED_KEYS_ENV,
    TRUSTED_KEYS_ENV,
    TrustPolicy,
)
from tests.helpers import cli_in_process, run_in_process
from tests.ociregistry import OciRegistry, registry_binary
from tests.test_oci import registry, repo  # noqa: F401  (fixtures)
from tests.test_remote import (  # noqa: F401  (fixtures)
    SIGNER,
    bucket,
    make_artifact,
    s3server,
    sample_files,
    trusted_env,
)
from tests.test_server import free_port, serve_argv
from tests.test_signing import STRANGER_KEY, PatientServer, write_keypair

ROOT = Path(__file__).resolve().parents[1]


def install_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "neuronctl.cli.main", "install", *args]


def run_install(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(install_argv(*args), capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})  # fmt: skip


def without_trust() -> dict[str, str]:
    """The environment of a serving container that trusts no key of its own."""
    return {TRUSTED_KEYS_ENV: ""}


def trust_reason(validate_json: str) -> str:
    checks = json.loads(validate_json)["checks"]
    return str(next(c for c in checks if c["name"] == "trust")["reason"])


def pushed(artifact: Path, root: Path) -> str:
    """`artifact` on a shared mount, signed by the publisher; its URL/KEY."""
    open_remote(str(root)).push(artifact, signer=SIGNER)
    return f"{root.as_uri()}/{artifact.name}"


def test_installed_artifact_loads_with_no_flag_until_its_key_is_revoked(
    tmp_path: Path,
    compiled_artifact: Path,
    trusted_env: tuple[Path, Path],  # noqa: F811
    capsys,
    monkeypatch,
) -> None:  # type: ignore[no-untyped-def]
    url = pushed(compiled_artifact, tmp_path / "remote")
    dest = tmp_path / "models"
    done = run_install(url, str(dest), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["trusted"] == "signature"
    assert "neuronctl install: verified" in done.stderr and "Traceback" not in done.stderr
    assert not (dest / WORK_DIR).exists()

    # The serving side trusts no key itself: the record vouches.
    monkeypatch.setenv(TRUSTED_KEYS_ENV, "")
    checked = cli_in_process("validate", str(dest), "--json")
    assert checked.returncode == 0, checked.stdout
    assert f"key {SIGNER.key_id}, trusted when it was pulled" in trust_reason(checked.stdout)
    code, out, _ = run_in_process(
        ["generate", str(dest), "-p", "hello", "--max-tokens", "2", "--json"], capsys, monkeypatch
    )
    assert code == 0 and json.loads(out.splitlines()[0])["completion_tokens"] == 2

    # Revoking the key stops it, with the record still there.
    monkeypatch.setenv(REVOKED_KEYS_ENV, str(trusted_env[1]))
    revoked = cli_in_process("validate", str(dest), "--json")
    assert revoked.returncode == 1 and "revoked" in trust_reason(revoked.stdout)
    monkeypatch.delenv(REVOKED_KEYS_ENV)
    # So does removing the record: DEST_DIR is in no store this user owns.
    (dest / PROVENANCE).unlink()
    assert cli_in_process("validate", str(dest)).returncode == 1


def test_a_record_others_could_write_names_no_key(
    tmp_path: Path, compiled_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Anyone who can write DEST_DIR could plant a record naming their own key: such a record
    is not used. The load rule refuses such a directory before the record is read, so the
    refusal names the directory."""
    dest = tmp_path / "models"
    assert run_install(pushed(compiled_artifact, tmp_path / "remote"), str(dest)).returncode == 0
    monkeypatch.setenv(TRUSTED_KEYS_ENV, "")
    assert cli_in_process("validate", str(dest)).returncode == 0
    os.chmod(dest, 0o777)
    shared = cli_in_process("validate", str(dest), "--json")
    assert shared.returncode == 1
    assert "writable by other users" in trust_reason(shared.stdout)


def test_install_is_atomic_and_resumes_after_a_kill(
    tmp_path: Path, compiled_artifact: Path, bucket: str, s3server  # noqa: F811
) -> None:  # type: ignore[no-untyped-def]
    """SIGKILL while the big file downloads: nothing looks installed; the rerun resumes the
    partial file and downloads only the rest; a third run downloads nothing."""
    artifact = Store(tmp_path / "build").root / "neuron-compiled-artifacts" / compiled_artifact.name
    shutil.copytree(compiled_artifact, artifact)
    big = 64 * 2**20
    (artifact / "weights" / "extra.bin").write_bytes(os.urandom(big))
    write_manifest(artifact, record_files(artifact, read_manifest(artifact)))
    url = f"s3://{bucket}/fleet"
    open_remote(url).push(artifact, signer=SIGNER)
    dest = tmp_path / "models"

    s3server.reset_counts()
    child = subprocess.Popen(install_argv(f"{url}/{artifact.name}", str(dest)),
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert child.stderr is not None
    for line in child.stderr:
        if "downloading weights/extra.bin: " in line:  # mid-file progress
            child.send_signal(signal.SIGKILL)
            break
    child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert not (dest / MANIFEST).exists()
    assert cli_in_process("validate", str(dest)).returncode == 1
    partial = [p.stat().st_size for p in (dest / WORK_DIR).glob("*.part")]
    assert partial and 0 < max(partial) < big

    s3server.reset_counts()
    rerun = run_install(f"{url}/{artifact.name}", str(dest), "--json")
    assert rerun.returncode == 0, rerun.stderr
    assert "resuming weights/extra.bin" in rerun.stderr
    result = json.loads(rerun.stdout)
    total = read_manifest(dest).total_size()
    assert result["downloaded_bytes"] + result["kept_bytes"] == total
    assert result["downloaded_bytes"] <= big - max(partial) + (total - big)
    assert s3server.bytes_downloaded < total  # the server saw only the rest

    again = run_install(f"{url}/{artifact.name}", str(dest), "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["downloaded_bytes"] == 0


def test_install_refusals_name_what_to_fix(
    tmp_path: Path,
    compiled_artifact: Path,
    trusted_env: tuple[Path, Path],  # noqa: F811
) -> None:
    url = pushed(compiled_artifact, tmp_path / "remote")
    _, stranger = write_keypair(STRANGER_KEY, tmp_path / "stranger")

    untrusted = run_install(url, str(tmp_path / "a"), env={TRUSTED_KEYS_ENV: str(stranger)})
    assert untrusted.returncode == 1 and "not trusted here" in untrusted.stderr
    assert "hint:" in untrusted.stderr and not (tmp_path / "a" / MANIFEST).exists()

    revoked = run_install(url, str(tmp_path / "b"), env={REVOKED_KEYS_ENV: str(trusted_env[1])})
    assert revoked.returncode == 1 and "revoked" in revoked.stderr

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    refused = run_install(url, str(busy))
    assert refused.returncode == 2 and "not empty" in refused.stderr
    assert (busy / "notes.txt").read_text() == "mine"

    assert run_install(url).returncode == 2  # SOURCE_URI without DEST_DIR


def test_host_checks_run_before_any_download(tmp_path: Path) -> None:
    """An artifact built for other versions is refused from its manifest alone."""
    artifact = make_artifact(tmp_path / "a", sample_files(big=2 * 2**20))  # torch "test"
    url = pushed(artifact, tmp_path / "remote")
    refused = run_install(url, str(tmp_path / "models"))
    assert refused.returncode == 1 and "would not load on this host" in refused.stderr
    assert "versions" in refused.stderr
    assert not list((tmp_path / "models").rglob("*.part"))
    assert not (tmp_path / "models" / "graphs").exists()


def test_pull_trusted_by_flag_then_validate_and_generate_with_no_flag(
    tmp_path: Path,
    compiled_artifact: Path,
    trusted_env: tuple[Path, Path],  # noqa: F811
    capsys,
    monkeypatch,
) -> None:  # type: ignore[no-untyped-def]
    """`artifacts pull URL --trust-key ci.pub` then `validate KEY` and `generate KEY` failed
    "not trusted here (trusted: none)"; the pull's record now names the key."""
    url = pushed(compiled_artifact, tmp_path / "remote")
    monkeypatch.setenv(TRUSTED_KEYS_ENV, "")
    monkeypatch.setenv("NEURONCTL_STORE", str(tmp_path / "host"))
    pulled = cli_in_process("artifacts", "pull", url, "--trust-key", str(trusted_env[1]))
    assert pulled.returncode == 0, pulled.stderr
    key = compiled_artifact.name
    assert cli_in_process("validate", key).returncode == 0
    code, _, err = run_in_process(["generate", key, "-p", "hi", "--max-tokens", "2"], capsys,
                                  monkeypatch)  # fmt: skip
    assert code == 0, err
    monkeypatch.setenv(REVOKED_KEYS_ENV, str(trusted_env[1]))
    assert cli_in_process("validate", key).returncode == 1


def test_installing_another_artifact_over_an_install_keeps_shared_files(tmp_path: Path) -> None:
    """The fill-a-volume job run with a new artifact: the old one stops looking installed
    first, files both list are kept (not downloaded), the old one's other files go."""
    from neuronctl.store.install import install

    shared = os.urandom(300_000)
    old = make_artifact(tmp_path / "a", {"weights/w.bin": shared, "graphs/old.pt2": b"o" * 10},
                        seed="old")  # fmt: skip
    new = make_artifact(tmp_path / "b", {"weights/w.bin": shared, "graphs/new.pt2": b"n" * 10},
                        seed="new")  # fmt: skip
    root = tmp_path / "remote"
    lines: list[str] = []
    dest = tmp_path / "models"
    install(pushed(old, root), dest, TrustPolicy.load(), lambda m: [], lines.append)
    assert (dest / "graphs" / "old.pt2").exists()

    result = install(pushed(new, root), dest, TrustPolicy.load(), lambda m: [], lines.append)
    assert result.downloaded_bytes == 10 and result.kept_bytes == len(shared)
    assert not (dest / "graphs" / "old.pt2").exists() and (dest / "graphs" / "new.pt2").exists()
    assert read_manifest(dest).artifact_key == read_manifest(new).artifact_key
    assert not (dest / WORK_DIR).exists()


@pytest.mark.slow  # a server process; generate covers the same load rule in the fast suite
def test_serve_loads_an_installed_artifact_with_no_flag(
    tmp_path: Path, compiled_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The serving container of a pod trusts no key itself: `serve DEST_DIR` after the
    install container ran."""
    dest = tmp_path / "models"
    assert run_install(pushed(compiled_artifact, tmp_path / "remote"), str(dest)).returncode == 0
    monkeypatch.setenv(TRUSTED_KEYS_ENV, "")
    port = free_port()
    server = PatientServer(serve_argv(dest, port), port)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        done = client.completions.create(model=model, prompt="hi", max_tokens=3, temperature=0)
        assert done.usage is not None and done.usage.completion_tokens == 3
    finally:
        server.stop()
    assert f"key {SIGNER.key_id}, trusted when it was pulled" in server.log()


def test_an_unknown_scheme_is_a_usage_error_naming_the_known_ones(tmp_path: Path) -> None:
    dest = tmp_path / "models"
    for source in ("nosuch://x", "nosuch://bucket/prefix/KEY"):
        result = run_install(source, str(dest))
        assert result.returncode == 2, result.stderr
        assert "unknown URI scheme nosuch://" in result.stderr
        assert "s3://" in result.stderr and "oci://" in result.stderr
        assert "Traceback" not in result.stderr and not dest.exists()


def test_a_shared_dest_dir_is_made_writable_by_its_owner_only(
    tmp_path: Path, compiled_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KServe's /mnt/models is an emptyDir, mode 0777: install takes it 0755, so that the
    load after it (which trusts no directory another user can write, nor either directory
    above it) accepts it with no flag. Directories it makes are 0755 whatever the umask."""
    from neuronctl.store.install import install

    url = pushed(compiled_artifact, tmp_path / "remote")
    shared = tmp_path / "emptydir"
    shared.mkdir()
    os.chmod(shared, 0o777)
    install(url, shared, TrustPolicy.load(), lambda m: [], lambda line: None)
    old = os.umask(0)
    try:
        nested = tmp_path / "made" / "by" / "install"
        install(url, nested, TrustPolicy.load(), lambda m: [], lambda line: None)
    finally:
        os.umask(old)
    monkeypatch.setenv(TRUSTED_KEYS_ENV, "")
    for dest in (shared, nested):
        assert all(p.stat().st_mode & 0o022 == 0 for p in (dest, dest.parent, dest.parent.parent))
        checked = cli_in_process("validate", str(dest), "--json")
        assert checked.returncode == 0, trust_reason(checked.stdout)


def test_a_shared_dest_dir_this_user_cannot_change_is_refused_before_any_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not its owner (nor root): the mode cannot be changed, and a load would refuse the
    directory; the install says so, one line, before a byte is downloaded."""
    import neuronctl.store.install as installing
    from neuronctl.store.install import InstallError, install

    artifact = make_artifact(tmp_path / "a", sample_files(big=1000))
    url = pushed(artifact, tmp_path / "remote")
    shared = tmp_path / "emptydir"
    shared.mkdir()
    os.chmod(shared, 0o777)

    def not_owner(path: object, mode: int) -> None:
        raise PermissionError(1, "Operation not permitted", str(path))

    monkeypatch.setattr(installing.os, "chmod", not_owner)
    with pytest.raises(InstallError, match="writable by other users and this user cannot"):
        install(url, shared, TrustPolicy.load(), lambda m: [], lambda line: None)
    assert list(shared.iterdir()) == []


# -- from an OCI registry ------------------------------------------------------------------

needs_registry = pytest.mark.skipif(registry_binary() is None,
                                    reason="docker-registry is not installed")

SLOW_INSTALL = """
import sys, time
import neuronctl.store.remote.oci as oci
from neuronctl.cli.main import main

plain = oci.blob_chunks

def slow(registry, blob, rel, start=0):
    for chunk in plain(registry, blob, rel, start):
        if blob.size > 20_000_000:
            time.sleep(0.05)
        yield chunk

oci.blob_chunks = slow
sys.argv = ["neuronctl", *sys.argv[1:]]
main()
"""


def big_artifact(tmp_path: Path, compiled_artifact: Path, big: int) -> Path:
    artifact = Store(tmp_path / "build").root / "neuron-compiled-artifacts" / compiled_artifact.name
    shutil.copytree(compiled_artifact, artifact)
    (artifact / "weights" / "extra.bin").write_bytes(os.urandom(big))
    write_manifest(artifact, record_files(artifact, read_manifest(artifact)))
    return artifact


@needs_registry
def test_install_from_a_registry_resumes_after_a_kill_and_loads_with_no_flag(
    tmp_path: Path, compiled_artifact: Path, repo: str, registry: OciRegistry,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`install oci://REGISTRY/REPO:KEY DEST` (what KServe passes for an oci:// storageUri),
    SIGKILLed while the big layer downloads (slowed to ~20 MiB/s): nothing looks installed;
    the rerun asks the registry for the rest of that layer only (a Range request, as the
    registry's access log counts) and for none of the layers already in place; a third run
    downloads nothing; the serving side loads it trusting no key of its own."""
    big = 24 * 2**20
    artifact = big_artifact(tmp_path, compiled_artifact, big)
    open_remote(repo).push(artifact, signer=SIGNER)
    url = f"{repo}:{artifact.name}"
    dest = tmp_path / "models"
    child = subprocess.Popen([sys.executable, "-c", SLOW_INSTALL, "install", url, str(dest)],
                             stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert child.stderr is not None
    for line in child.stderr:
        if "downloading weights/extra.bin: " in line:  # mid-layer progress
            child.send_signal(signal.SIGKILL)
            break
    child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert not (dest / MANIFEST).exists()
    assert cli_in_process("validate", str(dest)).returncode == 1
    (part,) = [p for p in (dest / WORK_DIR).glob("*.part") if p.stat().st_size]
    head = part.stat().st_size
    assert 0 < head < big

    extra = read_manifest(artifact).files["weights/extra.bin"]
    before = registry.served_blob_bytes()
    rerun = run_install(url, str(dest), "--json")
    assert rerun.returncode == 0, rerun.stderr
    assert "resuming weights/extra.bin" in rerun.stderr and "Traceback" not in rerun.stderr
    served = registry.served_blob_bytes()
    layers = {f"sha256:{e.sha256}" for e in read_manifest(artifact).files.values()}
    again = {d: served[d] - before.get(d, 0) for d in layers if served[d] != before.get(d, 0)}
    assert again == {f"sha256:{extra.sha256}": big - head}  # (and the signed metadata)
    result = json.loads(rerun.stdout)
    assert result["downloaded_bytes"] == big - head
    assert result["kept_bytes"] == read_manifest(dest).total_size() - (big - head)
    assert result["url"].startswith(f"{repo}@sha256:") and result["trusted"] == "signature"
    assert not (dest / WORK_DIR).exists() and (dest / "model.sig").exists()

    third = run_install(url, str(dest), "--json")
    assert third.returncode == 0 and json.loads(third.stdout)["downloaded_bytes"] == 0

    monkeypatch.setenv(TRUSTED_KEYS_ENV, "")
    checked = cli_in_process("validate", str(dest), "--json")
    assert checked.returncode == 0, checked.stdout
    assert f"key {SIGNER.key_id}, trusted when it was pulled ({repo}@sha256:" in trust_reason(
        checked.stdout)


@needs_registry
def test_install_from_a_registry_refuses_a_tampered_layer(
    tmp_path: Path, repo: str, registry: OciRegistry  # noqa: F811
) -> None:
    from neuronctl.store.install import install

    artifact = make_artifact(tmp_path / "a", sample_files(big=200_000))
    open_remote(repo).push(artifact, signer=SIGNER)
    entry = read_manifest(artifact).files["graphs/ctx_128.pt2"]
    blob = registry.blob_path(f"sha256:{entry.sha256}")
    data = bytearray(blob.read_bytes())
    data[100] ^= 1  # same size: only the hash can tell
    blob.write_bytes(bytes(data))
    dest = tmp_path / "models"
    with pytest.raises(RemoteArtifactError, match="ctx_128.pt2 is corrupted"):
        install(f"{repo}:{artifact.name}", dest, TrustPolicy.load(), lambda m: [],
                lambda line: None)
    assert not (dest / MANIFEST).exists() and not (dest / "graphs" / "ctx_128.pt2").exists()
    assert not list((dest / WORK_DIR).glob("*.part"))


@needs_registry
def test_install_from_a_registry_refuses_unsigned_before_any_layer_is_read(
    tmp_path: Path, repo: str, registry: OciRegistry  # noqa: F811
) -> None:
    """Unsigned: exit 1 with the one-line refusal, no layer asked for; --allow-unsigned
    installs it, recorded as unsigned."""
    artifact = make_artifact(tmp_path / "a", sample_files(big=100_000))
    open_remote(repo).push(artifact)  # no signer
    url = f"{repo}:{artifact.name}"
    before = registry.served_blob_bytes()
    refused = run_install(url, str(tmp_path / "models"))
    assert refused.returncode == 1 and "is not signed" in refused.stderr
    assert "--allow-unsigned" in refused.stderr and "Traceback" not in refused.stderr
    layers = {f"sha256:{e.sha256}" for e in read_manifest(artifact).files.values()}
    served = registry.served_blob_bytes()
    assert all(served.get(d, 0) == before.get(d, 0) for d in layers)
    assert not (tmp_path / "models" / MANIFEST).exists()

    from neuronctl.store.install import install

    done = install(url, tmp_path / "models", TrustPolicy(allow_unsigned=True), lambda m: [],
                   lambda line: None)
    assert done.trusted == "allow-unsigned" and done.key_id is None
    assert read_manifest(tmp_path / "models").artifact_key == read_manifest(artifact).artifact_key


@needs_registry
def test_a_partial_download_that_is_not_the_files_head_is_downloaded_again(
    tmp_path: Path, repo: str, registry: OciRegistry  # noqa: F811
) -> None:
    """What a killed run left is hashed with the rest, never trusted: a part whose bytes are
    not the file's costs one more download of that file, not a failed install."""
    import hashlib

    from neuronctl.store.install import install

    artifact = make_artifact(tmp_path / "a", sample_files(big=200_000))
    open_remote(repo).push(artifact, signer=SIGNER)
    dest = tmp_path / "models"
    rel = "graphs/ctx_128.pt2"
    (dest / WORK_DIR).mkdir(parents=True)
    part = dest / WORK_DIR / (hashlib.sha256(rel.encode()).hexdigest()[:24] + ".part")
    part.write_bytes(os.urandom(5000))
    lines: list[str] = []
    done = install(f"{repo}:{artifact.name}", dest, TrustPolicy.load(), lambda m: [],
                   lines.append)
    assert (dest / rel).read_bytes() == (artifact / rel).read_bytes()
    assert f"resuming {rel} at 0.0 MiB" in "\n".join(lines)
    assert done.downloaded_bytes == read_manifest(artifact).total_size() + 200_000 - 5000
