"""How a neuronctl artifact is one OCI artifact (image-spec 1.1 manifest, `artifactType`):

- config: manifest.json, media type `application/vnd.neuronctl.manifest.v1+json`, byte for
  byte the bytes the signature covers;
- one layer per file (`application/vnd.neuronctl.file.v1`), titled with its relative path
  (`org.opencontainers.image.title`), its digest the sha256 the manifest records: a registry
  keeps one copy of a file shared by two artifacts, and a pull resumes layer by layer;
- no signature: that is a manifest of its own that refers to this one (oci_referrers.py);
- annotations: the artifact key, the backend, each backend version, the target vLLM
  generation when the manifest names one, and the creation time;
- tagged with the artifact's directory name (the first 20 hex digits of its key).

Everything read back is checked here before anyone uses it: media types, digests, sizes,
titles (a path the manifest's path rule refuses is refused, whatever the registry says).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from neuronctl.store.manifest import Manifest
from neuronctl.store.remote.errors import RemoteArtifactError
from neuronctl.store.remote.oci_ref import DIGEST
from neuronctl.store.remote.oci_registry import OCI_MANIFEST
from neuronctl.store.remote.transport import entry_problem

ARTIFACT_TYPE = "application/vnd.neuronctl.artifact.v1"
CONFIG_TYPE = "application/vnd.neuronctl.manifest.v1+json"
FILE_TYPE = "application/vnd.neuronctl.file.v1"
OLD_SIGNATURE_TYPE = "application/vnd.neuronctl.signature.v1"  # a layer, before referrers
TITLE = "org.opencontainers.image.title"
CREATED = "org.opencontainers.image.created"
ANNOTATION_PREFIX = "dev.neuronctl."
KEY_ANNOTATION = ANNOTATION_PREFIX + "artifact.key"
_DIGEST_RE = re.compile(DIGEST)


@dataclass(frozen=True)
class Blob:
    digest: str
    size: int


@dataclass
class OciArtifact:
    """A neuronctl artifact's OCI manifest as read from a registry, checked."""

    digest: str  # of the OCI manifest
    size: int  # of the OCI manifest: with the digest, the `subject` of its signature
    config: Blob
    files: dict[str, Blob] = field(default_factory=dict)  # by relative path
    old_signature: bool = False  # signed the way earlier releases pushed it (a layer)
    annotations: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.annotations.get(KEY_ANNOTATION, "")


def oci_annotations(manifest: Manifest) -> dict[str, str]:
    found = {
        KEY_ANNOTATION: manifest.artifact_key,
        ANNOTATION_PREFIX + "backend": manifest.backend,
        CREATED: manifest.created,
    }
    for name, version in sorted(manifest.backend_versions.items()):
        found[f"{ANNOTATION_PREFIX}version.{name}"] = str(version)
    generation = manifest.host.get("vllm_generation") or manifest.backend_versions.get(
        "vllm_generation"
    )
    if generation:
        found[ANNOTATION_PREFIX + "vllm.generation"] = str(generation)
    return found


def oci_manifest(manifest: Manifest, manifest_bytes: bytes, config_digest: str) -> bytes:
    """The OCI manifest of an artifact, as the exact bytes pushed (its digest is theirs)."""
    layers: list[dict[str, Any]] = [
        {
            "mediaType": FILE_TYPE,
            "digest": f"sha256:{entry.sha256}",
            "size": entry.size,
            "annotations": {TITLE: rel},
        }
        for rel, entry in sorted(manifest.files.items())
    ]
    document = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": ARTIFACT_TYPE,
        "config": {"mediaType": CONFIG_TYPE, "digest": config_digest,
                   "size": len(manifest_bytes)},
        "layers": layers,
        "annotations": oci_annotations(manifest),
    }
    return json.dumps(document, indent=1).encode()


def parse_oci_manifest(data: bytes, digest: str, where: str) -> OciArtifact:
    """A registry's manifest, refused unless it is a neuronctl artifact whose every layer
    has a digest, a size and a title that names a file inside the artifact."""
    try:
        document = json.loads(data)
    except ValueError:
        raise RemoteArtifactError(f"{where}: the registry's manifest is not JSON") from None
    config = document.get("config") if isinstance(document, dict) else None
    media = config.get("mediaType") if isinstance(config, dict) else None
    if media != CONFIG_TYPE:
        raise RemoteArtifactError(
            f"{where} is not a neuronctl artifact (config media type {media!r})",
            "push it with `neuronctl artifacts push`",
        )
    notes = document.get("annotations") or {}
    artifact = OciArtifact(
        digest=digest,
        size=len(data),
        config=_blob(config, where),
        annotations={str(k): str(v) for k, v in notes.items()} if isinstance(notes, dict) else {},
    )
    layers = document.get("layers")
    if not isinstance(layers, list):
        raise RemoteArtifactError(f"{where}: the manifest has no layer list")
    for layer in layers:
        _add_layer(artifact, layer, where)
    return artifact


def _add_layer(artifact: OciArtifact, layer: Any, where: str) -> None:
    if not isinstance(layer, dict):
        raise RemoteArtifactError(f"{where}: a layer is not an object")
    blob = _blob(layer, where)
    title = (layer.get("annotations") or {}).get(TITLE)
    if layer.get("mediaType") == OLD_SIGNATURE_TYPE:
        artifact.old_signature = True
        return
    if layer.get("mediaType") != FILE_TYPE:
        return  # another tool's layer: neuronctl never reads it
    if not isinstance(title, str):
        raise RemoteArtifactError(f"{where}: a file layer has no title")
    problem = entry_problem(title)
    if problem:
        raise RemoteArtifactError(f"{where}: layer {title!r}: {problem}")
    if title in artifact.files:
        raise RemoteArtifactError(f"{where}: two layers are titled {title!r}")
    artifact.files[title] = blob


def _blob(descriptor: Any, where: str) -> Blob:
    digest, size = descriptor.get("digest"), descriptor.get("size")
    if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
        raise RemoteArtifactError(f"{where}: a descriptor has digest {digest!r}, not sha256")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise RemoteArtifactError(f"{where}: a descriptor has size {size!r}")
    return Blob(digest, size)


def check_layers(artifact: OciArtifact, manifest: Manifest, where: str) -> None:
    """Every file of the signed manifest is a layer of exactly its sha256 and size."""
    for rel, entry in manifest.files.items():
        blob = artifact.files.get(rel)
        if blob is None:
            raise RemoteArtifactError(f"{where}: no layer for {rel}",
                                      "push the artifact again with --force")
        if blob != Blob(f"sha256:{entry.sha256}", entry.size):
            raise RemoteArtifactError(
                f"{where}: layer {rel} is {blob.digest[:19]}… ({blob.size} bytes), the signed "
                f"manifest says sha256:{entry.sha256[:12]}… ({entry.size} bytes)",
                "push the artifact again with --force",
            )
