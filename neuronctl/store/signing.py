"""Signed artifacts: an OpenSSF model-signing signature over the artifact, checked against
trusted keys, and the record of what was verified that every later load checks again.

The manifest lists the size and sha256 of every file of an artifact. The signature,
`model.sig`, is a sigstore bundle in model-signing's key format (store/model_signature.py):
an ECDSA signature over a statement listing the sha256 of every file and of manifest.json
itself. `model_signing verify key DIR --signature DIR/model.sig --public_key K.pub` accepts
an artifact neuronctl signed, and neuronctl accepts one `model_signing sign key` signed.
Pull checks the signature against manifest.json first, then every downloaded file against
the signed sha256 list.

The older format, `manifest.sig` (an ed25519 signature of the manifest bytes), is still
verified for this release, with a deprecation warning; nothing writes it any more and
ed25519 keys no longer sign (docs/security.md, "Migrating from ed25519 keys").

For a transport that carries a signature its own way (an OCI referrer): `sign` returns the
signature bytes for a manifest, `verify` checks given bytes, `SIGNATURE_MEDIA_TYPE` names them.

Files:
  <remote>/<key>/model.sig      the signature, uploaded before manifest.json (which goes last);
  <local>/<key>/provenance.json the record written by pull and by `neuronctl install`: where
                                the artifact came from, the remote manifest's exact bytes, its
                                signature and the public key that verified it, so that every
                                later load re-checks the signature: against the keys trusted
                                *then*, else against the recorded key unless it is revoked.
  <local>/<key>/graph-origin.json  written by compile when it reused the graphs of a pulled
                                artifact: that artifact's signed manifest, its signature and
                                the graphs taken from it, so revoking the key stops them too.

The one load rule (check_origin): an artifact loads only from a directory no other user can
write (store/owned.py: it, everything in it and the two directories above), and only from
  - a local build: no provenance.json, in a store's layout
    (`<root>/neuron-compiled-artifacts/<key>/`), and any graphs it reused from a pulled
    artifact still vouched for;
  - an artifact a key trusted now signed, or a pulled/installed artifact whose record names
    the key that verified it (not revoked, the record writable by no one else), its code
    files (graphs, shared libraries) hashed against the signed manifest at every load (and
    every file, weights included, for an artifact read in place: no pull hashed them);
  - anything else only with --allow-unsigned.
What was hashed is what is loaded: the loader copies each code file into private memory,
hashing it as it goes, and loads that copy (store/verified.py).

Keys: `neuronctl artifacts keygen NAME` writes NAME.key (private, EC P-256, PKCS#8 PEM, mode
0600) and NAME.pub, which model-signing's key mode reads as they are. A pusher signs with
--sign-key or $NEURONCTL_SIGNING_KEY (a path, or the PEM text itself, as CI secrets often
are); pullers trust the public keys named by --trust-key, $NEURONCTL_TRUSTED_KEYS (files or
directories, separated by ':') and the *.pub files in ~/.config/neuronctl/trusted-keys/.
Revoked keys ($NEURONCTL_REVOKED_KEYS, ~/.config/neuronctl/revoked-keys/*.pub) are refused
wherever they appear, recorded keys included.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import stat
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from neuronctl.errors import NeuronctlError, UsageError
from neuronctl.store.manifest import (
    ARTIFACTS_DIR,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    Manifest,
    read_capped,
    sha256_file,
)
from neuronctl.store.model_signature import (
    BUNDLE_MEDIA_TYPE,
    Bundle,
    key_hint,
    manifest_digests,
    sign_bundle,
    supported_curve,
)
from neuronctl.store.owned import others_can_write

logger = logging.getLogger(__name__)

SIGNATURE = "model.sig"  # model-signing's default signature file name
LEGACY_SIGNATURE = "manifest.sig"  # the ed25519 format: verified, never written
SIGNATURE_NAMES = (SIGNATURE, LEGACY_SIGNATURE)
SIGNATURE_MEDIA_TYPE = BUNDLE_MEDIA_TYPE
PROVENANCE = "provenance.json"
GRAPH_ORIGIN = "graph-origin.json"
# A model.sig lists every file with its sha256, about as long as the manifest.
MAX_SIGNATURE_BYTES = 2 * MAX_MANIFEST_BYTES
MAX_PROVENANCE_BYTES = 4 * MAX_MANIFEST_BYTES  # a base64 manifest, its signature and a key
# Files that are code when loaded: graphs (the manifest names them) and shared libraries,
# TorchScript and NEFF files by suffix. Hashed against the signed manifest at every load.
CODE_SUFFIXES = (".so", ".pt2", ".pt", ".neff")
SIGNING_KEY_ENV = "NEURONCTL_SIGNING_KEY"
TRUSTED_KEYS_ENV = "NEURONCTL_TRUSTED_KEYS"
REVOKED_KEYS_ENV = "NEURONCTL_REVOKED_KEYS"
LEGACY_FORMAT = "neuronctl-signature/1"
# Domain separation of the legacy format: a neuronctl key signed manifests and nothing else.
LEGACY_PREFIX = b"neuronctl manifest signature v1\n"
LOCAL_BUILD, SIGNED, UNSIGNED = "local-build", "signature", "allow-unsigned"
MIGRATE_HINT = (
    "make a new key with `neuronctl artifacts keygen NAME`, trust its .pub on the fleet and "
    "re-sign (docs/security.md, Migrating from ed25519 keys)"
)


class SignatureError(NeuronctlError):
    """A remote artifact is unsigned, or signed by a key nobody trusts, or tampered with."""


def _config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return Path(base) / "neuronctl"


def trusted_keys_dir() -> Path:
    return _config_dir() / "trusted-keys"


def revoked_keys_dir() -> Path:
    return _config_dir() / "revoked-keys"


def _is_ed25519(key: Any) -> bool:
    from cryptography.hazmat.primitives.asymmetric import ed25519

    return isinstance(key, ed25519.Ed25519PublicKey | ed25519.Ed25519PrivateKey)


def key_id(public: Any) -> str:
    """A short, stable name for a public key, 16 hex chars: for an EC key the start of the
    hint model-signing writes into its bundles (sha256 of the PEM public key); for a legacy
    ed25519 key the sha256 of its raw 32 bytes."""
    from cryptography.hazmat.primitives import serialization

    if _is_ed25519(public):
        raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return hashlib.sha256(raw).hexdigest()[:16]
    return key_hint(public)[:16]


def public_pem(public: Any) -> str:
    from cryptography.hazmat.primitives import serialization

    return public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()


@dataclass(frozen=True)
class Signer:
    key: Any  # an EllipticCurvePrivateKey of a curve model-signing accepts
    key_id: str


@dataclass(frozen=True)
class TrustedKey:
    key: Any  # an EllipticCurvePublicKey; an Ed25519PublicKey for the legacy format
    key_id: str
    source: str  # the file it was read from

    @property
    def legacy(self) -> bool:
        return _is_ed25519(self.key)


@dataclass(frozen=True)
class Vouch:
    """Who vouches for an artifact's bytes: this host's own build, a trusted signature, or
    only the user's --allow-unsigned."""

    kind: str  # LOCAL_BUILD | SIGNED | UNSIGNED
    key_id: str | None = None
    url: str | None = None
    recorded: bool = False  # the key is the one the pull or install record names

    def describe(self) -> str:
        if self.kind == LOCAL_BUILD and self.url:
            return f"built on this host, graphs signed by trusted key {self.key_id} ({self.url})"
        if self.kind == LOCAL_BUILD:
            return "built on this host (local store)"
        if self.kind == SIGNED and self.recorded:
            return f"signature by key {self.key_id}, trusted when it was pulled ({self.url})"
        if self.kind == SIGNED:
            return f"signature by trusted key {self.key_id} ({self.url})"
        return f"NOT verified: accepted with --allow-unsigned ({self.url})"


@dataclass(frozen=True)
class TrustPolicy:
    keys: tuple[TrustedKey, ...] = ()
    allow_unsigned: bool = False
    revoked: frozenset[str] = frozenset()  # key ids refused wherever they appear

    @classmethod
    def load(
        cls, trust_keys: list[Path] | None = None, allow_unsigned: bool = False
    ) -> TrustPolicy:
        """Keys from the flags, then $NEURONCTL_TRUSTED_KEYS, then the config directory; less
        the revoked ones ($NEURONCTL_REVOKED_KEYS, the revoked-keys config directory)."""
        revoked = frozenset(k.key_id for k in _keys_from(REVOKED_KEYS_ENV, revoked_keys_dir()))
        keys: dict[str, TrustedKey] = {}
        sources = [*(trust_keys or [])]
        for key in [k for s in sources for k in _read_public_keys(s)] + _keys_from(
            TRUSTED_KEYS_ENV, trusted_keys_dir()
        ):
            if key.key_id not in revoked:
                keys.setdefault(key.key_id, key)
        return cls(tuple(keys.values()), allow_unsigned, revoked)

    def find(self, wanted: str) -> TrustedKey | None:
        return next((k for k in self.keys if k.key_id == wanted), None)


def _keys_from(env: str, config_dir: Path) -> list[TrustedKey]:
    value = os.environ.get(env, "")
    sources = [Path(p).expanduser() for p in value.split(os.pathsep) if p]
    if config_dir.is_dir():
        sources.append(config_dir)
    return [k for source in sources for k in _read_public_keys(source)]


# -- keys -------------------------------------------------------------------------------------


def generate_keypair(prefix: Path, force: bool = False) -> tuple[Path, Path, str]:
    """Write PREFIX.key (private, EC P-256, 0600) and PREFIX.pub; returns both paths and the
    key id. model-signing's key mode reads both files as they are."""
    private_path = prefix.with_name(prefix.name + ".key")
    public_path = prefix.with_name(prefix.name + ".pub")
    for path in (private_path, public_path):
        if path.exists() and not force:
            raise UsageError(f"{path} already exists", "choose another name or pass --force")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    private = ec.generate_private_key(ec.SECP256R1())
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
    public_path.write_text(public_pem(public))
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

    try:
        private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{where} is not an unencrypted PEM private key: {exc}") from None
    if _is_ed25519(private):
        raise UsageError(
            f"{where} is an ed25519 key, which signs only the deprecated manifest.sig format",
            MIGRATE_HINT,
        )
    if not supported_curve(private):
        raise UsageError(
            f"{where} is not an EC key on NIST P-256, P-384 or P-521 (what model-signing "
            "accepts)",
            "make one with `neuronctl artifacts keygen NAME`",
        )
    return Signer(private, key_id(private.public_key()))


def _read_public_keys(source: Path) -> list[TrustedKey]:
    if source.is_dir():
        return [k for path in sorted(source.glob("*.pub")) for k in _read_public_keys(path)]
    try:
        data = source.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read the trusted key {source}: {exc.strerror}") from None
    return [public_key_from_pem(data, str(source))]


def public_key_from_pem(data: bytes, source: str) -> TrustedKey:
    from cryptography.hazmat.primitives import serialization

    try:
        public = serialization.load_pem_public_key(data)
    except ValueError as exc:
        raise UsageError(f"{source} is not a PEM public key: {exc}") from None
    if not (supported_curve(public) or _is_ed25519(public)):
        raise UsageError(
            f"{source} is not an EC public key on NIST P-256, P-384 or P-521",
            "use the .pub that `neuronctl artifacts keygen` wrote",
        )
    return TrustedKey(public, key_id(public), source)


# -- signatures -------------------------------------------------------------------------------


def sign(manifest_bytes: bytes, signer: Signer) -> bytes:
    """The model.sig content for an artifact with these exact manifest bytes: a
    model-signing bundle over every file's sha256 (from the manifest) and manifest.json's."""
    name, files = _listed(manifest_bytes)
    return sign_bundle(name, manifest_digests(manifest_bytes, files), signer.key)


def _listed(manifest_bytes: bytes) -> tuple[str, dict[str, str]]:
    """A manifest's artifact key (20 chars) and its files' sha256s, read as plain JSON: what a
    signature covers is decided here, whether the manifest is acceptable is decided later
    (the path rule, the reserved names)."""
    try:
        data = json.loads(manifest_bytes)
        files = {str(rel): str(entry["sha256"]) for rel, entry in data["files"].items()}
        name = str((data.get("keys") or {}).get("artifact_key", ""))[:20] or "artifact"
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise ValueError(f"the manifest does not parse ({type(exc).__name__})") from None
    return name, files


def signature_file(signature: bytes) -> str:
    """The file name a signature goes by beside an artifact: model.sig for a model-signing
    bundle, manifest.sig for the legacy format (a mirror keeps what its publisher signed)."""
    return SIGNATURE if Bundle.parse(signature) is not None else LEGACY_SIGNATURE


def signed_by(manifest_bytes: bytes, signature: bytes | None, public: Any) -> bool:
    """Whether `signature` is a valid signature of this artifact (these manifest bytes) by
    `public`, in either format."""
    bundle = Bundle.parse(signature)
    if bundle is not None:
        return bundle.signed_by(public) and _covers(bundle, manifest_bytes) is None
    record = _parse_legacy(signature)
    if record is None or not _is_ed25519(public):
        return False
    from cryptography.exceptions import InvalidSignature

    try:
        public.verify(base64.b64decode(record["signature"]), LEGACY_PREFIX + manifest_bytes)
    except (InvalidSignature, ValueError):
        return False
    return True


def _covers(bundle: Bundle, manifest_bytes: bytes) -> str | None:
    """Why a verified bundle does not vouch for exactly this artifact (None when it does):
    it must list manifest.json with these bytes' sha256 and every file the manifest lists,
    with the manifest's sha256, and nothing else."""
    try:
        signed = bundle.digests()
        expected = manifest_digests(manifest_bytes, _listed(manifest_bytes)[1])
    except ValueError as exc:
        return str(exc).splitlines()[0]
    for rel in sorted({*signed, *expected}):
        if signed.get(rel) != expected.get(rel):
            if rel not in expected:
                return f"it signs {rel}, which the manifest does not list"
            if rel not in signed:
                return f"it does not sign {rel}"
            return f"{rel} is not the signed file"
    return None


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


ALLOW = "or pass --allow-unsigned to use it unverified"


def verify_any(
    manifest_bytes: bytes, signatures: list[bytes], policy: TrustPolicy, url: str
) -> tuple[bytes | None, Vouch]:
    """The signature that vouches for a remote manifest among several (a registry may hold
    one per signing: re-signed with a new key, or by a second publisher) and its Vouch: the
    first, in the order given, that a trusted, unrevoked key made for exactly these bytes.
    None verifies: the first one's refusal (how many others failed too), unless the policy
    allows unsigned."""
    refusals: list[SignatureError] = []
    for signature in signatures:
        try:
            return signature, _verify(manifest_bytes, signature, policy, url)
        except SignatureError as exc:
            refusals.append(exc)
    if policy.allow_unsigned:
        return (signatures[0] if signatures else None), Vouch(UNSIGNED, url=url)
    if not refusals:
        raise SignatureError(f"{url} is not signed", f"ask its publisher to sign it, {ALLOW}")
    first = refusals[0]
    if len(refusals) > 1:
        raise SignatureError(f"{first.message} (and {len(refusals) - 1} more signatures, none "
                             "by a trusted key)", first.hint)  # fmt: skip
    raise first


def _verify(
    manifest_bytes: bytes, signature: bytes | None, policy: TrustPolicy, url: str
) -> Vouch:
    if signature is None:
        raise SignatureError(f"{url} is not signed", f"ask its publisher to sign it, {ALLOW}")
    bundle = Bundle.parse(signature)
    if bundle is not None:
        return _verify_bundle(bundle, manifest_bytes, policy, url)
    record = _parse_legacy(signature)
    if record is None:
        raise SignatureError(f"{url}: its signature is neither a model-signing bundle nor a "
                             "neuronctl signature")  # fmt: skip
    return _verify_legacy(record, manifest_bytes, signature, policy, url)


def _untrusted(url: str, signer: str, policy: TrustPolicy) -> SignatureError:
    if signer in policy.revoked:
        return SignatureError(
            f"{url} is signed by key {signer}, which is revoked here",
            f"ask its publisher to re-sign it with a current key ({REVOKED_KEYS_ENV}, "
            f"{revoked_keys_dir()})",
        )
    known = ", ".join(k.key_id for k in policy.keys) or "none"
    return SignatureError(
        f"{url} is signed by key {signer}, which is not trusted here (trusted: {known})",
        f"trust the publisher's public key with --trust-key or ${TRUSTED_KEYS_ENV}, {ALLOW}",
    )


def _verify_bundle(bundle: Bundle, manifest_bytes: bytes, policy: TrustPolicy, url: str) -> Vouch:
    hint = (bundle.hint or "")[:16]
    candidates = [k for k in policy.keys if not k.legacy and k.key_id.startswith(hint)]
    trusted = next((k for k in candidates if bundle.signed_by(k.key)), None)
    if trusted is None and (not hint or not candidates):
        raise _untrusted(url, hint or "(unnamed)", policy)
    if trusted is None:
        raise SignatureError(
            f"{url}: the signature does not match its manifest (key {hint})",
            "the manifest or the signature was changed after signing; do not use it",
        )
    problem = _covers(bundle, manifest_bytes)
    if problem is not None:
        raise SignatureError(
            f"{url}: the signature does not match its manifest: {problem} (key "
            f"{trusted.key_id})",
            "sign the artifact directory as pushed (its files and manifest.json only); a "
            "changed manifest is not the signed artifact",
        )
    return Vouch(SIGNED, key_id=trusted.key_id, url=url)


_warned: set[str] = set()


def _verify_legacy(
    record: dict[str, Any],
    manifest_bytes: bytes,
    signature: bytes,
    policy: TrustPolicy,
    url: str,
) -> Vouch:
    signer = str(record.get("key_id"))
    trusted = policy.find(signer)
    if trusted is None:
        raise _untrusted(url, signer, policy)
    if not signed_by(manifest_bytes, signature, trusted.key):
        raise SignatureError(
            f"{url}: the signature does not match its manifest (key {trusted.key_id})",
            "the manifest or the signature was changed after signing; do not use it",
        )
    if signer not in _warned:
        _warned.add(signer)
        logger.warning(
            "%s is signed in the deprecated %s format (ed25519 key %s), verified for this "
            "release only: %s",
            url, LEGACY_SIGNATURE, signer, MIGRATE_HINT,
        )  # fmt: skip
    return Vouch(SIGNED, key_id=trusted.key_id, url=url)


def _parse_legacy(signature: bytes | None) -> dict[str, Any] | None:
    if signature is None:
        return None
    try:
        record = json.loads(signature)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or record.get("format") != LEGACY_FORMAT:
        return None
    if record.get("algorithm") != "ed25519" or not isinstance(record.get("signature"), str):
        return None
    return record


# -- the record of a pulled or installed artifact ---------------------------------------------


@dataclass(frozen=True)
class Provenance:
    """provenance.json: what pull or install verified, and with which key."""

    url: str
    manifest_bytes: bytes  # the remote manifest.json, exactly as signed
    signature: bytes | None
    key_pem: str | None = None  # the public key that verified it then (None: unsigned)

    def to_json(self) -> str:
        record: dict[str, Any] = {
            "url": self.url,
            "pulled": datetime.now(UTC).isoformat(timespec="seconds"),
            "manifest": base64.b64encode(self.manifest_bytes).decode(),
            "signature": None if self.signature is None else self.signature.decode(),
        }
        if self.key_pem is not None:
            record["verified_with"] = self.key_pem
        return json.dumps(record, indent=2) + "\n"


def verified_record(
    url: str, manifest_bytes: bytes, signature: bytes | None, vouch: Vouch, policy: TrustPolicy
) -> Provenance:
    """The record of a verification that just passed: the key that vouched goes with it."""
    trusted = policy.find(vouch.key_id) if vouch.kind == SIGNED and vouch.key_id else None
    pem = None if trusted is None else public_pem(trusted.key)
    return Provenance(url, manifest_bytes, signature, pem)


def read_provenance(artifact: Path) -> Provenance | None:
    """What pull or install recorded about an artifact's origin; None for one built here."""
    path = artifact / PROVENANCE
    if not path.exists() and not path.is_symlink():
        return None
    try:
        record = json.loads(read_capped(path, MAX_PROVENANCE_BYTES))
        signature = record["signature"]
        pem = record.get("verified_with")
        return Provenance(
            url=str(record["url"]),
            manifest_bytes=base64.b64decode(record["manifest"], validate=True),
            signature=None if signature is None else str(signature).encode(),
            key_pem=None if pem is None else str(pem),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError, NeuronctlError) as exc:
        raise SignatureError(
            f"{path} is unreadable ({type(exc).__name__})",
            "pull the artifact again with `neuronctl artifacts pull`",
        ) from None


def record_vouch(
    artifact: Path, origin: Provenance, policy: TrustPolicy, name: str = PROVENANCE
) -> Vouch:
    """Who vouches for a pulled or installed artifact: a key trusted now, else the key its
    record names (the one that verified it at pull or install) unless that key is revoked
    or someone other than this user (or root) could have written the record."""
    try:
        return _verify(origin.manifest_bytes, origin.signature, policy, origin.url)
    except SignatureError as refused:
        vouch = _recorded_vouch(artifact, origin, policy, name)
        if vouch is not None:
            return vouch
        if policy.allow_unsigned:
            return Vouch(UNSIGNED, url=origin.url)
        raise refused from None


def _recorded_vouch(
    artifact: Path, origin: Provenance, policy: TrustPolicy, name: str
) -> Vouch | None:
    if origin.key_pem is None:
        return None
    try:
        recorded = public_key_from_pem(origin.key_pem.encode(), f"{artifact / name}")
    except UsageError:
        return None
    if recorded.key_id in policy.revoked:
        return None
    problem = record_place_problem(artifact, name)
    if problem is not None:
        logger.warning("the key recorded in %s is not used: %s", artifact / name, problem)
        return None
    try:
        vouch = _verify(origin.manifest_bytes, origin.signature, TrustPolicy((recorded,)),
                        origin.url)  # fmt: skip
    except SignatureError:
        return None
    return Vouch(SIGNED, key_id=vouch.key_id, url=origin.url, recorded=True)


def record_place_problem(artifact: Path, name: str = PROVENANCE) -> str | None:
    """Why a record in `artifact` may have been written by someone else (None when it could
    only be this user or root): the artifact directory (symbolic links followed) and the
    record itself must be owned by this user or root and writable by no one else."""
    real = Path(artifact).resolve()
    for path in (real, real / name):
        try:
            info = os.lstat(path)
        except OSError as exc:
            return f"{path}: {exc.strerror}"
        if path != real and not stat.S_ISREG(info.st_mode):
            return f"{path} is not a regular file"
        if info.st_uid not in (os.geteuid(), 0):
            return f"{path} is owned by uid {info.st_uid}, not by this user or root"
        if info.st_mode & 0o002 or (info.st_mode & 0o020 and info.st_gid != os.getegid()):
            return f"{path} is writable by other users"
    return None


def check_origin(artifact: Path, manifest: Manifest, policy: TrustPolicy) -> Vouch:
    """Who vouches for a local artifact before anything in it is loaded: the one load rule
    (module doc). Raises SignatureError when nothing does, unless the policy allows unsigned.

    First, no other user may be able to change it (store/owned.py): every directory and file
    of it, and the two directories above it. Then: pulled or installed (provenance.json): the
    signature recorded then, checked again against the keys trusted now or the key the record
    names (record_vouch); the local manifest must be the signed one and every code file hash
    to its signed sha256. No provenance: a local build if it sits in a store's layout (graphs
    it reused from a pulled artifact checked as that artifact would be), else only a
    signature beside it (an artifact read in place) vouches, for every byte, all of which are
    hashed now."""
    writers = others_can_write(artifact)
    if writers is not None:
        return _writable_by_others(artifact, writers, policy)
    origin = read_provenance(artifact)
    if origin is not None:
        vouch = record_vouch(artifact, origin, policy)
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
        signature = read_signature(artifact)
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


def read_signature(artifact: Path) -> bytes | None:
    """The signature beside an artifact read in place: model.sig, else the legacy
    manifest.sig; None when there is neither."""
    for name in SIGNATURE_NAMES:
        path = artifact / name
        try:
            return read_capped(path, MAX_SIGNATURE_BYTES)
        except FileNotFoundError:
            continue
        except (OSError, NeuronctlError) as exc:
            raise SignatureError(f"{path} is unreadable: {exc}") from None
    return None


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
        pem = record.get("verified_with")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, NeuronctlError) as exc:
        raise SignatureError(
            f"{path} is unreadable ({type(exc).__name__})", "recompile the artifact"
        ) from None
    signature = None if sig is None else str(sig).encode()
    origin = Provenance(url, signed_bytes, signature, None if pem is None else str(pem))
    try:  # the donor's pull record came along: its key vouches as it does for the donor
        vouch = record_vouch(artifact, origin, policy, GRAPH_ORIGIN)
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
