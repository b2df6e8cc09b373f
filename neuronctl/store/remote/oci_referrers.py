"""An artifact's signature in a registry: an OCI referrer of the artifact's manifest.

The signature (model.sig, a model-signing bundle) is the one layer of a manifest of its own
(image-spec 1.1): `artifactType` the bundle's media type, config the empty descriptor,
`subject` the artifact manifest's descriptor. `oras discover REGISTRY/REPO:KEY` lists it, and
`oras pull REGISTRY/REPO@<its digest>` writes model.sig.

Where it is found (distribution-spec 1.1):

- a registry with the referrers API (`GET /v2/<repo>/referrers/<digest>?artifactType=...`)
  indexes a manifest's `subject` itself, and says so with an `OCI-Subject` header on the PUT;
- a registry without it answers that GET with 404 (the distribution registry 2.8, GHCR): the
  client that pushes a referrer keeps the list itself, an image index tagged
  `sha256-<hex of the subject's digest>` ("Referrers Tag Schema"): read it (none: start
  empty), append the new descriptor unless it is there, put it back.

Every list is a claim, whichever answered it: each listed manifest is fetched by digest (the
registry's bytes hashed), and used only when it is a signature manifest whose `subject` is
the very manifest being pulled; its layer is read capped at its size and checked against its
digest. A signature vouches only once store/signing.py verified it against a trusted key.

Several signatures (re-signed with a new key, or by a second publisher): the list is read
newest first (a client appends), at most MAX_SIGNATURES, and the first one a trusted key made
is the one used and recorded (signing.verify_any).
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import UTC, datetime
from typing import Any

from neuronctl.store.model_signature import BUNDLE_MEDIA_TYPE, Bundle
from neuronctl.store.remote.errors import RemoteArtifactError
from neuronctl.store.remote.oci_layout import CREATED, TITLE, Blob
from neuronctl.store.remote.oci_ref import DIGEST
from neuronctl.store.remote.oci_registry import OCI_INDEX, OCI_MANIFEST, Registry
from neuronctl.store.signing import MAX_SIGNATURE_BYTES, SIGNATURE

SIGNATURE_ARTIFACT_TYPE = BUNDLE_MEDIA_TYPE  # signing.SIGNATURE_MEDIA_TYPE
EMPTY_TYPE = "application/vnd.oci.empty.v1+json"  # image-spec 1.1's config for an artifact
EMPTY = b"{}"
KEY_HINT = "dev.neuronctl.signature.key"  # the bundle's key hint, for `oras discover`
MAX_SIGNATURES = 16  # the newest ones read; a list of hundreds is not a signature's
_DIGEST_RE = re.compile(DIGEST)


def referrers_tag(digest: str) -> str:
    """`sha256:<hex>` -> `sha256-<hex>` (distribution-spec "Referrers Tag Schema")."""
    return digest.replace(":", "-", 1)


def signature_manifest(subject: Blob, layer: Blob, signature: bytes, empty: str) -> bytes:
    """The manifest that carries a signature: its bundle the one layer, titled model.sig."""
    notes = {CREATED: datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
    bundle = Bundle.parse(signature)
    if bundle is not None and bundle.hint:
        notes[KEY_HINT] = bundle.hint[:16]
    document = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": SIGNATURE_ARTIFACT_TYPE,
        "config": {"mediaType": EMPTY_TYPE, "digest": empty, "size": len(EMPTY)},
        "layers": [{"mediaType": BUNDLE_MEDIA_TYPE, "digest": layer.digest, "size": layer.size,
                    "annotations": {TITLE: SIGNATURE}}],
        "subject": {"mediaType": OCI_MANIFEST, "digest": subject.digest, "size": subject.size},
        "annotations": notes,
    }
    return json.dumps(document, indent=1).encode()


def attach(registry: Registry, subject: Blob, signature: bytes) -> str:
    """Push `signature` as a referrer of the manifest `subject`; its manifest's digest."""
    empty = registry.put_bytes(EMPTY)
    layer = Blob(registry.put_bytes(signature), len(signature))
    document = signature_manifest(subject, layer, signature, empty)
    digest = "sha256:" + _sha256(document)
    if not registry.put_manifest(document, digest):
        _index(registry, subject.digest, _descriptor(document, digest))
    return digest


def _descriptor(document: bytes, digest: str) -> dict[str, Any]:
    """What a referrers list says of a manifest: its artifactType and annotations copied."""
    data = json.loads(document)
    return {"mediaType": OCI_MANIFEST, "digest": digest, "size": len(document),
            "artifactType": data["artifactType"], "annotations": data["annotations"]}


def _index(registry: Registry, subject: str, descriptor: dict[str, Any]) -> None:
    """Add a referrer to the `sha256-<hex>` index, as a client must where the registry does
    not index subjects. Not atomic: two pushers at once may lose one's entry (the spec
    leaves that race to clients); a re-push adds it again."""
    tag = referrers_tag(subject)
    found = registry.get_manifest(tag, accept=OCI_INDEX)
    listed = _listed(found[0]) if found is not None else []
    if listed is None:
        raise RemoteArtifactError(
            f"{registry.ref.store_url}:{tag} is not an image index of referrers",
            "delete that tag: it is where registries without the referrers API list "
            "what refers to a manifest",
        )
    if any(d.get("digest") == descriptor["digest"] for d in listed):
        return
    document = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [*listed, descriptor]}
    registry.put_manifest(json.dumps(document, indent=1).encode(), tag, OCI_INDEX)


def _listed(data: bytes) -> list[dict[str, Any]] | None:
    """The descriptors of a referrers list (an image index), None when it is not one."""
    try:
        document = json.loads(data)
    except ValueError:
        return None
    manifests = document.get("manifests") if isinstance(document, dict) else None
    if not isinstance(manifests, list):
        return None
    return [d for d in manifests if isinstance(d, dict)]


def signatures(registry: Registry, subject: Blob, where: str) -> list[bytes]:
    """The signatures that refer to the manifest `subject`, newest first, each checked to be
    a signature of that manifest and read within its bounds."""
    data = registry.referrers(subject.digest, SIGNATURE_ARTIFACT_TYPE)
    if data is None:  # no referrers API: the tag a pushing client keeps
        found = registry.get_manifest(referrers_tag(subject.digest), accept=OCI_INDEX)
        data = found[0] if found is not None else None
    listed = (_listed(data) if data is not None else None) or []  # not an index: none
    candidates = [d for d in listed if d.get("artifactType") == SIGNATURE_ARTIFACT_TYPE
                  and isinstance(d.get("digest"), str) and _DIGEST_RE.fullmatch(d["digest"])]
    found_signatures = []
    for descriptor in reversed(candidates[-MAX_SIGNATURES:]):
        manifest = registry.get_manifest(descriptor["digest"])  # its bytes hashed
        layer = _signature_layer(manifest[0], subject.digest) if manifest is not None else None
        if layer is None:  # gone, or not a signature of this manifest: a claim, not used
            continue
        if layer.size > MAX_SIGNATURE_BYTES:
            raise RemoteArtifactError(f"{where}: its {SIGNATURE} is over the size limit")
        found_signatures.append(registry.read_blob(layer.digest, layer.size, SIGNATURE))
    return found_signatures


def _signature_layer(data: bytes, subject: str) -> Blob | None:
    """The bundle layer of a signature manifest whose subject is `subject`; None for any
    other manifest."""
    try:
        document = json.loads(data)
        refers = document["subject"]["digest"]
        (layer,) = document["layers"]
        digest, size = layer["digest"], layer["size"]
        kind = document.get("artifactType"), layer.get("mediaType")
    except (ValueError, KeyError, TypeError):
        return None
    if refers != subject or kind != (SIGNATURE_ARTIFACT_TYPE, BUNDLE_MEDIA_TYPE):
        return None
    if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
        return None
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return None
    return Blob(digest, size)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
