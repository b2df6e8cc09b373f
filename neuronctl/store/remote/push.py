"""Push: upload a local artifact, every file, its signature, then manifest.json last.

How push knows a remote file's sha256 without downloading it:
  1. the remote manifest.json of an earlier push lists every file's size and sha256;
  2. on S3 every object neuronctl uploads carries its sha256 as user metadata
     (`x-amz-meta-sha256`), which lets an interrupted push (no manifest yet) resume;
  a file whose remote size and sha256 (from either source) match the local one is skipped.
  Neither source re-reads the remote bytes; `push --force` uploads everything again.
"""

from __future__ import annotations

import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from neuronctl.keys import KEY_LENGTH
from neuronctl.progress import NullProgress, Progress
from neuronctl.store.manifest import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    FileEntry,
    Manifest,
    read_capped,
    read_manifest,
    sha256_file,
)
from neuronctl.store.remote.errors import RemoteArtifactError, remote_errors
from neuronctl.store.remote.pull import read_remote_signature
from neuronctl.store.remote.transport import (
    DIRNAME_RE,
    BytesCallback,
    Transport,
    entry_problem,
    map_all,
    run_all,
)
from neuronctl.store.signing import (
    SIGNATURE_NAMES,
    SignatureError,
    Signer,
    TrustPolicy,
    check_origin,
    differs_from,
    read_provenance,
    sign,
    signature_file,
    signed_by,
)


@dataclass
class PushResult:
    url: str  # the remote artifact directory
    dirname: str
    artifact_key: str
    uploaded: list[str] = field(default_factory=list)  # relative paths, manifest.json included
    skipped: list[str] = field(default_factory=list)
    uploaded_bytes: int = 0
    skipped_bytes: int = 0
    signed_by: str | None = None  # the key id of a signature the remote now carries

    @property
    def noop(self) -> bool:
        return not self.uploaded


@remote_errors
def push_artifact(
    remote: Transport,
    artifact: Path,
    progress: Progress | None = None,
    *,
    force: bool = False,
    signer: Signer | None = None,
) -> PushResult:
    """Upload a local artifact: every file, its signature, then manifest.json last.

    Reads only the files the manifest lists, inside `artifact`, and writes only under
    `<root>/neuron-compiled-artifacts/<key>/` (PushSource.check refuses anything else)."""
    source = PushSource.read(Path(artifact), signing=signer is not None)
    local = source.manifest
    dirname = local.artifact_key[:KEY_LENGTH]
    result = PushResult(remote.artifact_url(dirname), dirname, local.artifact_key)
    signature = sign(source.manifest_bytes, signer) if signer else source.signature
    remote_bytes = remote.read(dirname, MANIFEST)
    held = remote.parse_manifest(dirname, remote_bytes) if remote_bytes is not None else None
    if held is not None and held.artifact_key != local.artifact_key:
        raise RemoteArtifactError(
            f"{result.url} holds artifact {held.artifact_key[:12]}, "
            f"not {local.artifact_key[:12]}",
            "remove the remote directory by hand; keys never collide by accident",
        )
    sizes = remote.sizes(dirname)
    if not force and held is not None and _intact(remote, dirname, held, sizes):
        assert remote_bytes is not None
        return _keep(remote, dirname, source, remote_bytes, signature, signer, result)
    if held is not None or any(name in sizes for name in SIGNATURE_NAMES):
        # Repairing or replacing: make the remote incomplete (and unsigned) first.
        for name in (MANIFEST, *SIGNATURE_NAMES):
            if name == MANIFEST and held is not None or name in sizes:
                remote.remove(dirname, name)
    todo = _files_to_upload(remote, dirname, local, sizes, force, result)
    advance = (progress or NullProgress()).task(
        f"push {dirname}", total=sum(local.files[r].size for r in todo)
    )
    run_all(lambda rel: _upload_file(remote, source.root, dirname, rel, local.files[rel],
                                     advance), todo)
    if signature is not None:
        remote.put_bytes(dirname, signature_file(signature), signature)
    remote.put_bytes(dirname, MANIFEST, source.manifest_bytes)
    result.uploaded = [*todo, *([signature_file(signature)] if signature else []), MANIFEST]
    result.uploaded_bytes = sum(local.files[r].size for r in todo)
    result.signed_by = signer.key_id if signer else None
    return result


def _keep(
    remote: Transport,
    dirname: str,
    source: PushSource,
    remote_bytes: bytes,
    signature: bytes | None,
    signer: Signer | None,
    result: PushResult,
) -> PushResult:
    """The remote holds an intact artifact of this key. First push wins (compiles need not
    be bit-reproducible, and pullers must never see files of two builds mixed): it stays,
    and at most gains this pusher's signature when it is byte-for-byte this build."""
    held = remote.parse_manifest(dirname, remote_bytes)
    result.skipped = [*held.files, MANIFEST]
    result.skipped_bytes = held.total_size()
    if signer is None:
        return result
    remote_signature = read_remote_signature(remote, dirname)
    if signed_by(remote_bytes, remote_signature, signer.key.public_key()):
        result.signed_by = signer.key_id
        return result
    if remote_bytes != source.manifest_bytes:
        raise RemoteArtifactError(
            f"{result.url} holds another build of this key, not signed by key "
            f"{signer.key_id}; signing it would vouch for bytes this host did not build",
            "replace it with this build, signed: `neuronctl artifacts push --force`",
        )
    assert signature is not None
    remote.put_bytes(dirname, signature_file(signature), signature)
    result.uploaded = [signature_file(signature)]
    result.signed_by = signer.key_id
    return result


def _files_to_upload(
    remote: Transport,
    dirname: str,
    local: Manifest,
    sizes: dict[str, int],
    force: bool,
    result: PushResult,
) -> list[str]:
    def needed(rel: str) -> bool:
        entry = local.files[rel]
        if force or sizes.get(rel) != entry.size:
            return True
        return remote.object_sha256(dirname, rel) != entry.sha256

    names = list(local.files)
    flags = map_all(needed, names)
    for rel, upload in zip(names, flags, strict=True):
        if not upload:
            result.skipped.append(rel)
            result.skipped_bytes += local.files[rel].size
    return [rel for rel, upload in zip(names, flags, strict=True) if upload]


def _intact(remote: Transport, dirname: str, held: Manifest, sizes: dict[str, int]) -> bool:
    """Every file of the remote manifest is there, at its size and with its sha256 as the
    objects themselves attest (a same-size rewrite is caught, not trusted)."""
    if any(sizes.get(rel) != entry.size for rel, entry in held.files.items()):
        return False
    names = list(held.files)
    shas = map_all(lambda rel: remote.object_sha256(dirname, rel), names)
    return all(sha == held.files[rel].sha256 for rel, sha in zip(names, shas, strict=True))


def _upload_file(
    remote: Transport,
    root: Path,
    dirname: str,
    rel: str,
    entry: FileEntry,
    advance: Callable[[float], None],
) -> None:
    source = root / rel
    callback = BytesCallback(advance)
    # Hash what is sent: a file damaged at its recorded size is never uploaded (the
    # manifest would vouch for it), and S3's sha256 metadata states the bytes' own hash.
    sha = sha256_file(source)
    if sha != entry.sha256:
        raise RemoteArtifactError(
            f"{source} is not the file its manifest records (sha256 {sha[:12]}…, recorded "
            f"{entry.sha256[:12]}…): refusing to push a damaged artifact",
            f"check it with `neuronctl validate --deep {root}`; recompile or pull it again",
        )
    remote.put_file(source, dirname, rel, sha, callback)
    callback.finish(entry.size)


@dataclass
class PushSource:
    """What push uploads: the manifest bytes, their signature if any, the files they list.

    A pulled artifact is pushed as it was pulled: its remote manifest and signature (kept in
    provenance.json), its files without provenance.json, so a mirror keeps the publisher's
    signature."""

    root: Path
    manifest: Manifest
    manifest_bytes: bytes
    signature: bytes | None = None

    @classmethod
    def read(cls, root: Path, signing: bool = False) -> PushSource:
        local = read_manifest(root)
        origin = read_provenance(root)
        if signing:  # a signature vouches: only for what this host or a trusted key vouches for
            try:
                check_origin(root, local, TrustPolicy.load())
            except SignatureError as exc:
                raise SignatureError(
                    f"refusing to sign {root}: nothing vouches for it here ({exc.message})",
                    "sign artifacts where they are built",
                ) from None
        if origin is None:
            source = cls(root, local, read_capped(root / MANIFEST, MAX_MANIFEST_BYTES))
        else:
            problem = differs_from(local, origin.manifest_bytes)
            if problem:
                raise RemoteArtifactError(f"{root} changed since it was pulled: {problem}")
            remote = Manifest.model_validate_json(origin.manifest_bytes)
            source = cls(root, remote, origin.manifest_bytes, origin.signature)
        source.check()
        return source

    def check(self) -> None:
        """Never read outside the artifact, never publish a damaged one."""
        _check_dirname(self.manifest.artifact_key[:KEY_LENGTH], self.root)
        for rel, entry in self.manifest.files.items():
            problem = entry_problem(rel)
            if problem:
                raise RemoteArtifactError(
                    f"{self.root}/{MANIFEST} lists {rel!r}: {problem}",
                    "refusing to read or upload anything outside the artifact",
                )
            try:
                size = _regular_file_inside(self.root, rel).stat().st_size
            except FileNotFoundError:
                size = None
            if size != entry.size:
                raise RemoteArtifactError(
                    f"{self.root / rel}: expected {entry.size} bytes, found {size}",
                    f"check it with `neuronctl validate --deep {self.root}`",
                )


def _check_dirname(dirname: str, artifact: Path) -> None:
    if not DIRNAME_RE.fullmatch(dirname):
        raise RemoteArtifactError(f"{artifact}: the manifest's artifact key is malformed")


def _regular_file_inside(root: Path, rel: str) -> Path:
    """`root/rel`, only if no component is a symlink and it is a regular file."""
    path = root
    for part in PurePosixPath(rel).parts:
        path = path / part
        mode = path.lstat().st_mode
        if stat.S_ISLNK(mode):
            raise RemoteArtifactError(
                f"{path} is a symbolic link; an artifact holds only its own files",
                f"check it with `neuronctl validate --deep {root}`",
            )
    if not stat.S_ISREG(mode):
        raise RemoteArtifactError(f"{path} is not a regular file")
    return path
