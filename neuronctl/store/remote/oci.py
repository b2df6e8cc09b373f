"""OciStore: an OCI registry repository as a remote store (`oci://REGISTRY/REPO`), with the
same methods commands use on the others (has, resolve, push, pull, check_trusted) and the
same rules: push uploads every file, and the signature (a referrer of the artifact's
manifest: oci_referrers.py), before the one thing that makes the artifact complete (here the
tagged manifest); pull checks the signature before anything is staged and every byte against
the signed sha256s before the artifact is visible.

A pull keeps each layer it verified in `<store>/neuron-compiled-artifacts/.oci-blobs/`
until the artifact is published, and the part of a layer it had written: a pull killed
mid-layer and run again downloads neither (the rest of a part comes by HTTP Range, and the
whole layer is hashed before it is used).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import threading
import uuid
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

from neuronctl.errors import NotFoundError, UsageError
from neuronctl.keys import KEY_LENGTH
from neuronctl.progress import NullProgress, Progress
from neuronctl.store.local import Published, Store
from neuronctl.store.manifest import (
    HASH_CHUNK,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    Manifest,
    is_intact,
    read_manifest,
)
from neuronctl.store.manifest import sha256_file as file_sha256
from neuronctl.store.remote import oci_referrers
from neuronctl.store.remote.errors import (
    RemoteArtifactError,
    local_disk_error,
    on_this_host,
    remote_errors,
)
from neuronctl.store.remote.oci_layout import (
    Blob,
    OciArtifact,
    check_layers,
    oci_manifest,
    parse_oci_manifest,
)
from neuronctl.store.remote.oci_ref import parse_oci_url
from neuronctl.store.remote.oci_registry import Registry
from neuronctl.store.remote.push import PushResult, PushSource
from neuronctl.store.remote.transport import DIRNAME_RE, run_all
from neuronctl.store.signing import (
    PROVENANCE,
    SIGNATURE,
    Provenance,
    Signer,
    TrustPolicy,
    check_origin,
    differs_from,
    sign,
    signature_file,
    signed_by,
    verified_record,
    verify_any,
)

BLOB_CACHE = ".oci-blobs"
_HEX_PREFIX = re.compile(r"[0-9a-f]{1,64}")


class OciStore:
    """A registry repository holding neuronctl artifacts, one tag per artifact."""

    is_local = False  # for errors.remote_errors: no path of this host is the remote
    artifacts = ""

    def __init__(self, url: str) -> None:
        self.ref = parse_oci_url(url)
        self.url = self.ref.store_url
        self.registry = Registry(self.ref)
        self.pinned: dict[str, str] = {}  # dirname -> manifest digest that resolve() found
        self.downloaded_bytes = 0  # by the last pull: what came over the network
        self.reused_bytes = 0  # ... and what an earlier, interrupted pull had left
        self._lock = threading.Lock()

    def artifact_url(self, dirname: str) -> str:
        digest = self.pinned.get(dirname)
        return f"{self.url}@{digest}" if digest else f"{self.url}:{dirname}"

    # -- what the registry holds -------------------------------------------------------------

    def fetch(self, reference: str) -> OciArtifact | None:
        found = self.registry.get_manifest(reference)
        if found is None:
            return None
        data, digest = found
        return parse_oci_manifest(data, digest, f"{self.url}@{digest}")

    @remote_errors
    def has(self, dirname: str) -> bool:
        """Complete when the tag exists: a registry accepts a manifest only once every blob
        it names is there."""
        return self.fetch(dirname) is not None

    @remote_errors
    def resolve(self, reference: str) -> str:
        """The directory name of the artifact a tag (its key, a unique prefix of it, or any
        tag) or `@sha256:` digest names; later reads of it use that very manifest."""
        reference = reference.lstrip("@")
        artifact = self.fetch(reference)
        if artifact is None and _HEX_PREFIX.fullmatch(reference):
            artifact = self._by_key(reference)
        if artifact is None:
            raise NotFoundError(f"no artifact {reference!r} in {self.url}",
                                "tags are artifact keys; push with `neuronctl artifacts push`")
        dirname = artifact.key[:KEY_LENGTH]
        if not DIRNAME_RE.fullmatch(dirname):
            raise RemoteArtifactError(f"{self.url}@{artifact.digest} has no artifact key")
        self.pinned[dirname] = artifact.digest
        return dirname

    def _by_key(self, key: str) -> OciArtifact | None:
        """The artifact of a full key (tagged with its first 20 digits; the rest is checked
        against the signed manifest) or of a unique prefix, from the tag list."""
        if len(key) >= KEY_LENGTH:
            return self.fetch(key[:KEY_LENGTH])
        matches = [t for t in self.registry.tags() if t.startswith(key) and DIRNAME_RE.fullmatch(t)]
        if len(matches) > 1:
            raise UsageError(f"{key!r} matches several artifacts in {self.url}: "
                             f"{', '.join(matches)}")
        return self.fetch(matches[0]) if matches else None

    def _artifact(self, dirname: str) -> OciArtifact:
        artifact = self.fetch(self.pinned.get(dirname, dirname))
        if artifact is None:
            raise NotFoundError(f"no artifact {dirname} in {self.url}")
        return artifact

    def _config(self, artifact: OciArtifact, where: str) -> bytes:
        if artifact.config.size > MAX_MANIFEST_BYTES:
            raise RemoteArtifactError(f"{where}: its {MANIFEST} is over the size limit")
        return self.registry.read_blob(artifact.config.digest, artifact.config.size, MANIFEST)

    def _signatures(self, artifact: OciArtifact, where: str) -> list[bytes]:
        """The signatures that refer to the artifact's manifest, newest first."""
        found = oci_referrers.signatures(self.registry, Blob(artifact.digest, artifact.size),
                                         where)
        if not found and artifact.old_signature:
            raise RemoteArtifactError(
                f"{where} carries its signature inside its manifest, as earlier releases "
                "pushed it; a signature is a referrer of the manifest now",
                f"sign it again: `neuronctl artifacts push KEY {self.url} --sign-key KEY.key`",
            )
        return found

    # -- trust -------------------------------------------------------------------------------

    def checked(
        self, dirname: str, policy: TrustPolicy, key: str = ""
    ) -> tuple[OciArtifact, Manifest, Provenance]:
        """The artifact's manifest, only after its signature, its key and every layer
        checked out (the same order as pull.py's for the other remotes)."""
        artifact = self._artifact(dirname)
        where = self.artifact_url(dirname)
        raw = self._config(artifact, where)
        # raises unless a trusted key signed it (or unsigned is allowed)
        signature, vouch = verify_any(raw, self._signatures(artifact, where), policy, where)
        try:
            manifest = Manifest.model_validate_json(raw)
        except ValueError as exc:
            raise RemoteArtifactError(f"{where}: its {MANIFEST} is not a neuronctl manifest: "
                                      f"{str(exc).splitlines()[0]}") from None
        if manifest.artifact_key[:KEY_LENGTH] != dirname:
            raise RemoteArtifactError(
                f"{where} is for artifact {manifest.artifact_key[:KEY_LENGTH]}, not {dirname}")
        _check_key(manifest.artifact_key, key, where)
        check_layers(artifact, manifest, where)
        return artifact, manifest, verified_record(where, raw, signature, vouch, policy)

    @remote_errors
    def check_trusted(self, dirname: str, policy: TrustPolicy | None = None,
                      key: str = "") -> None:
        self.checked(dirname, policy if policy is not None else TrustPolicy.load(), key)

    # -- pull --------------------------------------------------------------------------------

    @remote_errors
    def pull(
        self,
        dirname: str,
        store: Store,
        progress: Progress | None = None,
        policy: TrustPolicy | None = None,
        key: str = "",
    ) -> Published:
        """Download an artifact into `store`, verified, published atomically."""
        if not DIRNAME_RE.fullmatch(dirname):
            raise UsageError(f"{dirname!r} is not an artifact directory name")
        policy = policy if policy is not None else TrustPolicy.load()
        self.downloaded_bytes = self.reused_bytes = 0
        state: dict[str, Any] = {}
        cache = store.artifacts / BLOB_CACHE

        def build(staging: Path) -> Manifest:
            artifact, manifest, provenance = self.checked(dirname, policy, key)
            state.update(staging=staging, raw=provenance.manifest_bytes, manifest=manifest)
            self._download(artifact, manifest, staging, cache, progress or NullProgress())
            (staging / PROVENANCE).write_text(provenance.to_json())
            return manifest

        def on_step(step: str) -> None:
            if step == "manifest-written":
                problem = differs_from(read_manifest(state["staging"]), state["raw"])
                if problem:
                    (state["staging"] / MANIFEST).unlink()
                    raise RemoteArtifactError(f"{self.artifact_url(dirname)}: {problem}")

        if not is_intact(store.path(dirname)):
            self.checked(dirname, policy, key)  # refuse an untrusted one before staging
        published = store.publish(dirname, build, reuse=is_intact, on_step=on_step)
        if published.cache_hit:
            local = read_manifest(published.path)
            _check_key(local.artifact_key, key, str(published.path))
            check_origin(published.path, local, policy)
        elif "manifest" in state:
            _forget(cache, state["manifest"])
        return published

    def _download(self, artifact: OciArtifact, manifest: Manifest, staging: Path, cache: Path,
                  progress: Progress) -> None:
        on_this_host(lambda: cache.mkdir(parents=True, exist_ok=True), cache)
        advance = progress.task(f"pull {manifest.artifact_key[:KEY_LENGTH]}",
                                total=manifest.total_size())

        def fetch(rel: str) -> None:
            entry = manifest.files[rel]
            dest = staging / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            for attempt in range(2):
                blob = self._verified_blob(Blob(f"sha256:{entry.sha256}", entry.size),
                                           cache, rel, advance)
                try:
                    _link_or_copy(blob, dest)
                    return
                except FileNotFoundError as exc:
                    # A pull of another artifact with this layer published and dropped
                    # the cached copy between the check and the link: fetch it again.
                    if attempt:
                        raise local_disk_error(exc, dest) from None
                except OSError as exc:
                    raise local_disk_error(exc, dest) from None

        run_all(fetch, list(manifest.files))

    def _verified_blob(self, blob: Blob, cache: Path, rel: str,
                       advance: Callable[[float], None]) -> Path:
        """The cached blob file, downloaded unless an earlier pull verified it; its bytes
        are hashed either way (what the cache holds is checked, not assumed). The part of
        a layer a killed pull had written is resumed (HTTP Range), and the whole layer
        hashed; a head that does not hash out is downloaded again from the start."""
        hexdigest = blob.digest.split(":", 1)[1]
        kept = cache / hexdigest
        if kept.is_file() and kept.stat().st_size == blob.size and \
                file_sha256(kept) == hexdigest:
            self._count(reused=blob.size)
            advance(blob.size)
            return kept
        partial = cache / f"{hexdigest}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        start = _adopt_partial(cache, hexdigest, partial, blob.size)
        try:
            got = self._download_blob(blob, partial, rel, advance, start)
            if got != hexdigest and start:  # the head a dead pull wrote was not this layer's
                self._count(reused=-start)
                got = self._download_blob(blob, partial, rel, advance, 0)
            if got != hexdigest:
                raise RemoteArtifactError(
                    f"{self.url}: layer {rel} is corrupted: expected {blob.digest[:19]}…, "
                    f"got sha256:{got[:12]}…",
                    "the registry's copy is damaged; push the artifact again with --force",
                )
            os.replace(partial, kept)
        finally:
            partial.unlink(missing_ok=True)
        return kept

    def _download_blob(self, blob: Blob, dest: Path, rel: str,
                       advance: Callable[[float], None], start: int = 0) -> str:
        """Write a layer's bytes from `start` on after the `start` bytes already in `dest`
        (re-read into the hash: they are verified with the rest); the sha256 of all."""
        digest = hashlib.sha256()
        if start:
            with open(dest, "rb") as head:
                while chunk := head.read(HASH_CHUNK):
                    digest.update(chunk)
            self._count(reused=start)
            advance(start)
        written = start
        out = on_this_host(lambda: open(dest, "ab" if start else "wb"), dest)
        try:
            chunks = blob_chunks(self.registry, blob, rel, start) if start < blob.size else []
            for chunk in chunks:
                digest.update(chunk)
                on_this_host(functools.partial(out.write, chunk), dest)
                written += len(chunk)
                self._count(downloaded=len(chunk))
                advance(len(chunk))
        finally:
            on_this_host(out.close, dest)
        if written != blob.size:
            raise RemoteArtifactError(
                f"{self.url}: layer {rel} ended after {written} of {blob.size} bytes",
                "pull again (verified layers are kept)",
            )
        return digest.hexdigest()

    def _count(self, downloaded: int = 0, reused: int = 0) -> None:
        with self._lock:
            self.downloaded_bytes += downloaded
            self.reused_bytes += reused

    # -- push --------------------------------------------------------------------------------

    @remote_errors
    def push(
        self,
        artifact: Path,
        progress: Progress | None = None,
        *,
        force: bool = False,
        signer: Signer | None = None,
    ) -> PushResult:
        """Upload an artifact: each file a layer (skipped when the registry has its digest,
        unless --force), manifest.json as the config, then the manifest under the
        key-derived tag (and the URL's tag, when it names one)."""
        if self.ref.digest:
            raise UsageError(f"cannot push to a digest ({self.ref})",
                             "push to oci://REGISTRY/REPO (or REPO:TAG to add a tag)")
        source = PushSource.read(Path(artifact), signing=signer is not None)
        local = source.manifest
        dirname = local.artifact_key[:KEY_LENGTH]
        result = PushResult(f"{self.url}:{dirname}", dirname, local.artifact_key)
        signature = sign(source.manifest_bytes, signer) if signer else source.signature
        if signature is not None and signature_file(signature) != SIGNATURE:
            raise RemoteArtifactError(
                f"{artifact} is signed in an earlier release's format (manifest.sig), which a "
                "registry does not carry",
                f"sign it again as you push it: `neuronctl artifacts push KEY {self.url} "
                "--sign-key KEY.key`",
            )
        held = self.fetch(dirname)
        if held is not None and held.key != local.artifact_key:
            raise RemoteArtifactError(
                f"{result.url} holds artifact {held.key[:12]}, not {local.artifact_key[:12]}",
                "delete that tag in the registry; keys never collide by accident",
            )
        if held is not None and not force:
            return self._keep(held, source, signature, signer, result)
        todo = self._blobs_to_upload(local, force, result)
        advance = (progress or NullProgress()).task(
            f"push {dirname}", total=sum(local.files[r].size for r in todo))

        def upload(rel: str) -> None:
            self._upload_file(source.root, rel, local, advance)

        run_all(upload, todo)
        self._put_manifest(source, signature, dirname)
        result.uploaded = [*todo, *([SIGNATURE] if signature else []), MANIFEST]
        result.uploaded_bytes = sum(local.files[r].size for r in todo)
        result.signed_by = signer.key_id if signer else None
        return result

    def _blobs_to_upload(self, local: Manifest, force: bool, result: PushResult) -> list[str]:
        todo = []
        for rel, entry in local.files.items():
            if force or not self.registry.has_blob(f"sha256:{entry.sha256}"):
                todo.append(rel)
            else:  # the registry dedups: another artifact (or push) sent these bytes
                result.skipped.append(rel)
                result.skipped_bytes += entry.size
        return todo

    def _upload_file(self, root: Path, rel: str, local: Manifest,
                     advance: Callable[[float], None]) -> None:
        entry = local.files[rel]
        sha = file_sha256(root / rel)
        if sha != entry.sha256:  # a registry checks the digest; say which file is damaged
            raise RemoteArtifactError(
                f"{root / rel} is not the file its manifest records (sha256 {sha[:12]}…): "
                "refusing to push a damaged artifact",
                f"check it with `neuronctl validate --deep {root}`",
            )
        self.registry.put_blob(root / rel, f"sha256:{sha}", entry.size)
        advance(entry.size)

    def _put_manifest(self, source: PushSource, signature: bytes | None, dirname: str) -> None:
        """The manifest by digest, its signature as a referrer, then the tags: a tag (what
        `has` and a pull look for) never names an artifact whose signature is not there yet."""
        config = self.registry.put_bytes(source.manifest_bytes)
        document = oci_manifest(source.manifest, source.manifest_bytes, config)
        subject = Blob("sha256:" + hashlib.sha256(document).hexdigest(), len(document))
        self.registry.put_manifest(document, subject.digest)
        if signature is not None:
            oci_referrers.attach(self.registry, subject, signature)
        self.registry.put_manifest(document, dirname)
        if self.ref.tag and self.ref.tag != dirname:
            self.registry.put_manifest(document, self.ref.tag)

    def _keep(self, held: OciArtifact, source: PushSource, signature: bytes | None,
              signer: Signer | None, result: PushResult) -> PushResult:
        """First push wins, as on the other remotes: the registry's build stays, and gains
        this pusher's signature only when it is byte-for-byte this build."""
        where = result.url
        remote_bytes = self._config(held, where)
        files = Manifest.model_validate_json(remote_bytes).files
        result.skipped = [*files, MANIFEST]
        result.skipped_bytes = sum(e.size for e in files.values())
        if self.ref.tag and self.ref.tag != result.dirname:
            found = self.registry.get_manifest(result.dirname)
            if found is not None:
                self.registry.put_manifest(found[0], self.ref.tag)
        if signer is None:
            return result
        public = signer.key.public_key()
        held_signatures = oci_referrers.signatures(self.registry, Blob(held.digest, held.size),
                                                   where)
        if any(signed_by(remote_bytes, sig, public) for sig in held_signatures):
            result.signed_by = signer.key_id
            return result
        if remote_bytes != source.manifest_bytes:
            raise RemoteArtifactError(
                f"{where} holds another build of this key, not signed by key "
                f"{signer.key_id}; signing it would vouch for bytes this host did not build",
                "replace it with this build, signed: `neuronctl artifacts push --force`",
            )
        assert signature is not None  # signed here
        oci_referrers.attach(self.registry, Blob(held.digest, held.size), signature)
        result.uploaded = [SIGNATURE]
        result.signed_by = signer.key_id
        return result


def blob_chunks(registry: Registry, blob: Blob, rel: str, start: int = 0) -> Generator[bytes]:
    """A layer's bytes from `start` on, never more than its descriptor's size (a seam: tests
    slow it down). A registry that ignores the Range sends it all: the head is skipped."""
    response = registry.open_blob(blob.digest, start)
    skip = start if response.status_code == 200 else 0
    for chunk in registry.read_capped(response, blob.size - start + skip, f"layer {rel}"):
        if skip:
            dropped = min(skip, len(chunk))
            chunk, skip = chunk[dropped:], skip - dropped
        if chunk:
            yield chunk


def _check_key(artifact_key: str, wanted: str, where: str) -> None:
    """A tag that is a key (or a prefix of one) must be that key: every character of it.
    Another tag (`latest`) or a digest names the content itself, not a key."""
    wanted = wanted.lower()
    if wanted and _HEX_PREFIX.fullmatch(wanted) and not artifact_key.startswith(wanted):
        raise RemoteArtifactError(
            f"{where} is for artifact {artifact_key}, not {wanted}",
            "check the key in the URL (`neuronctl artifacts list` shows full keys)",
        )


def _link_or_copy(source: Path, dest: Path) -> None:
    try:
        os.link(source, dest)
    except OSError:
        shutil.copyfile(source, dest)


def _forget(cache: Path, manifest: Manifest) -> None:
    """After a publish the verified blobs live on in the artifact: drop the cache's links."""
    for entry in manifest.files.values():
        (cache / entry.sha256).unlink(missing_ok=True)


def _adopt_partial(cache: Path, hexdigest: str, mine: Path, size: int) -> int:
    """Take over the longest part of this layer that a dead pull left (its pid is gone), as
    `mine`; the other leftovers go. Returns how many bytes it holds (0: none)."""
    left = []
    for path in cache.glob(f"{hexdigest}.partial-*"):
        pid = path.name.split("-")[1]
        if pid.isdigit() and not _alive(int(pid)):
            left.append((path.stat().st_size, path))
    left.sort(reverse=True)
    for n, path in left:
        if not mine.exists() and n <= size:
            os.replace(path, mine)
        else:
            path.unlink(missing_ok=True)
    return mine.stat().st_size if mine.exists() else 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

