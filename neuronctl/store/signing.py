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
  <local>/<key>/graph-origin.json  written by compile when it reused the graphs of a pulled
                                artifact: that artifact's signed manifest, its signature and
                                the graphs taken from it, so revoking the key stops them too.

The one load rule (check_origin): an artifact loads only from a directory no other user can
write (store/owned.py: it, everything in it and the two directories above), and only from
  - a local build: no provenance.json, in a store's layout
    (`<root>/neuron-compiled-artifacts/<key>/`), and any graphs it reused from a pulled
    artifact still vouched for;
  - an artifact a key trusted *now* signed (provenance.json of a pull, or the manifest.sig of
    a pushed artifact read in place), its code files hashed against the signed manifest at
    every load (and every file, weights included, for an artifact read in place: no pull
    hashed them);
  - anything else only with --allow-unsigned.
What was hashed is what is loaded: the loader copies each code file into private memory,
hashing it as it goes, and loads that copy (store/verified.py).

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
from typing import TYPE_CHECKING, Any

from neuronctl.errors import NeuronctlError, UsageError
from neuronctl.store.manifest import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    Manifest,
    read_capped,
    sha256_file,
)
from neuronctl.store.owned import others_can_write

if TYPE_CHECKING:  # cryptography loads where a key is read or a signature checked: a local
    # build's load rule needs neither, and `generate` starts without it
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

SIGNATURE = "manifest.sig"
PROVENANCE = "provenance.json"
GRAPH_ORIGIN = "graph-origin.json"
ARTIFACTS_DIR = "neuron-compiled-artifacts"  # a store's layout (store/local.py)
MAX_SIGNATURE_BYTES = 64 * 1024  # a manifest.sig is ~300 bytes
MAX_PROVENANCE_BYTES = 2 * MAX_MANIFEST_BYTES  # a base64 manifest and its signature
# Files that are code when loaded: graphs (the manifest names them) and shared libraries,
# TorchScript and NEFF files by suffix. Hashed against the signed manifest at every load.
CODE_SUFFIXES = (".so", ".pt2", ".pt", ".neff")
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
    from cryptography.hazmat.primitives import serialization

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
        if self.kind == LOCAL_BUILD and self.url:
            return f"built on this host, graphs signed by trusted key {self.key_id} ({self.url})"
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
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

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
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

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
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

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
    from cryptography.exceptions import InvalidSignature

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
        record = json.loads(read_capped(path, MAX_PROVENANCE_BYTES))
        signature = record["signature"]
        return Provenance(
            url=str(record["url"]),
            manifest_bytes=base64.b64decode(record["manifest"], validate=True),
            signature=None if signature is None else str(signature).encode(),
        )
    except (OSError, ValueError, KeyError, TypeError, NeuronctlError) as exc:
        raise SignatureError(
            f"{path} is unreadable ({type(exc).__name__})",
            "pull the artifact again with `neuronctl artifacts pull`",
        ) from None


def check_origin(artifact: Path, manifest: Manifest, policy: TrustPolicy) -> Vouch:
    """Who vouches for a local artifact before anything in it is loaded: the one load rule
    (module doc). Raises SignatureError when nothing does, unless the policy allows unsigned.

    First, no other user may be able to change it (store/owned.py): every directory and file
    of it, and the two directories above it. Then: pulled (provenance.json): the signature
    recorded at pull time, checked again against the keys trusted now; the local manifest
    must be the signed one and every code file hash to its signed sha256. No provenance: a
    local build if it sits in a store's layout (graphs it reused from a pulled artifact
    checked as that artifact would be), else only a manifest.sig beside it (an artifact read
    in place) vouches, for every byte, all of which are hashed now."""
    writers = others_can_write(artifact)
    if writers is not None:
        return _writable_by_others(artifact, writers, policy)
    origin = read_provenance(artifact)
    if origin is not None:
        vouch = verify(origin.manifest_bytes, origin.signature, policy, origin.url)
        problem = differs_from(manifest, origin.manifest_bytes)
        if problem:
            raise SignatureError(
                f"{artifact} is not what was pulled from {origin.url}: {problem}",
                "pull it again with `neuronctl artifacts pull`",
            )
        return _code_checked(artifact, origin.manifest_bytes, vouch, policy)
    where = _layout_problem(artifact)
    if where is None:
        return _graph_origin(artifact, manifest, policy) or Vouch(LOCAL_BUILD)
    return _signed_in_place(artifact, manifest, policy, where)


def store_problem(artifact: Path) -> str | None:
    """Why the local file system does not vouch for `artifact` as a local build (None when
    it does): it must be `<root>/neuron-compiled-artifacts/<name>/`, and no other user may be
    able to change anything in it (store/owned.py)."""
    return _layout_problem(artifact) or others_can_write(artifact)


def _layout_problem(artifact: Path) -> str | None:
    real = Path(artifact).resolve()
    if real.parent.name != ARTIFACTS_DIR:
        return f"{real} is not in a neuronctl store (.../{ARTIFACTS_DIR}/KEY)"
    return None


def _writable_by_others(artifact: Path, writers: str, policy: TrustPolicy) -> Vouch:
    """Nothing vouches for bytes another user can change after they were checked: not the
    local store, not a signature (they could be swapped between the check and the load, or
    while they are being served)."""
    if policy.allow_unsigned:
        return Vouch(UNSIGNED, url=str(artifact))
    raise SignatureError(
        f"{artifact} could change after it is checked: {writers}",
        "an artifact loads only from a directory no other user can write: pull it into your "
        "store with `neuronctl artifacts pull`, or pass --allow-unsigned to run it unverified",
    )


def _signed_in_place(artifact: Path, manifest: Manifest, policy: TrustPolicy, where: str) -> Vouch:
    """An artifact outside any store, that no other user can write: only its own
    manifest.sig vouches, and for every file: nothing hashed its weights before (a pull
    would have), so they are hashed now, at every load."""
    url = str(artifact)
    try:
        raw = read_capped(artifact / MANIFEST, MAX_MANIFEST_BYTES)
        signature = _read_signature(artifact / SIGNATURE)
        vouch = verify(raw, signature, policy, url)
    except SignatureError as exc:
        raise SignatureError(
            f"{exc.message}; it is not a local build either: {where}",
            "pull it into your store with `neuronctl artifacts pull`, or pass --allow-unsigned "
            "to run it unverified",
        ) from None
    if vouch.kind == SIGNED and (problem := differs_from(manifest, raw)):
        raise SignatureError(f"{artifact}: {problem}")
    every = sorted(manifest.files) if vouch.kind == SIGNED else None  # the signed list
    return _code_checked(artifact, raw, vouch, policy, names=every)


def _read_signature(path: Path) -> bytes | None:
    try:
        return read_capped(path, MAX_SIGNATURE_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, NeuronctlError) as exc:
        raise SignatureError(f"{path} is unreadable: {exc}") from None


def code_files(manifest: Manifest) -> list[str]:
    """The files of an artifact that run as code when it is loaded."""
    return sorted({*manifest.graphs, *(r for r in manifest.files if r.endswith(CODE_SUFFIXES))})


def code_problem(artifact: Path, signed: Manifest, names: list[str]) -> str | None:
    """The first of `names` whose bytes are not what the signed manifest records."""
    for rel in names:
        entry = signed.files.get(rel)
        if entry is None:
            return f"{rel} is not in the signed manifest"
        try:
            got = sha256_file(artifact / rel)
        except OSError as exc:
            return f"{rel} cannot be read ({exc.strerror})"
        if got != entry.sha256:
            return f"{rel} is not the signed file (sha256 {got[:12]}…, signed {entry.sha256[:12]}…)"
    return None


def _code_checked(
    artifact: Path, signed_bytes: bytes, vouch: Vouch, policy: TrustPolicy,
    names: list[str] | None = None,
) -> Vouch:
    """A signature vouches only for the bytes it covers: hash the code files (or `names`)
    now. The loader hashes each code file again as it copies it (what was hashed is what is
    loaded); this earlier check makes validate answer as the load will."""
    if vouch.kind != SIGNED:
        return vouch
    signed = Manifest.model_validate_json(signed_bytes)
    problem = code_problem(artifact, signed, code_files(signed) if names is None else names)
    if problem is None:
        return vouch
    if policy.allow_unsigned:
        return Vouch(UNSIGNED, url=vouch.url)
    raise SignatureError(
        f"{artifact}: {problem}; key {vouch.key_id} did not vouch for it",
        "the artifact changed after it was verified: pull it again, or pass --allow-unsigned",
    )


# -- graphs reused from a pulled artifact -----------------------------------------------------


def graph_origin_record(donor: Path, graphs: list[str]) -> str | None:
    """What a compile that copied `graphs` from `donor` must carry: the donor's signed
    manifest and signature (or the record the donor itself carries); None for a donor built
    here, whose graphs the local store vouches for."""
    origin = read_provenance(donor)
    if origin is None:
        inherited = donor / GRAPH_ORIGIN
        if not inherited.is_file():
            return None
        return read_capped(inherited, MAX_PROVENANCE_BYTES).decode()
    record = json.loads(origin.to_json())
    record["graphs"] = sorted(graphs)
    return json.dumps(record, indent=2) + "\n"


def _graph_origin(artifact: Path, manifest: Manifest, policy: TrustPolicy) -> Vouch | None:
    """A local build that reused a pulled artifact's graphs: that artifact's signature, checked
    against the keys trusted now, and the reused graphs against its signed sha256s."""
    path = artifact / GRAPH_ORIGIN
    if GRAPH_ORIGIN not in manifest.files and not path.exists():
        return None
    try:
        record = json.loads(read_capped(path, MAX_PROVENANCE_BYTES))
        url = str(record["url"])
        signed_bytes = base64.b64decode(record["manifest"], validate=True)
        sig = record["signature"]
        graphs = [str(g) for g in record["graphs"]]
    except (OSError, ValueError, KeyError, TypeError, NeuronctlError) as exc:
        raise SignatureError(
            f"{path} is unreadable ({type(exc).__name__})", "recompile the artifact"
        ) from None
    signature = None if sig is None else str(sig).encode()
    try:
        vouch = verify(signed_bytes, signature, policy, url)
    except SignatureError as exc:
        raise SignatureError(
            f"{artifact} reuses graphs from {url}, which no trusted key vouches for now: "
            f"{exc.message}",
            "recompile it without the donor (remove the donor artifact first), or pass "
            "--allow-unsigned",
        ) from None
    if vouch.kind == SIGNED:
        problem = code_problem(artifact, Manifest.model_validate_json(signed_bytes), graphs)
        if problem and not policy.allow_unsigned:
            raise SignatureError(f"{artifact}: reused graph {problem}", "recompile the artifact")
    return Vouch(LOCAL_BUILD if vouch.kind == SIGNED else UNSIGNED, vouch.key_id, url)


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
