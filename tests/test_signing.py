"""Signed artifacts: a remote artifact is used only when a key the user trusts signed it.

The remote is hostile here: it can rewrite any object, re-record the manifest, and sign with
its own key. Only the publisher's private key makes a manifest a puller accepts."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import openai
import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from neuronctl.store.local import Store
from neuronctl.store.manifest import MANIFEST, FileEntry, Manifest, read_manifest
from neuronctl.store.remote.client import open_remote
from neuronctl.store.remote.errors import RemoteArtifactError
from neuronctl.store.signing import (
    REVOKED_KEYS_ENV,
    SIGNATURE,
    SIGNED,
    TRUSTED_KEYS_ENV,
    UNSIGNED,
    SignatureError,
    Signer,
    TrustPolicy,
    check_origin,
    key_id,
    sign,
)
from tests.helpers import cli_in_process, fine_tuned_copy, spec_flags
from tests.test_remote import (  # noqa: F401  (fixtures)
    SIGNER,
    TRUST,
    _client,
    bucket,
    make_artifact,
    s3server,
    sample_files,
    tree_bytes,
    trusted_env,
    visible,
    write_keypair,
)
from tests.test_server import Server, free_port, serve_argv


class PatientServer(Server):
    """Pull, load and start in one process: give a loaded CI machine time."""

    def _wait_healthy(self, timeout: float = 300) -> None:
        super()._wait_healthy(timeout)


STRANGER_KEY = ec.generate_private_key(ec.SECP256R1())
STRANGER = Signer(STRANGER_KEY, key_id(STRANGER_KEY.public_key()))
REVOKED = frozenset({SIGNER.key_id})


def remote_dir(remote_root: Path, artifact: Path) -> Path:
    return remote_root / "neuron-compiled-artifacts" / artifact.name


def rewrite_as_attacker(directory: Path, rel: str, data: bytes, signer: Signer | None) -> None:
    """What a hostile remote does: new bytes for a file, the manifest re-recorded to match,
    and (optionally) a signature by its own key."""
    (directory / rel).write_bytes(data)
    manifest = Manifest.model_validate_json((directory / MANIFEST).read_bytes())
    files = dict(manifest.files)
    files[rel] = FileEntry(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    raw = manifest.model_copy(update={"files": files}).model_dump_json(indent=2).encode()
    (directory / MANIFEST).write_bytes(raw)
    if signer is None:
        (directory / SIGNATURE).unlink(missing_ok=True)
    else:
        (directory / SIGNATURE).write_bytes(sign(raw, signer))


def test_unsigned_remote_is_refused_unless_allowed(tmp_path: Path) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files(big=20_000))
    remote = open_remote(str(tmp_path / "remote"))
    remote.push(artifact)  # no key: unsigned
    dest = Store(tmp_path / "host")

    with pytest.raises(SignatureError, match="is not signed"):
        remote.pull(artifact.name, dest, policy=TRUST)
    assert visible(dest) == []

    pulled = remote.pull(artifact.name, dest, policy=TrustPolicy(TRUST.keys, allow_unsigned=True))
    manifest = read_manifest(pulled.path)
    # The choice is made again at every use: without --allow-unsigned it is refused.
    with pytest.raises(SignatureError, match="is not signed"):
        check_origin(pulled.path, manifest, TRUST)
    assert check_origin(pulled.path, manifest, TrustPolicy(allow_unsigned=True)).kind == UNSIGNED
    with pytest.raises(SignatureError):  # and a second pull (a cache hit) says the same
        remote.pull(artifact.name, dest, policy=TRUST)


def test_remote_re_signed_by_a_stranger_is_refused(tmp_path: Path) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files(big=20_000))
    remote = open_remote(str(tmp_path / "remote"))
    remote.push(artifact, signer=SIGNER)
    rewrite_as_attacker(
        remote_dir(tmp_path / "remote", artifact), "graphs/tkg_128.pt2", b"evil", STRANGER
    )
    dest = Store(tmp_path / "host")

    with pytest.raises(SignatureError, match=f"signed by key {STRANGER.key_id}.*not trusted"):
        remote.pull(artifact.name, dest, policy=TRUST)

    assert visible(dest) == []
    assert not (dest.artifacts / ".failed").exists()  # refused before any download


def test_manifest_changed_under_a_valid_signature_is_refused(tmp_path: Path) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files(big=20_000))
    remote = open_remote(str(tmp_path / "remote"))
    remote.push(artifact, signer=SIGNER)
    directory = remote_dir(tmp_path / "remote", artifact)
    signature = (directory / SIGNATURE).read_bytes()
    rewrite_as_attacker(directory, "config.json", b'{"evil": 1}', None)
    (directory / SIGNATURE).write_bytes(signature)  # the publisher's, over the old manifest

    with pytest.raises(SignatureError, match="does not match its manifest"):
        remote.pull(artifact.name, Store(tmp_path / "host"), policy=TRUST)


def test_pulled_artifact_edited_locally_is_refused_at_load(tmp_path: Path) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files(big=20_000))
    remote = open_remote(str(tmp_path / "remote"))
    remote.push(artifact, signer=SIGNER)
    pulled = remote.pull(artifact.name, Store(tmp_path / "host"), policy=TRUST).path
    assert check_origin(pulled, read_manifest(pulled), TRUST).kind == SIGNED
    # Re-recording the local manifest after an edit does not make the edit signed.
    (pulled / "config.json").write_text('{"evil": 1}')
    from neuronctl.store.manifest import record_files, write_manifest

    write_manifest(pulled, record_files(pulled, read_manifest(pulled)))

    with pytest.raises(SignatureError, match="config.json differs from the signed record"):
        check_origin(pulled, read_manifest(pulled), TRUST)


def test_signing_an_intact_unsigned_remote_adds_only_the_signature(tmp_path: Path) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files(big=20_000))
    remote = open_remote(str(tmp_path / "remote"))
    remote.push(artifact)

    signed = remote.push(artifact, signer=SIGNER)

    assert signed.uploaded == [SIGNATURE] and signed.signed_by == SIGNER.key_id
    assert remote.push(artifact, signer=SIGNER).noop
    remote.pull(artifact.name, Store(tmp_path / "host"), policy=TRUST)


def test_signing_never_vouches_for_another_build_of_the_key(tmp_path: Path) -> None:
    ours = make_artifact(tmp_path / "a", sample_files(big=20_000))
    theirs = make_artifact(tmp_path / "b", sample_files(big=20_000))  # same key, other bytes
    remote = open_remote(str(tmp_path / "remote"))
    remote.push(theirs)

    with pytest.raises(RemoteArtifactError, match="another build of this key"):
        remote.push(ours, signer=SIGNER)
    replaced = remote.push(ours, signer=SIGNER, force=True)

    assert replaced.signed_by == SIGNER.key_id
    pulled = remote.pull(ours.name, Store(tmp_path / "host"), policy=TRUST)
    assert tree_bytes(pulled.path) == tree_bytes(ours)


def test_a_mirror_keeps_the_publisher_signature(tmp_path: Path) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files(big=20_000))
    open_remote(str(tmp_path / "origin")).push(artifact, signer=SIGNER)
    pulled = open_remote(str(tmp_path / "origin")).pull(
        artifact.name, Store(tmp_path / "relay"), policy=TRUST
    )

    mirror = open_remote(str(tmp_path / "mirror"))
    mirror.push(pulled.path)  # the relay host holds no private key
    again = mirror.pull(artifact.name, Store(tmp_path / "host"), policy=TRUST)

    assert tree_bytes(again.path) == tree_bytes(artifact)
    assert check_origin(again.path, read_manifest(again.path), TRUST).key_id == SIGNER.key_id


def test_keygen_push_pull_from_the_command_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    bucket: str,  # noqa: F811
) -> None:
    for name in ("NEURONCTL_SIGNING_KEY", TRUSTED_KEYS_ENV):
        monkeypatch.delenv(name)
    made = cli_in_process("artifacts", "keygen", str(tmp_path / "keys" / "ci"), "--json")
    assert made.returncode == 0, made.stderr
    keys = json.loads(made.stdout)
    assert stat.S_IMODE(os.stat(keys["private_key"]).st_mode) == 0o600
    assert cli_in_process("artifacts", "keygen", str(tmp_path / "keys" / "ci")).returncode == 2
    artifact = make_artifact(tmp_path / "a", sample_files(big=20_000))
    url = f"s3://{bucket}/fleet"

    pushed = cli_in_process("artifacts", "push", str(artifact), url,
                            "--sign-key", keys["private_key"], "--json")  # fmt: skip
    assert pushed.returncode == 0, pushed.stderr
    assert json.loads(pushed.stdout)["signed_by"] == keys["key_id"]

    _, stranger_pub = write_keypair(STRANGER_KEY, tmp_path / "stranger")
    store = str(tmp_path / "host")
    untrusted = cli_in_process("artifacts", "pull", f"{url}/{artifact.name}", "--store", store,
                               "--trust-key", str(stranger_pub))  # fmt: skip
    assert untrusted.returncode == 1
    assert f"signed by key {keys['key_id']}" in untrusted.stderr
    assert "Traceback" not in untrusted.stderr and "hint:" in untrusted.stderr

    pulled = cli_in_process("artifacts", "pull", f"{url}/{artifact.name}", "--store", store,
                            "--json", env={TRUSTED_KEYS_ENV: keys["public_key"]})  # fmt: skip
    assert pulled.returncode == 0, pulled.stderr
    data = json.loads(pulled.stdout)
    assert (data["trusted"], data["key_id"]) == (SIGNED, keys["key_id"])
    assert tree_bytes(Path(data["path"])) == tree_bytes(artifact)


def test_signed_remote_is_pulled_and_served_unsigned_refused(
    tmp_path: Path,
    bucket: str,  # noqa: F811
    compiled_artifact: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = f"s3://{bucket}/fleet"
    remote = open_remote(url)
    remote.push(compiled_artifact)  # unsigned first
    monkeypatch.setenv("NEURONCTL_STORE", str(tmp_path / "host"))

    refused = cli_in_process("serve", "--artifacts", f"{url}/{compiled_artifact.name}", "--dry-run")
    assert refused.returncode == 1 and "is not signed" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert visible(Store(tmp_path / "host")) == []

    remote.push(compiled_artifact, signer=SIGNER)  # the publisher signs it
    port = free_port()
    server = PatientServer(serve_argv(f"{url}/{compiled_artifact.name}", port), port)  # type: ignore[arg-type]
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        done = client.completions.create(model=model, prompt="hello", max_tokens=4,
                                         temperature=0)  # fmt: skip
        assert done.usage is not None and done.usage.completion_tokens == 4
    finally:
        server.stop()
    assert f"signature by trusted key {SIGNER.key_id}" in server.log()


def test_a_relay_never_signs_what_it_pulled_unverified(tmp_path: Path) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files(big=20_000))
    open_remote(str(tmp_path / "origin")).push(artifact)  # unsigned
    pulled = open_remote(str(tmp_path / "origin")).pull(
        artifact.name, Store(tmp_path / "relay"), policy=TrustPolicy(allow_unsigned=True)
    )

    with pytest.raises(SignatureError, match="refusing to sign"):
        open_remote(str(tmp_path / "mirror")).push(pulled.path, signer=SIGNER)
    assert not (tmp_path / "mirror").exists()


def test_an_unverified_pull_never_donates_graphs_to_a_local_build(tmp_path: Path) -> None:
    from neuronctl.build import find_graph_donor
    from neuronctl.keys import Keys

    artifact = make_artifact(tmp_path / "a", sample_files(big=20_000))
    manifest = read_manifest(artifact)
    with_graphs = manifest.model_copy(update={"graphs": ["graphs/ctx_128.pt2"]})
    # as a build would record it: the record digest covers the graph list
    with_graphs = with_graphs.model_copy(update={"record_sha256": with_graphs.recorded_sha256()})
    from neuronctl.store.manifest import write_manifest

    write_manifest(artifact, with_graphs)
    remote = open_remote(str(tmp_path / "remote"))
    remote.push(artifact)  # unsigned
    store = Store(tmp_path / "host")
    remote.pull(artifact.name, store, policy=TrustPolicy(allow_unsigned=True))
    graph_key = manifest.model_dump(mode="json")["keys"]["graph_key"]
    fine_tune = Keys(graph=graph_key, weights="x" * 64, artifact="y" * 64)

    assert find_graph_donor(store, fine_tune) is None
    remote.push(artifact, signer=SIGNER)  # now signed: the same bytes are a donor
    signed_store = Store(tmp_path / "host2")
    remote.pull(artifact.name, signed_store, policy=TRUST)
    assert find_graph_donor(signed_store, fine_tune) == signed_store.path(artifact.name)


def test_compile_remote_refuses_an_unsigned_hit_instead_of_using_it(
    tmp_path: Path, tiny_llama: Path, compiled_artifact: Path
) -> None:
    from tests.conftest import TINY_SPEC

    url = (tmp_path / "shared").as_uri()
    open_remote(url).push(compiled_artifact)  # unsigned, under the key this compile computes
    args = ["compile", str(tiny_llama), *spec_flags(TINY_SPEC), "--remote", url,
            "--store", str(tmp_path / "host")]  # fmt: skip

    refused = cli_in_process(*args)
    assert refused.returncode == 1 and "is not signed" in refused.stderr, refused.stderr
    assert visible(Store(tmp_path / "host")) == []

    allowed = cli_in_process(*args, "--allow-unsigned", "--json")
    assert allowed.returncode == 0, allowed.stderr
    assert json.loads(allowed.stdout)["pulled"] is True


# -- one load rule: a local build in a store this user owns, or a signature trusted now -------


def _signed_in_a_shared_mount(tmp_path: Path, files: dict[str, bytes]) -> tuple[Path, Path]:
    """An artifact pushed (signed) to a shared mount others can write to, read in place."""
    artifact = make_artifact(tmp_path / "a", files)
    mount = tmp_path / "mount"
    open_remote(str(mount)).push(artifact, signer=SIGNER)
    mount.chmod(0o777)  # a shared mount: anyone may write there
    return artifact, remote_dir(mount, artifact)


def test_a_directory_outside_the_users_store_is_not_a_local_build(tmp_path: Path) -> None:
    """A shared mount used in place (`--artifacts /mnt/shared/...`) was trusted as "built on
    this host" while `artifacts pull` of the same bytes refused them as unsigned. A shared
    mount others can write to vouches for nothing, signed or not: its bytes can change
    between the check and the load."""
    import shutil

    artifact, in_place = _signed_in_a_shared_mount(tmp_path, sample_files(big=10_000))
    assert check_origin(artifact, read_manifest(artifact), TRUST).kind == "local-build"
    with pytest.raises(SignatureError, match="mount is writable by other users"):
        check_origin(in_place, read_manifest(in_place), TRUST)
    allowed = TrustPolicy(TRUST.keys, allow_unsigned=True)
    assert check_origin(in_place, read_manifest(in_place), allowed).kind == UNSIGNED

    # A signed copy outside any store layout that only this user can write: its signature.
    loose = tmp_path / "somewhere" / "model"
    shutil.copytree(in_place, loose)
    vouch = check_origin(loose, read_manifest(loose), TRUST)
    assert vouch.kind == SIGNED and vouch.key_id == SIGNER.key_id
    with pytest.raises(SignatureError, match="not trusted here.*not a local build"):
        check_origin(loose, read_manifest(loose), TrustPolicy())
    (loose / SIGNATURE).unlink()
    with pytest.raises(SignatureError, match="is not signed.*not in a neuronctl store"):
        check_origin(loose, read_manifest(loose), TRUST)
    assert check_origin(loose, read_manifest(loose), allowed).kind == UNSIGNED


def test_a_store_owned_by_another_user_is_not_a_local_build(tmp_path: Path) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files(big=10_000))
    (tmp_path / "a").chmod(0o757)  # the store root writable by others
    with pytest.raises(SignatureError, match="writable by other users"):
        check_origin(artifact, read_manifest(artifact), TRUST)
    (tmp_path / "a").chmod(0o755)
    if os.geteuid() == 0:  # only root can give a directory away
        os.chown(artifact, 65534, 65534)
        with pytest.raises(SignatureError, match="owned by uid 65534, not by this user"):
            check_origin(artifact, read_manifest(artifact), TRUST)


def test_serve_refuses_an_unsigned_directory_outside_the_store(
    tmp_path: Path, compiled_artifact: Path
) -> None:
    import shutil

    loose = tmp_path / "shared" / "model"
    shutil.copytree(compiled_artifact, loose)
    refused = cli_in_process("serve", "--artifacts", str(loose), "--dry-run")
    assert refused.returncode == 1, refused.stderr
    assert "not in a neuronctl store" in refused.stderr and "Traceback" not in refused.stderr
    allowed = cli_in_process("serve", "--artifacts", str(loose), "--dry-run", "--allow-unsigned")
    assert allowed.returncode == 0, allowed.stderr
    assert "NOT verified" in allowed.stdout + allowed.stderr


def test_a_bare_name_never_resolves_to_a_directory_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whoever can write to a service's working directory must not replace its model code by
    creating a directory named like the key prefix it is started with."""
    store = Store(tmp_path / "store")
    real = make_artifact(store.root, sample_files(big=1_000))
    work = tmp_path / "work"
    decoy = make_artifact(tmp_path / "elsewhere", sample_files(big=1_000), seed="b")
    import shutil

    shutil.copytree(decoy, work / real.name[:8])
    shutil.copytree(decoy, work / "mymodel")
    monkeypatch.chdir(work)

    assert store.resolve(real.name[:8]) == real
    assert store.resolve(f"./{real.name[:8]}") == Path(f"./{real.name[:8]}")
    from neuronctl.errors import NotFoundError

    with pytest.raises(NotFoundError) as refused:
        store.resolve("mymodel")
    assert refused.value.hint is not None and "./mymodel" in refused.value.hint


def test_a_remote_key_is_compared_in_full(tmp_path: Path) -> None:
    """A URL whose key has the right 20-character directory name and a wrong tail named the
    artifact anyway: only the first 20 characters were compared."""
    from neuronctl.store.remote.urls import resolve_artifacts_arg

    artifact = make_artifact(tmp_path / "a", sample_files(big=10_000))
    remote = tmp_path / "remote"
    open_remote(str(remote)).push(artifact, signer=SIGNER)
    full = read_manifest(artifact).artifact_key
    wrong = full[:20] + ("0" if full[20] != "0" else "1") + full[21:]
    store = Store(tmp_path / "host")

    with pytest.raises(RemoteArtifactError, match=f"is for artifact {full}, not {wrong}"):
        resolve_artifacts_arg(f"{remote.as_uri()}/{wrong}", store, policy=TRUST)
    assert visible(store) == []
    assert resolve_artifacts_arg(f"{remote.as_uri()}/{full}", store, policy=TRUST).is_dir()
    with pytest.raises(RemoteArtifactError, match="is for artifact"):  # the cache hit too
        resolve_artifacts_arg(f"{remote.as_uri()}/{wrong}", store, policy=TRUST)


def test_a_code_file_replaced_at_the_same_size_is_refused_at_every_load(tmp_path: Path) -> None:
    """A pulled artifact whose kernel .so is swapped locally (same size) passed the stat-only
    checks and was loaded under "signature by trusted key"."""
    files = {**sample_files(big=10_000), "kernels/neuronctl_kernel_x.so": os.urandom(5_000)}
    artifact = make_artifact(tmp_path / "a", files)
    remote = open_remote(str(tmp_path / "remote"))
    remote.push(artifact, signer=SIGNER)
    pulled = remote.pull(artifact.name, Store(tmp_path / "host"), policy=TRUST).path
    assert check_origin(pulled, read_manifest(pulled), TRUST).kind == SIGNED

    (pulled / "kernels/neuronctl_kernel_x.so").write_bytes(os.urandom(5_000))

    with pytest.raises(SignatureError, match="neuronctl_kernel_x.so is not the signed file"):
        check_origin(pulled, read_manifest(pulled), TRUST)
    allowed = TrustPolicy(TRUST.keys, allow_unsigned=True)
    assert check_origin(pulled, read_manifest(pulled), allowed).kind == UNSIGNED


def test_validate_judges_trust_as_generate_does(
    tmp_path: Path, compiled_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """validate said "reusable" (exit 0) for a pulled artifact whose signer is not trusted,
    which generate and serve then refused: CI's "validate, then serve" passed, the service
    failed."""
    remote = open_remote(str(tmp_path / "remote"))
    remote.push(compiled_artifact, signer=STRANGER)
    store = Store(tmp_path / "host")
    remote.pull(compiled_artifact.name, store, policy=TrustPolicy(allow_unsigned=True))
    monkeypatch.setenv("NEURONCTL_STORE", str(store.root))
    stranger_pub = write_keypair(STRANGER_KEY, tmp_path / "stranger")[1]
    key = compiled_artifact.name[:8]

    trusting = ["--trust-key", str(stranger_pub)]
    for flags, code in (([], 1), (["--allow-unsigned"], 0), (trusting, 0)):
        checked = cli_in_process("validate", key, "--json", *flags)
        served = cli_in_process("serve", "--artifacts", key, "--dry-run", *flags)
        assert checked.returncode == served.returncode == code, (flags, checked.stdout,
                                                                 served.stderr)  # fmt: skip
        trust = {c["name"]: c for c in json.loads(checked.stdout)["checks"]}["trust"]
        assert trust["ok"] is (code == 0)
        assert code == 0 or "not trusted here" in trust["reason"]
    assert "--trust-key" in cli_in_process("bench", "--help").stdout


def test_revoking_a_key_stops_graphs_reused_from_its_artifact(
    tmp_path: Path,
    tiny_llama: Path,
    compiled_artifact: Path,
    monkeypatch: pytest.MonkeyPatch,
    trusted_env: tuple[Path, Path],  # noqa: F811
) -> None:
    """A local compile that reused a pulled artifact's graphs kept loading them as "built on
    this host" after the signer's key was removed."""
    from neuronctl.build import compile_model, resolve_build
    from tests.conftest import TINY_SPEC

    remote = open_remote(str(tmp_path / "remote"))
    remote.push(compiled_artifact, signer=SIGNER)
    store = Store(tmp_path / "host")
    remote.pull(compiled_artifact.name, store, policy=TRUST)
    tuned = fine_tuned_copy(tiny_llama, tmp_path / "tuned")

    out = compile_model(resolve_build(str(tuned), TINY_SPEC, store_dir=store.root), jobs=1)
    assert out.graphs_reused

    vouch = check_origin(out.path, read_manifest(out.path), TRUST)
    assert vouch.kind == "local-build" and vouch.key_id == SIGNER.key_id
    # The donor's pull record came with the graphs: no longer trusted, its key still vouches
    # (as it does for the donor) until it is revoked.
    assert check_origin(out.path, read_manifest(out.path), TrustPolicy()).key_id == SIGNER.key_id
    with pytest.raises(SignatureError, match="reuses graphs from .* no trusted key vouches"):
        check_origin(out.path, read_manifest(out.path), TrustPolicy(revoked=REVOKED))
    _, public = trusted_env
    checked = cli_in_process("validate", str(out.path), "--json",
                             env={TRUSTED_KEYS_ENV: "", REVOKED_KEYS_ENV: str(public)})  # fmt: skip
    assert checked.returncode == 1, checked.stdout
    monkeypatch.setenv(REVOKED_KEYS_ENV, str(public))  # nor does another key launder them
    with pytest.raises(SignatureError, match="refusing to sign"):
        open_remote(str(tmp_path / "mirror")).push(out.path, signer=STRANGER)
