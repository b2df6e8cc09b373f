"""The load rule, attacked: only bytes that were verified, and that nobody else can change since,
are loaded (docs/security.md, "The load rule"). Each test is an attack that worked before."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from neuronctl.engine.loader import open_artifact
from neuronctl.errors import NeuronctlError
from neuronctl.store.local import Store
from neuronctl.store.manifest import FileEntry, read_manifest
from neuronctl.store.remote.client import open_remote
from neuronctl.store.remote.errors import RemoteArtifactError
from neuronctl.store.signing import (
    LOCAL_BUILD,
    SIGNED,
    UNSIGNED,
    SignatureError,
    TrustPolicy,
    check_origin,
)
from tests.helpers import cli_in_process
from tests.test_remote import _KEY, SIGNER, TRUST, make_artifact, sample_files, write_keypair

WEIGHTS = "weights/tp0_sharded_checkpoint.safetensors"


def in_store(compiled_artifact: Path, tmp_path: Path) -> Path:
    """A copy of the shared tiny artifact, as a local build in a store this user owns."""
    artifact = tmp_path / "store" / "neuron-compiled-artifacts" / compiled_artifact.name
    shutil.copytree(compiled_artifact, artifact)
    return artifact


# -- what was hashed is what is loaded -------------------------------------------------------


def test_graphs_swapped_after_the_check_are_never_loaded(
    compiled_artifact: Path, tmp_path: Path
) -> None:
    """Graphs were hashed (or judged) when the artifact was opened and read again by name on
    first use: a graph swapped in between ran under "artifact trusted". Now each graph loads
    from the copy that was hashed when the artifact was opened."""
    artifact = in_store(compiled_artifact, tmp_path)
    loaded = open_artifact(artifact)
    try:
        assert loaded.vouch is not None and loaded.vouch.kind == LOCAL_BUILD
        runner = loaded.runner
        # Every graph file replaced after the check (none has been loaded yet: lazily).
        for rel in loaded.manifest.graphs:
            size = (artifact / rel).stat().st_size
            (artifact / rel).write_bytes(b"\0" * size)
        logits = runner.prefill(0, [1, 2, 3])  # loads a context graph now
        step = runner.decode([5, 0, 0, 0], [3, -1, -1, -1])
    finally:
        if loaded.lease is not None:
            loaded.lease.release()
    reference = open_artifact(compiled_artifact)
    try:
        assert torch.equal(logits, reference.runner.prefill(0, [1, 2, 3]))
        assert torch.equal(step, reference.runner.decode([5, 0, 0, 0], [3, -1, -1, -1]))
    finally:
        if reference.lease is not None:
            reference.lease.release()


def _evil_library(tmp_path: Path, marker: Path) -> bytes:
    """A shared library whose constructor creates `marker`: code that runs when dlopen'd."""
    source = tmp_path / "evil.c"
    source.write_text(
        '#include <stdio.h>\n__attribute__((constructor)) static void run(void) {\n'
        f'  FILE *f = fopen("{marker}", "w"); if (f) fclose(f);\n}}\n'
    )
    out = tmp_path / "evil.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(out), str(source)], check=True,
                   timeout=60)
    return out.read_bytes()


def test_a_kernel_library_swapped_after_the_check_never_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel .so was hashed by the load rule, then dlopen'd by name: a library swapped
    in between ran its constructor in the server. Now it is copied and hashed once, and a
    copy that is not the manifest's is refused before anything opens it."""
    from neuronctl.backends.torch import kernel
    from neuronctl.backends.torch.runner import _load_kernel

    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build the attacker's library")
    monkeypatch.setattr(kernel, "_library", None)  # a fresh serving process
    rel = kernel.artifact_library()
    (tmp_path / "a" / rel).parent.mkdir(parents=True)
    checked = os.urandom(4096)  # what the manifest records and the check hashed
    (tmp_path / "a" / rel).write_bytes(checked)
    files = {rel: FileEntry(size=len(checked), sha256=hashlib.sha256(checked).hexdigest())}
    marker = tmp_path / "pwned"
    (tmp_path / "a" / rel).write_bytes(_evil_library(tmp_path, marker))  # swapped after it

    with pytest.raises(NeuronctlError, match="is not the file the artifact's manifest records"):
        _load_kernel(kernel.digest(), tmp_path / "a", files)
    assert not marker.exists()


def test_a_verified_copy_keeps_the_bytes_that_were_hashed(tmp_path: Path) -> None:
    from neuronctl.store.verified import verified_copy

    original = tmp_path / "graph.pt2"
    original.write_bytes(b"checked bytes")
    copy = verified_copy(original, hashlib.sha256(b"checked bytes").hexdigest())
    original.write_bytes(b"swapped bytes")
    assert copy.path.read_bytes() == b"checked bytes"
    with pytest.raises(OSError):  # sealed: not even this process changes it
        with open(copy.path, "r+b") as f:
            f.write(b"x")
            f.flush()
    assert copy.path.read_bytes() == b"checked bytes"
    copy.close()


# -- the store rule covers every directory and file of the artifact --------------------------


@pytest.mark.parametrize("where", ["weights", "graphs", WEIGHTS, "config.json"])
def test_a_local_build_with_anything_others_can_write_is_refused(
    tmp_path: Path, where: str
) -> None:
    """Only the store root, neuron-compiled-artifacts/ and the key directory were checked: a
    world-writable `weights/` (or file) inside a local build passed as "built on this host"."""
    artifact = make_artifact(tmp_path / "store", sample_files(big=10_000))
    assert check_origin(artifact, read_manifest(artifact), TRUST).kind == LOCAL_BUILD
    (artifact / where).chmod((artifact / where).stat().st_mode | 0o002)

    with pytest.raises(SignatureError, match=f"{where} is writable by other users"):
        check_origin(artifact, read_manifest(artifact), TRUST)
    refused = cli_in_process("validate", str(artifact), "--json")
    assert refused.returncode == 1 and "writable by other users" in refused.stdout


def test_a_group_writable_file_of_another_group_is_refused(tmp_path: Path) -> None:
    artifact = make_artifact(tmp_path / "store", sample_files(big=10_000))
    if os.geteuid() != 0:
        pytest.skip("only root can give a file to another group")
    os.chown(artifact / WEIGHTS, 0, 65534)
    (artifact / WEIGHTS).chmod(0o664)
    with pytest.raises(SignatureError, match="writable by other users"):
        check_origin(artifact, read_manifest(artifact), TRUST)


def test_a_link_inside_a_local_build_is_refused(tmp_path: Path) -> None:
    """A link inside the artifact reaches whatever it names, which the rule never judged."""
    artifact = make_artifact(tmp_path / "store", sample_files(big=10_000))
    elsewhere = tmp_path / "shared" / "weights.safetensors"
    elsewhere.parent.mkdir()
    shutil.copyfile(artifact / WEIGHTS, elsewhere)
    (artifact / WEIGHTS).unlink()
    (artifact / WEIGHTS).symlink_to(elsewhere)
    with pytest.raises(SignatureError, match="is a symbolic link"):
        check_origin(artifact, read_manifest(artifact), TRUST)


def test_a_sticky_directory_above_the_artifact_is_fine_a_plain_shared_one_is_not(
    tmp_path: Path,
) -> None:
    """Above the artifact, a world-writable directory lets others rename it away and put
    another in its place; a sticky one (like /tmp) does not."""
    artifact = make_artifact(tmp_path / "shared", sample_files(big=1_000))
    (tmp_path / "shared").chmod(0o1777)
    assert check_origin(artifact, read_manifest(artifact), TRUST).kind == LOCAL_BUILD
    (tmp_path / "shared").chmod(0o777)
    with pytest.raises(SignatureError, match="shared is writable by other users"):
        check_origin(artifact, read_manifest(artifact), TRUST)


# -- weights of a signed artifact read in place ----------------------------------------------


def _signed_in_place(tmp_path: Path) -> tuple[Path, Path]:
    """An artifact pushed, signed, to a shared mount; and a copy of it read in place outside
    any store layout, that only this user can write (a read-only volume, say)."""
    artifact = make_artifact(tmp_path / "a", sample_files(big=10_000))
    mount = tmp_path / "mount"
    open_remote(str(mount)).push(artifact, signer=SIGNER)
    loose = tmp_path / "models" / "m"
    shutil.copytree(mount / "neuron-compiled-artifacts" / artifact.name, loose)
    return mount / "neuron-compiled-artifacts" / artifact.name, loose


def test_weights_rewritten_under_a_signature_read_in_place_are_refused(tmp_path: Path) -> None:
    """Only code files were hashed for an artifact read in place: a same-size rewrite of its
    weights served other weights under "signature by trusted key"."""
    _, loose = _signed_in_place(tmp_path)
    assert check_origin(loose, read_manifest(loose), TRUST).kind == SIGNED
    size = (loose / WEIGHTS).stat().st_size
    (loose / WEIGHTS).write_bytes(os.urandom(size))

    with pytest.raises(SignatureError, match=f"{WEIGHTS} is not the signed file"):
        check_origin(loose, read_manifest(loose), TRUST)
    allowed = TrustPolicy(TRUST.keys, allow_unsigned=True)
    assert check_origin(loose, read_manifest(loose), allowed).kind == UNSIGNED


def test_generate_hashes_the_weights_of_a_signed_artifact_read_in_place(
    tmp_path: Path, compiled_artifact: Path
) -> None:
    """`generate --artifacts DIR` of a signed artifact outside any store: served under its
    signature with every byte hashed, refused once its weights were rewritten at the same
    size (before, only its graphs and libraries were hashed)."""
    mount = tmp_path / "mount"
    open_remote(str(mount)).push(compiled_artifact, signer=SIGNER)
    loose = tmp_path / "models" / "m"
    shutil.copytree(mount / "neuron-compiled-artifacts" / compiled_artifact.name, loose)
    public = write_keypair(_KEY, tmp_path / "publisher")[1]
    args = ["generate", "--artifacts", str(loose), "-p", "hi", "--max-tokens", "2",
            "--trust-key", str(public)]  # fmt: skip

    served = cli_in_process(*args)
    assert served.returncode == 0, served.stderr
    assert f"signature by trusted key {SIGNER.key_id}" in served.stdout + served.stderr
    weights = loose / "weights" / "graph_weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # the last weight's last byte: same size, same header
    weights.write_bytes(bytes(data))
    refused = cli_in_process(*args)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "graph_weights.safetensors is not the signed file" in refused.stderr


def test_a_signed_artifact_on_a_mount_others_can_write_is_refused(
    tmp_path: Path, compiled_artifact: Path
) -> None:
    """A signed artifact on a shared mount was vouched for with every byte intact at the
    check; whoever could write the mount then rewrote the weights while it was served
    (other tokens), or truncated them (the server died of SIGBUS). Bytes others can change
    after the check are never loaded: pull them into the store."""
    mount = tmp_path / "mount"
    open_remote(str(mount)).push(compiled_artifact, signer=SIGNER)
    in_place = mount / "neuron-compiled-artifacts" / compiled_artifact.name
    public = write_keypair(_KEY, tmp_path / "publisher")[1]
    args = ["generate", "--artifacts", str(in_place), "-p", "hi", "--max-tokens", "2",
            "--trust-key", str(public)]  # fmt: skip
    (in_place / "weights").chmod(0o777)

    refused = cli_in_process(*args)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "weights is writable by other users" in refused.stderr
    assert "artifacts pull" in refused.stderr and "Traceback" not in refused.stderr
    with pytest.raises(SignatureError, match="weights is writable by other users"):
        check_origin(in_place, read_manifest(in_place), TRUST)
    # Once only this user can change it, the mount is a store of this user's like any other.
    (in_place / "weights").chmod(0o755)
    assert check_origin(in_place, read_manifest(in_place), TRUST).kind == LOCAL_BUILD


# -- push to a shared mount never writes through a planted link ------------------------------


@pytest.mark.parametrize("planted", ["", "graphs"])
def test_push_never_writes_through_a_link_planted_in_the_remote(
    tmp_path: Path, planted: str
) -> None:
    """Whoever can write the shared mount planted `neuron-compiled-artifacts/<key>` (or its
    `graphs/`) as a link to a directory of the pusher's: push wrote the artifact's files
    there, overwriting what was there."""
    artifact = make_artifact(tmp_path / "a", sample_files(big=10_000))
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "tkg_128.pt2").write_bytes(b"the pusher's own file")
    (victim / "config.json").write_bytes(b"the pusher's own config")
    mount = tmp_path / "mount"
    directory = mount / "neuron-compiled-artifacts" / artifact.name
    link = directory / planted if planted else directory
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim)

    with pytest.raises(RemoteArtifactError, match="symbolic link"):
        open_remote(str(mount)).push(artifact, signer=SIGNER)
    assert sorted(p.name for p in victim.iterdir()) == ["config.json", "tkg_128.pt2"]
    assert (victim / "tkg_128.pt2").read_bytes() == b"the pusher's own file"
    assert (victim / "config.json").read_bytes() == b"the pusher's own config"


def test_push_to_a_clean_mount_still_works(tmp_path: Path) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files(big=10_000))
    remote = open_remote(str(tmp_path / "mount" / "new"))
    assert remote.push(artifact, signer=SIGNER).uploaded
    pulled = remote.pull(artifact.name, Store(tmp_path / "host"), policy=TRUST)
    assert (pulled.path / WEIGHTS).read_bytes() == (artifact / WEIGHTS).read_bytes()


# -- one identity: the lease is on the directory the rule judged -----------------------------


def test_rm_keeps_an_artifact_opened_through_a_link(
    compiled_artifact: Path, tmp_path: Path
) -> None:
    """The lease named the path as given, the load rule the resolved one: a server that
    opened the artifact through a link held no lease on it, `artifacts rm` removed it, and
    its next request failed while /health said ok."""
    artifact = in_store(compiled_artifact, tmp_path)
    link = tmp_path / "current-model"
    link.symlink_to(artifact)
    loaded = open_artifact(link)
    store = ["--store", str(tmp_path / "store")]
    try:
        refused = cli_in_process("artifacts", "rm", artifact.name[:8], *store)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "in use" in refused.stderr and artifact.is_dir()
    finally:
        assert loaded.lease is not None and loaded.lease.held
        loaded.lease.release()
    removed = cli_in_process("artifacts", "rm", artifact.name[:8], *store)
    assert removed.returncode == 0, removed.stderr
    assert not artifact.exists()


def test_a_loaded_artifact_keeps_serving_after_its_directory_is_gone(
    compiled_artifact: Path, tmp_path: Path
) -> None:
    """Graphs loaded lazily from their files: once the artifact was removed under a running
    server, its next request that needed a graph not loaded yet was a 500 while /health said
    ok. Every graph is held, verified, from the moment the artifact is opened."""
    artifact = in_store(compiled_artifact, tmp_path)
    loaded = open_artifact(artifact)
    try:
        shutil.rmtree(artifact)  # root, or the owner by hand: what no lease can stop
        logits = loaded.runner.prefill(0, [1, 2, 3])
        step = loaded.runner.decode([5, 0, 0, 0], [3, -1, -1, -1])
    finally:
        if loaded.lease is not None:
            loaded.lease.release()
    assert logits.shape[-1] == step.shape[-1] == loaded.runner.vocab_size
    assert torch.isfinite(step).all()
