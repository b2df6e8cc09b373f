"""Signatures the ecosystem verifies: the real `model_signing` CLI (model-signing 1.1.1, run as
a process) accepts what neuronctl signed, and neuronctl accepts what it signed.

Upstream behaviour pinned here (sigstore/model-transparency, src/model_signing/):
- `_cli.py` lines 403 and 713: `sign key` / `verify key` MODEL_PATH --signature --private_key /
  --public_key; the signature file itself is left out of what is hashed;
- `verifying.py` line 120: verification re-hashes the directory and compares every file's
  digest with the signed statement (extra or missing files fail);
- `_signing/sign_ec_key.py` lines 36 and 172: keys are EC on P-256/384/521, and the bundle's
  key hint (sha256 of the PEM public key) must match the verifying key;
- `_signing/sign_sigstore_pb.py` line 46: the signature is over DSSE's PAE encoding."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from neuronctl.store.local import Store
from neuronctl.store.manifest import MANIFEST
from neuronctl.store.remote.client import open_remote
from neuronctl.store.signing import (
    LEGACY_SIGNATURE,
    SIGNATURE,
    SIGNED,
    TRUSTED_KEYS_ENV,
    TrustPolicy,
)
from tests.helpers import cli_in_process
from tests.test_remote import make_artifact, sample_files, write_keypair

# The package's own CLI, `model_signing`, run with this interpreter (its __main__ is _cli.main)
MODEL_SIGNING = [sys.executable, "-m", "model_signing"]


def keygen(prefix: Path) -> tuple[Path, Path, str]:
    made = cli_in_process("artifacts", "keygen", str(prefix), "--json")
    assert made.returncode == 0, made.stderr
    data = json.loads(made.stdout)
    return Path(data["private_key"]), Path(data["public_key"]), str(data["key_id"])


def ms_verify(directory: Path, public: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*MODEL_SIGNING, "verify", "key", str(directory), "--signature",
         str(directory / SIGNATURE), "--public_key", str(public)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_model_signing_verifies_what_neuronctl_pushed_and_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    private, public, key_id = keygen(tmp_path / "keys" / "ci")
    artifact = make_artifact(tmp_path / "a", sample_files(big=200_000))
    remote = tmp_path / "remote"
    pushed = cli_in_process("artifacts", "push", str(artifact), str(remote),
                            "--sign-key", str(private), "--json")  # fmt: skip
    assert pushed.returncode == 0, pushed.stderr
    assert json.loads(pushed.stdout)["signed_by"] == key_id
    published = remote / "neuron-compiled-artifacts" / artifact.name

    verified = ms_verify(published, public)
    assert verified.returncode == 0, verified.stderr
    assert "Verification succeeded" in verified.stdout

    # A pull's copy carries the record beside it: the signed statement tells model_signing to
    # leave it out, as it leaves out model.sig.
    monkeypatch.setenv(TRUSTED_KEYS_ENV, str(public))
    pulled = open_remote(str(remote)).pull(artifact.name, Store(tmp_path / "host"))
    copy = tmp_path / "copy"
    shutil.copytree(published, copy)
    (copy / "provenance.json").write_bytes((pulled.path / "provenance.json").read_bytes())
    assert ms_verify(copy, public).returncode == 0

    (published / "graphs" / "tkg_128.pt2").write_bytes(b"swapped")
    tampered = ms_verify(published, public)
    assert tampered.returncode == 1 and "graphs/tkg_128.pt2" in tampered.stderr


def test_neuronctl_accepts_a_directory_model_signing_signed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`model_signing sign key` over the remote artifact directory, with a key `neuronctl
    artifacts keygen` made: pull verifies it before downloading and takes every byte."""
    private, public, key_id = keygen(tmp_path / "keys" / "ci")
    artifact = make_artifact(tmp_path / "a", sample_files(big=200_000))
    remote = open_remote(str(tmp_path / "remote"))
    remote.push(artifact)  # unsigned by neuronctl
    published = tmp_path / "remote" / "neuron-compiled-artifacts" / artifact.name
    signed = subprocess.run(
        [*MODEL_SIGNING, "sign", "key", str(published), "--private_key", str(private),
         "--signature", str(published / SIGNATURE)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert signed.returncode == 0, signed.stderr

    monkeypatch.setenv(TRUSTED_KEYS_ENV, "")
    url = f"{(tmp_path / 'remote').as_uri()}/{artifact.name}"
    store = str(tmp_path / "host")
    pulled = cli_in_process("artifacts", "pull", url, "--store", store, "--trust-key",
                            str(public), "--json")  # fmt: skip
    assert pulled.returncode == 0, pulled.stderr
    assert (json.loads(pulled.stdout)["trusted"], json.loads(pulled.stdout)["key_id"]) == (
        SIGNED,
        key_id,
    )

    # A manifest changed after model_signing signed the directory is not the signed one.
    raw = json.loads((published / MANIFEST).read_bytes())
    raw["created"] = "2000-01-01T00:00:00+00:00"
    (published / MANIFEST).write_text(json.dumps(raw))
    refused = cli_in_process("artifacts", "pull", url, "--store", str(tmp_path / "other"),
                             "--trust-key", str(public))  # fmt: skip
    assert refused.returncode == 1 and "manifest.json is not the signed file" in refused.stderr


def test_legacy_ed25519_signatures_verify_for_one_release_and_no_longer_sign(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """manifest.sig of the previous release (ed25519 over a prefix and the manifest bytes)
    still pulls, with a deprecation warning; an ed25519 key no longer signs."""
    legacy = Ed25519PrivateKey.generate()
    legacy_private, legacy_public = write_keypair(legacy, tmp_path / "old")
    artifact = make_artifact(tmp_path / "a", sample_files(big=20_000))
    open_remote(str(tmp_path / "remote")).push(artifact)
    published = tmp_path / "remote" / "neuron-compiled-artifacts" / artifact.name
    manifest_bytes = (published / MANIFEST).read_bytes()
    raw_public = legacy.public_key().public_bytes_raw()
    old_id = hashlib.sha256(raw_public).hexdigest()[:16]
    signature = legacy.sign(b"neuronctl manifest signature v1\n" + manifest_bytes)
    (published / LEGACY_SIGNATURE).write_text(json.dumps({
        "format": "neuronctl-signature/1", "algorithm": "ed25519", "key_id": old_id,
        "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest(),
        "signature": base64.b64encode(signature).decode(),
    }))  # fmt: skip

    policy = TrustPolicy.load([legacy_public])
    with caplog.at_level(logging.WARNING, logger="neuronctl"):
        pulled = open_remote(str(tmp_path / "remote")).pull(
            artifact.name, Store(tmp_path / "host"), policy=policy
        )
    assert pulled.path.is_dir()
    assert "deprecated manifest.sig format" in caplog.text

    refused = cli_in_process("artifacts", "push", str(artifact), str(tmp_path / "next"),
                             "--sign-key", str(legacy_private))  # fmt: skip
    assert refused.returncode == 2 and "ed25519" in refused.stderr and "keygen" in refused.stderr
