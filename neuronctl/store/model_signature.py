"""OpenSSF model-signing signatures (the `model-signing` package's key mode), made and read here.

An artifact's signature is `model.sig`: a sigstore bundle (media type below) holding a DSSE
envelope whose payload is an in-toto statement listing the sha256 of every file of the
artifact directory, `manifest.json` included. That is what `model_signing sign key DIR`
writes and what `model_signing verify key DIR --signature DIR/model.sig --public_key K.pub`
checks, so either tool verifies what the other signed.

neuronctl builds the statement from manifest.json (which already records every file's
sha256, re-checked as each file is pushed or pulled) instead of hashing the directory again,
and checks a signature against the manifest alone, before anything is downloaded. Only the
format model-signing's key mode produces is accepted: "files" serialization, sha256
digests, one ECDSA signature (NIST P-256/384/521) over the DSSE pre-authentication encoding.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ec import (
        EllipticCurvePrivateKey,
        EllipticCurvePublicKey,
    )

BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"  # the OCI referrer's type
PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://model_signing/signature/v1.0"
MANIFEST_NAME = "manifest.json"
CURVES = ("secp256r1", "secp384r1", "secp521r1")  # what model-signing's key mode accepts
# Recorded in the signed statement: files beside an artifact that are bookkeeping, not
# part of it (the signatures, the record a pull or an install writes), and the git files
# model-signing ignores by default. `model_signing verify` skips what the statement lists.
IGNORED_PATHS = (
    "model.sig",
    "manifest.sig",
    "provenance.json",
    ".git",
    ".gitattributes",
    ".github",
    ".gitignore",
)


def key_hint(public: EllipticCurvePublicKey) -> str:
    """The bundle's public key hint: sha256 of the key's SubjectPublicKeyInfo PEM, hex (as
    model-signing records and compares it)."""
    from cryptography.hazmat.primitives import serialization

    pem = public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(pem).hexdigest()


def supported_curve(key: Any) -> bool:
    from cryptography.hazmat.primitives.asymmetric import ec

    public = key.public_key() if isinstance(key, ec.EllipticCurvePrivateKey) else key
    return isinstance(public, ec.EllipticCurvePublicKey) and public.curve.name in CURVES


def _hash_for(public: EllipticCurvePublicKey) -> Any:
    from cryptography.hazmat.primitives import hashes

    return {256: hashes.SHA256, 384: hashes.SHA384}.get(public.curve.key_size, hashes.SHA512)()


def pae(payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what the signature covers."""
    head = f"DSSEv1 {len(PAYLOAD_TYPE)} {PAYLOAD_TYPE} {len(payload)} ".encode()
    return head + payload


def statement(name: str, digests: dict[str, str]) -> bytes:
    """The in-toto statement over `digests` (relative path -> sha256 hex)."""
    names = sorted(digests)
    root = hashlib.sha256(b"".join(bytes.fromhex(digests[n]) for n in names)).hexdigest()
    body = {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": name, "digest": {"sha256": root}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "serialization": {
                "method": "files",
                "hash_type": "sha256",
                "allow_symlinks": False,
                "ignore_paths": list(IGNORED_PATHS),
            },
            "resources": [
                {"name": n, "algorithm": "sha256", "digest": digests[n]} for n in names
            ],
        },
    }
    return json.dumps(body, indent=2).encode()


def manifest_digests(manifest_bytes: bytes, files: dict[str, str]) -> dict[str, str]:
    """What a signature of this artifact must list: every file and manifest.json itself."""
    return {**files, MANIFEST_NAME: hashlib.sha256(manifest_bytes).hexdigest()}


def sign_bundle(name: str, digests: dict[str, str], key: EllipticCurvePrivateKey) -> bytes:
    """model.sig for these digests, signed by `key`."""
    from cryptography.hazmat.primitives.asymmetric import ec

    payload = statement(name, digests)
    public = key.public_key()
    signature = key.sign(pae(payload), ec.ECDSA(_hash_for(public)))
    bundle = {
        "mediaType": BUNDLE_MEDIA_TYPE,
        "verificationMaterial": {"publicKey": {"hint": key_hint(public)}, "tlogEntries": []},
        "dsseEnvelope": {
            "payload": base64.b64encode(payload).decode(),
            "payloadType": PAYLOAD_TYPE,
            "signatures": [{"sig": base64.b64encode(signature).decode(), "keyid": ""}],
        },
    }
    return (json.dumps(bundle, indent=2) + "\n").encode()


class Bundle:
    """A parsed model.sig, not yet verified."""

    def __init__(self, hint: str | None, payload: bytes, signature: bytes) -> None:
        self.hint = hint
        self.payload = payload
        self.signature = signature

    @classmethod
    def parse(cls, data: bytes | None) -> Bundle | None:
        """None unless `data` is a sigstore bundle with one DSSE signature."""
        if data is None:
            return None
        try:
            bundle = json.loads(data)
            if bundle.get("mediaType") != BUNDLE_MEDIA_TYPE:
                return None
            envelope = bundle["dsseEnvelope"]
            if envelope.get("payloadType") != PAYLOAD_TYPE or len(envelope["signatures"]) != 1:
                return None
            hint = (bundle.get("verificationMaterial") or {}).get("publicKey", {}).get("hint")
            payload = base64.b64decode(envelope["payload"], validate=True)
            signature = base64.b64decode(envelope["signatures"][0]["sig"], validate=True)
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            return None
        return cls(hint if isinstance(hint, str) and hint else None, payload, signature)

    def signed_by(self, public: Any) -> bool:
        """Whether `public` (an EC key of a supported curve) made this signature."""
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric import ec

        if not supported_curve(public):
            return False
        if self.hint is not None and self.hint != key_hint(public):
            return False
        try:
            public.verify(self.signature, pae(self.payload), ec.ECDSA(_hash_for(public)))
        except InvalidSignature:
            return False
        return True

    def digests(self) -> dict[str, str]:
        """The signed statement's files and sha256s; ValueError when it is not a statement
        this format allows (call only after `signed_by`)."""
        try:
            body = json.loads(self.payload)
            if body["_type"] != STATEMENT_TYPE or body["predicateType"] != PREDICATE_TYPE:
                raise ValueError("not a model-signing v1.0 statement")
            serialization = body["predicate"]["serialization"]
            if serialization.get("method") != "files" or serialization.get("hash_type") != (
                "sha256"
            ):
                raise ValueError(
                    f"signed with {serialization.get('method')}/"
                    f"{serialization.get('hash_type')} serialization, not files/sha256"
                )
            resources = body["predicate"]["resources"]
            digests = {str(r["name"]): str(r["digest"]).lower() for r in resources}
            if any(r.get("algorithm") != "sha256" for r in resources):
                raise ValueError("a resource is not hashed with sha256")
            (subject,) = body["subject"]
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed statement ({type(exc).__name__})") from None
        order = [str(r["name"]) for r in resources]
        root = hashlib.sha256(b"".join(bytes.fromhex(digests[n]) for n in order)).hexdigest()
        if subject.get("digest", {}).get("sha256") != root:
            raise ValueError("the statement's root digest does not match its resources")
        return digests
