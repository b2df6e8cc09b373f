"""Signed artifacts: an ed25519 signature over manifest.json, checked against trusted keys.

The manifest lists the size and sha256 of every file of an artifact, so a signature over its
exact bytes covers every byte the artifact holds: pull checks the signature first, then every
downloaded file against the signed sha256 list. (Why ed25519 from `cryptography` rather than
OpenSSF model-signing: docs/security.md.)

Files:
  <remote>/<key>/manifest.sig   the signature, uploaded before manifest.json (which goes last);
  <local>/<key>/provenance.json written by pull: where the artifact came from, the remote
                                manifest's exact bytes and its signature, so that every later
                                load re-checks the signature against the keys trusted *then*.
An artifact without provenance.json was built on this host (or copied in by hand): the local
file system vouches for it.

Keys: `neuronctl artifacts keygen NAME` writes NAME.key (private, PKCS#8 PEM, mode 0600) and
NAME.pub. A pusher signs with --sign-key or $NEURONCTL_SIGNING_KEY (a path, or the PEM text
itself, as CI secrets often are); pullers trust the public keys named by --trust-key,
$NEURONCTL_TRUSTED_KEYS (files or directories, separated by ':') and the *.pub files in
~/.config/neuronctl/trusted-keys/.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from neuronctl.errors import NeuronctlError, UsageError
from neuronctl.store.manifest import Manifest

SIGNATURE = "manifest.sig"
PROVENANCE = "provenance.json"
SIGNING_KEY_ENV = "NEURONCTL_SIGNING_KEY"
TRUSTED_KEYS_ENV = "NEURONCTL_TRUSTED_KEYS"
SIGNATURE_FORMAT = "neuronctl-signature/1"
# Domain separation: a neuronctl key signs manifests and nothing that could be mistaken for one.
SIGNED_PREFIX = b"neuronctl manifest signature v1\n"
LOCAL_BUILD, SIGNED, UNSIGNED = "local-build", "signature", "allow-unsigned"


class SignatureError(NeuronctlError):
    """A remote artifact is unsigned, or signed by a key nobody trusts, or tampered with."""


def trusted_keys_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return Path(base) / "neuronctl" / "trusted-keys"


def key_id(public: Ed25519PublicKey) -> str:
    """A short, stable name for a public key: sha256 of its raw 32 bytes, 16 hex chars."""
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


@dataclass(frozen=True)
class Signer:
    key: Ed25519PrivateKey
    key_id: str


@dataclass(frozen=True)
class TrustedKey:
    key: Ed25519PublicKey
    key_id: str
    source: str  # the file it was read from


@dataclass(frozen=True)
class Vouch:
    """Who vouches for an artifact's bytes: this host's own build, a trusted signature, or
    only the user's --allow-unsigned."""

    kind: str  # LOCAL_BUILD | SIGNED | UNSIGNED
    key_id: str | None = None
    url: str | None = None

    def describe(self) -> str:
        if self.kind == LOCAL_BUILD:
            return "built on this host (local store)"
        if self.kind == SIGNED:
            return f"signature by trusted key {self.key_id} ({self.url})"
        return f"NOT verified: accepted with --allow-unsigned ({self.url})"


@dataclass(frozen=True)
class TrustPolicy:
    keys: tuple[TrustedKey, ...] = ()
    allow_unsigned: bool = False

    @classmethod
    def load(
        cls, trust_keys: list[Path] | None = None, allow_unsigned: bool = False
    ) -> TrustPolicy:
        """Keys from the flags, then $NEURONCTL_TRUSTED_KEYS, then the config directory."""
        sources: list[Path] = list(trust_keys or [])
        env = os.environ.get(TRUSTED_KEYS_ENV, "")
        sources += [Path(p).expanduser() for p in env.split(os.pathsep) if p]
        config_dir = trusted_keys_dir()
        if config_dir.is_dir():
            sources.append(config_dir)
        keys: dict[str, TrustedKey] = {}
        for source in sources:
            for key in _read_public_keys(source):
                keys.setdefault(key.key_id, key)
        return cls(tuple(keys.values()), allow_unsigned)

    def find(self, wanted: str) -> TrustedKey | None:
        return next((k for k in self.keys if k.key_id == wanted), None)


# -- keys -------------------------------------------------------------------------------------


def generate_keypair(prefix: Path, force: bool = False) -> tuple[Path, Path, str]:
    """Write PREFIX.key (private, 0600) and PREFIX.pub; returns both paths and the key id."""
    private_path = prefix.with_name(prefix.name + ".key")
    public_path = prefix.with_name(prefix.name + ".pub")
    for path in (private_path, public_path):
        if path.exists() and not force:
            raise UsageError(f"{path} already exists", "choose another name or pass --force")
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    prefix.parent.mkdir(parents=True, exist_ok=True)
    private_path.unlink(missing_ok=True)
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public = private.public_key()
    public_path.write_bytes(
        public.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private_path, public_path, key_id(public)


def load_signer(value: str | Path | None) -> Signer | None:
    """The signing key from a flag value, else $NEURONCTL_SIGNING_KEY; None when neither is set.

    The value is a path to a PEM file, or the PEM text itself (a CI secret in a variable)."""
    text = str(value) if value else os.environ.get(SIGNING_KEY_ENV, "")
    if not text:
        return None
    if text.lstrip().startswith("-----BEGIN"):
        data, where = text.encode(), f"${SIGNING_KEY_ENV}"
    else:
        path = Path(text).expanduser()
        try:
            data, where = path.read_bytes(), str(path)
        except OSError as exc:
            raise UsageError(
                f"cannot read the signing key {path}: {exc.strerror}",
                "make one with `neuronctl artifacts keygen NAME`",
            ) from None
    try:
        private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{where} is not an unencrypted PEM private key: {exc}") from None
    if not isinstance(private, Ed25519PrivateKey):
        raise UsageError(f"{where} is not an ed25519 key", "make one with `artifacts keygen`")
    return Signer(private, key_id(private.public_key()))


def _read_public_keys(source: Path) -> list[TrustedKey]:
    if source.is_dir():
        return [k for path in sorted(source.glob("*.pub")) for k in _read_public_keys(path)]
    try:
        data = source.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read the trusted key {source}: {exc.strerror}") from None
    try:
        public = serialization.load_pem_public_key(data)
    except ValueError as exc:
        raise UsageError(f"{source} is not a PEM public key: {exc}") from None
    if not isinstance(public, Ed25519PublicKey):
        raise UsageError(f"{source} is not an ed25519 public key")
    return [TrustedKey(public, key_id(public), str(source))]


# -- signatures -------------------------------------------------------------------------------


def sign(manifest_bytes: bytes, signer: Signer) -> bytes:
    """The manifest.sig content for these exact manifest bytes."""
    signature = signer.key.sign(SIGNED_PREFIX + manifest_bytes)
    record = {
        "format": SIGNATURE_FORMAT,
        "algorithm": "ed25519",
        "key_id": signer.key_id,
        "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest(),
        "signature": base64.b64encode(signature).decode(),
    }
    return (json.dumps(record, indent=2) + "\n").encode()


def signed_by(manifest_bytes: bytes, signature: bytes | None, public: Ed25519PublicKey) -> bool:
    """Whether `signature` is a valid signature of these manifest bytes by `public`."""
    record = _parse_signature(signature)
    if record is None:
        return False
    try:
        public.verify(base64.b64decode(record["signature"]), SIGNED_PREFIX + manifest_bytes)
    except (InvalidSignature, ValueError):
        return False
    return True


def verify(
    manifest_bytes: bytes, signature: bytes | None, policy: TrustPolicy, url: str
) -> Vouch:
    """A Vouch for a remote manifest, or SignatureError (unless the policy allows unsigned)."""
    try:
        return _verify(manifest_bytes, signature, policy, url)
    except SignatureError:
        if policy.allow_unsigned:
            return Vouch(UNSIGNED, url=url)
        raise


def _verify(
    manifest_bytes: bytes, signature: bytes | None, policy: TrustPolicy, url: str
) -> Vouch:
    allow = "or pass --allow-unsigned to use it unverified"
    if signature is None:
        raise SignatureError(f"{url} is not signed", f"ask its publisher to sign it, {allow}")
    record = _parse_signature(signature)
    if record is None:
        raise SignatureError(f"{url}/{SIGNATURE} is not a neuronctl signature")
    trusted = policy.find(str(record.get("key_id")))
    if trusted is None:
        known = ", ".join(k.key_id for k in policy.keys) or "none"
        raise SignatureError(
            f"{url} is signed by key {record.get('key_id')}, which is not trusted here "
            f"(trusted: {known})",
            f"trust the publisher's public key with --trust-key or ${TRUSTED_KEYS_ENV}, {allow}",
        )
    if not signed_by(manifest_bytes, signature, trusted.key):
        raise SignatureError(
            f"{url}: the signature does not match its manifest (key {trusted.key_id})",
            "the manifest or the signature was changed after signing; do not use it",
        )
    return Vouch(SIGNED, key_id=trusted.key_id, url=url)


def _parse_signature(signature: bytes | None) -> dict[str, Any] | None:
    if signature is None:
        return None
    try:
        record = json.loads(signature)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or record.get("format") != SIGNATURE_FORMAT:
        return None
    if record.get("algorithm") != "ed25519" or not isinstance(record.get("signature"), str):
        return None
    return record


# -- provenance of a pulled artifact ----------------------------------------------------------


@dataclass(frozen=True)
class Provenance:
    url: str
    manifest_bytes: bytes  # the remote manifest.json, exactly as signed
    signature: bytes | None

    def to_json(self) -> str:
        record = {
            "url": self.url,
            "pulled": datetime.now(UTC).isoformat(timespec="seconds"),
            "manifest": base64.b64encode(self.manifest_bytes).decode(),
            "signature": None if self.signature is None else self.signature.decode(),
        }
        return json.dumps(record, indent=2) + "\n"


def read_provenance(artifact: Path) -> Provenance | None:
    """What pull recorded about an artifact's origin; None for an artifact built here."""
    path = artifact / PROVENANCE
    if not path.exists() and not path.is_symlink():
        return None
    try:
        record = json.loads(path.read_text())
        signature = record["signature"]
        return Provenance(
            url=str(record["url"]),
            manifest_bytes=base64.b64decode(record["manifest"], validate=True),
            signature=None if signature is None else str(signature).encode(),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SignatureError(
            f"{path} is unreadable ({type(exc).__name__})",
            "pull the artifact again with `neuronctl artifacts pull`",
        ) from None


def check_origin(artifact: Path, manifest: Manifest, policy: TrustPolicy) -> Vouch:
    """Who vouches for a local artifact before anything in it is loaded.

    Built here: the local store. Pulled: the signature recorded at pull time, checked again
    against the keys trusted now, and the local manifest must be the signed one (same files,
    same sha256). Raises SignatureError otherwise, unless the policy allows unsigned."""
    origin = read_provenance(artifact)
    if origin is None:
        return Vouch(LOCAL_BUILD)
    vouch = verify(origin.manifest_bytes, origin.signature, policy, origin.url)
    problem = differs_from(manifest, origin.manifest_bytes)
    if problem:
        raise SignatureError(
            f"{artifact} is not what was pulled from {origin.url}: {problem}",
            "pull it again with `neuronctl artifacts pull`",
        )
    return vouch


def differs_from(local: Manifest, remote_bytes: bytes) -> str | None:
    """How a pulled artifact's manifest differs from the remote one it was pulled from."""
    try:
        remote = Manifest.model_validate_json(remote_bytes)
    except ValueError:
        return "the recorded remote manifest does not parse"
    files = {rel: e for rel, e in local.files.items() if rel != PROVENANCE}
    if files != remote.files:
        changed = sorted(r for r in {*files, *remote.files} if files.get(r) != remote.files.get(r))
        return f"file {changed[0]} differs from the signed record"
    if local.model_dump(exclude={"files"}) != remote.model_dump(exclude={"files"}):
        return "its manifest differs from the signed one"
    return None
