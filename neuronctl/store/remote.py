"""Remote artifact stores over fsspec: a shared mount (file://), S3 (s3://), the Hub (hf://).

A remote store has the local layout: `<url>/neuron-compiled-artifacts/<dirname>/...`, and the
same completeness rule: an artifact is complete when its manifest.json exists, so push uploads
manifest.json last and pull trusts nothing the manifest does not vouch for.

How push knows a remote file's sha256 without downloading it:
  1. the remote manifest.json of an earlier push lists every file's size and sha256;
  2. on S3 every object neuronctl uploads carries its sha256 as user metadata
     (`x-amz-meta-sha256`), which lets an interrupted push (no manifest yet) resume;
  a file whose remote size and sha256 (from either source) match the local one is skipped.
  Neither source re-reads the remote bytes; `push --force` uploads everything again.
Pull re-hashes every downloaded byte before the artifact becomes visible.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import posixpath
import re
import stat
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from fsspec.callbacks import Callback
from pydantic import ValidationError

from neuronctl.errors import NeuronctlError, NotFoundError, UsageError
from neuronctl.keys import KEY_LENGTH
from neuronctl.progress import NullProgress, Progress
from neuronctl.store.local import ARTIFACTS_DIR, Published, Store
from neuronctl.store.manifest import (
    HASH_CHUNK,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    FileEntry,
    Manifest,
    is_intact,
    path_rule,
    read_capped,
    read_manifest,
    sha256_file,
)
from neuronctl.store.signing import (
    MAX_SIGNATURE_BYTES,
    PROVENANCE,
    SIGNATURE,
    Provenance,
    SignatureError,
    Signer,
    TrustPolicy,
    Vouch,
    check_origin,
    differs_from,
    read_provenance,
    sign,
    signed_by,
    verify,
)

SHA_METADATA = "sha256"  # S3 user metadata key holding an object's sha256
# Names an artifact's own files can never have: the store's bookkeeping lives there.
RESERVED_NAMES = frozenset({MANIFEST, MANIFEST + ".tmp", SIGNATURE, PROVENANCE})
DIRNAME_RE = re.compile(rf"[0-9a-f]{{{KEY_LENGTH}}}")
TRANSFER_THREADS = 4  # files moved at once; s3fs also splits large files into ranged parts


class RemoteArtifactError(NeuronctlError):
    """A remote artifact is incomplete, corrupted or not what its name says."""


class RemoteUnreachableError(NeuronctlError):
    """The remote store could not be reached: network, credentials, permissions."""


class LocalDiskError(NeuronctlError):
    """This host's disk refused a write (full, read-only, no permission): not the remote."""


LOCAL_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


def local_disk_error(exc: OSError, path: Path | str | None = None) -> LocalDiskError:
    where = path if path is not None else exc.filename
    return LocalDiskError(
        f"cannot write {where} on this host: {exc.strerror or exc}",
        "free space on that disk or make it writable, or use another store (--store, "
        "$NEURONCTL_STORE)",
    )


# Libraries whose exceptions mean "the remote said no or could not be reached".
_TRANSPORT_MODULES = frozenset(
    {
        "botocore",
        "aiobotocore",
        "aiohttp",
        "s3fs",
        "fsspec",
        "huggingface_hub",
        "httpx",
        "requests",
        "urllib3",
    }
)


def _unreachable(url: str, exc: Exception) -> RemoteUnreachableError | None:
    module = type(exc).__module__.split(".")[0]
    if not isinstance(exc, OSError) and module not in _TRANSPORT_MODULES:
        return None  # a bug: let it surface as one
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
        hint = (
            "set AWS credentials (AWS_PROFILE, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY); "
            "AWS_ENDPOINT_URL selects an S3-compatible server"
        )
    else:
        hint = "check the URL, the network and the credentials"
    return RemoteUnreachableError(f"remote store {url}: {reason}", hint)


def _remote_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """Turn transport failures (no credentials, DNS, refused, denied) into one-line errors."""

    @functools.wraps(method)
    def wrapper(self: RemoteStore, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except NeuronctlError:
            raise
        except Exception as exc:
            if isinstance(exc, OSError) and _is_local_disk(self, exc):
                raise local_disk_error(exc) from None
            mapped = _unreachable(self.url, exc)
            if mapped is None:
                raise
            raise mapped from None

    return wrapper


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


class _BytesCallback(Callback):
    """fsspec reports bytes per transfer; forward them to a progress advance, thread-safely
    enough for a progress bar (rich's advance takes its own lock)."""

    def __init__(self, advance: Callable[[float], None]) -> None:
        super().__init__()
        self.advance = advance
        self.reported = 0

    def call(self, *args: Any, **kwargs: Any) -> None:
        pass

    def relative_update(self, inc: int = 1) -> None:
        self.reported += inc
        self.advance(inc)

    def absolute_update(self, value: int) -> None:
        self.relative_update(value - self.reported)

    def finish(self, size: int) -> None:
        """Account for bytes a file system did not report (LocalFileSystem reports none)."""
        if size > self.reported:
            self.relative_update(size - self.reported)


def _is_local_disk(remote: RemoteStore, exc: OSError) -> bool:
    """A write refused by a disk of this host (the store, its staging), not by the remote: an
    absolute local path outside a shared-mount remote."""
    if exc.errno not in LOCAL_DISK_ERRNOS:
        return False
    name = str(exc.filename or "")
    if not name.startswith("/"):
        return False
    return not (remote.is_local and name.startswith(remote.artifacts.rstrip("/") + "/"))


def _fs_options(protocol: str) -> dict[str, Any]:
    # A fresh instance per store: s3fs caches instances and listings per process, which would
    # hide objects another process just pushed and keep stale credentials/endpoints.
    options: dict[str, Any] = {"skip_instance_cache": True}
    if protocol in ("s3", "s3a"):
        options["use_listings_cache"] = False
    if protocol in ("file", "local"):
        options["auto_mkdir"] = True
    return options


def open_remote(url: str) -> RemoteStore:
    """A remote store from a URL; a plain path means a shared mount (file://)."""
    import fsspec.core

    url = url.rstrip("/")
    if not url:
        raise UsageError("empty remote store URL", "e.g. s3://my-bucket/neuron")
    if "://" not in url:
        url = "file://" + os.path.abspath(os.path.expanduser(url))
    protocol = url.split("://", 1)[0]
    try:
        fs, root = fsspec.core.url_to_fs(url, **_fs_options(protocol))
    except ImportError as exc:
        raise UsageError(f"{protocol}:// needs an extra package: {exc}") from None
    except ValueError as exc:
        raise UsageError(f"cannot open remote store {url!r}: {exc}") from None
    except Exception as exc:  # some file systems connect at once (ftp://, sftp://)
        mapped = _unreachable(url, exc)
        if mapped is None:
            raise
        raise mapped from None
    return RemoteStore(fs, root.rstrip("/"), url)


class RemoteStore:
    def __init__(self, fs: Any, root: str, url: str) -> None:
        self.fs = fs
        self.url = url
        self.artifacts = posixpath.join(root, ARTIFACTS_DIR)
        self.is_local = "file" in _protocols(fs)
        self.is_s3 = "s3" in _protocols(fs)

    def path(self, dirname: str, rel: str = "") -> str:
        return (
            posixpath.join(self.artifacts, dirname, rel)
            if rel
            else posixpath.join(self.artifacts, dirname)
        )

    def artifact_url(self, dirname: str) -> str:
        return f"{self.url}/{ARTIFACTS_DIR}/{dirname}"

    # -- reading ------------------------------------------------------------------------------

    @_remote_errors
    def has(self, dirname: str) -> bool:
        """A remote artifact is complete when its manifest.json exists."""
        return bool(self.fs.exists(self.path(dirname, MANIFEST)))

    @_remote_errors
    def manifest(self, dirname: str) -> Manifest | None:
        data = self._read(dirname, MANIFEST)
        return None if data is None else self._parse(dirname, data)

    @_remote_errors
    def sizes(self, dirname: str) -> dict[str, int]:
        """Every remote file of an artifact with its size, by relative path."""
        base = self.path(dirname)
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        sizes = {}
        for name, info in found.items():
            rel = _relative(name, base)
            if rel and info.get("type", "file") == "file":
                sizes[rel] = int(info["size"])
        return sizes

    @_remote_errors
    def list_keys(self) -> list[str]:
        """Directory names of complete remote artifacts."""
        try:
            entries = self.fs.ls(self.artifacts, detail=False)
        except FileNotFoundError:
            return []
        names = sorted(posixpath.basename(e.rstrip("/")) for e in entries)
        return [n for n in names if not n.startswith(".") and self.has(n)]

    @_remote_errors
    def resolve(self, key_or_prefix: str) -> str:
        """A directory name from a full artifact key, a directory name or a unique prefix."""
        key = key_or_prefix.strip("/")
        if not key or "/" in key or key.startswith("."):
            raise UsageError(f"{key_or_prefix!r} is not an artifact key")
        if len(key) >= KEY_LENGTH:  # the rest of the key is compared with the signed manifest
            return key[:KEY_LENGTH]
        matches = [name for name in self.list_keys() if name.startswith(key)]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise NotFoundError(f"no artifact {key!r} in {self.url}")
        raise UsageError(f"{key!r} matches several remote artifacts: {', '.join(matches)}")

    # -- push ---------------------------------------------------------------------------------

    @_remote_errors
    def push(
        self,
        artifact: Path,
        progress: Progress | None = None,
        *,
        force: bool = False,
        signer: Signer | None = None,
    ) -> PushResult:
        """Upload a local artifact: every file, its signature, then manifest.json last.

        Reads only the files the manifest lists, inside `artifact`, and writes only under
        `<root>/neuron-compiled-artifacts/<key>/` (check_entries refuses anything else)."""
        source = PushSource.read(Path(artifact), signing=signer is not None)
        local = source.manifest
        dirname = local.artifact_key[:KEY_LENGTH]
        result = PushResult(self.artifact_url(dirname), dirname, local.artifact_key)
        signature = sign(source.manifest_bytes, signer) if signer else source.signature
        remote_bytes = self._read(dirname, MANIFEST)
        remote = self._parse(dirname, remote_bytes) if remote_bytes is not None else None
        if remote is not None and remote.artifact_key != local.artifact_key:
            raise RemoteArtifactError(
                f"{result.url} holds artifact {remote.artifact_key[:12]}, "
                f"not {local.artifact_key[:12]}",
                "remove the remote directory by hand; keys never collide by accident",
            )
        sizes = self.sizes(dirname)
        if not force and remote is not None and self._intact(dirname, remote, sizes):
            assert remote_bytes is not None
            return self._keep(dirname, source, remote_bytes, signature, signer, result)
        if remote is not None or SIGNATURE in sizes:
            # Repairing or replacing: make the remote incomplete (and unsigned) first.
            for name in (MANIFEST, SIGNATURE):
                if name == MANIFEST and remote is not None or name in sizes:
                    self.fs.rm_file(self.path(dirname, name))
        todo = self._files_to_upload(dirname, local, sizes, force, result)
        advance = (progress or NullProgress()).task(
            f"push {dirname}", total=sum(local.files[r].size for r in todo)
        )
        _run_all(lambda rel: self._upload_file(source.root, dirname, rel, local.files[rel],
                                               advance), todo)
        if signature is not None:
            self._put_bytes(dirname, SIGNATURE, signature)
        self._put_bytes(dirname, MANIFEST, source.manifest_bytes)
        result.uploaded = [*todo, *([SIGNATURE] if signature else []), MANIFEST]
        result.uploaded_bytes = sum(local.files[r].size for r in todo)
        result.signed_by = signer.key_id if signer else None
        return result

    def _keep(
        self,
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
        remote = self._parse(dirname, remote_bytes)
        result.skipped = [*remote.files, MANIFEST]
        result.skipped_bytes = remote.total_size()
        if signer is None:
            return result
        remote_signature = self._read(dirname, SIGNATURE)
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
        self._put_bytes(dirname, SIGNATURE, signature)
        result.uploaded = [SIGNATURE]
        result.signed_by = signer.key_id
        return result

    def _files_to_upload(
        self,
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
            return self._object_sha256(dirname, rel) != entry.sha256

        names = list(local.files)
        flags = _map_all(needed, names)
        for rel, upload in zip(names, flags, strict=True):
            if not upload:
                result.skipped.append(rel)
                result.skipped_bytes += local.files[rel].size
        return [rel for rel, upload in zip(names, flags, strict=True) if upload]

    def _intact(self, dirname: str, remote: Manifest, sizes: dict[str, int]) -> bool:
        """Every file of the remote manifest is there, at its size and with its sha256 as the
        objects themselves attest (a same-size rewrite is caught, not trusted)."""
        if any(sizes.get(rel) != entry.size for rel, entry in remote.files.items()):
            return False
        names = list(remote.files)
        shas = _map_all(lambda rel: self._object_sha256(dirname, rel), names)
        return all(sha == remote.files[rel].sha256 for rel, sha in zip(names, shas, strict=True))

    def _object_sha256(self, dirname: str, rel: str) -> str | None:
        """The sha256 of a remote object's bytes, from evidence about the object itself, never
        from a manifest's claim: S3 metadata neuronctl set when it uploaded those bytes (an
        object rewritten by another tool loses it), the Hub's LFS sha256, else a re-hash."""
        path = self.path(dirname, rel)
        try:
            if self.is_s3:
                sha = self.fs.metadata(path).get(SHA_METADATA)
                if sha:
                    return str(sha)
            elif not self.is_local:
                lfs = self.fs.info(path).get("lfs") or {}
                if lfs.get("sha256"):
                    return str(lfs["sha256"])
            return self._rehash(path)
        except FileNotFoundError:
            return None

    def _rehash(self, path: str) -> str:
        digest = hashlib.sha256()
        with self.fs.open(path, "rb") as f:
            while chunk := f.read(HASH_CHUNK):
                digest.update(chunk)
        return digest.hexdigest()

    def _upload_file(
        self,
        root: Path,
        dirname: str,
        rel: str,
        entry: FileEntry,
        advance: Callable[[float], None],
    ) -> None:
        source = root / rel
        target = self.path(dirname, rel)
        callback = _BytesCallback(advance)
        # Hash what is sent: a file damaged at its recorded size is never uploaded (the
        # manifest would vouch for it), and S3's sha256 metadata states the bytes' own hash.
        sha = sha256_file(source)
        if sha != entry.sha256:
            raise RemoteArtifactError(
                f"{source} is not the file its manifest records (sha256 {sha[:12]}…, recorded "
                f"{entry.sha256[:12]}…): refusing to push a damaged artifact",
                f"check it with `neuronctl validate --deep {root}`; recompile or pull it again",
            )
        kwargs: dict[str, Any] = {}
        if self.is_s3:
            kwargs["Metadata"] = {SHA_METADATA: sha}
        if self.is_local:
            # A shared mount has no atomic object PUT: copy beside, then rename into place.
            tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
            self.fs.put_file(str(source), tmp, callback=callback)
            os.replace(tmp, target)
        else:
            self.fs.put_file(str(source), target, callback=callback, **kwargs)
        callback.finish(entry.size)

    def _put_bytes(self, dirname: str, name: str, data: bytes) -> None:
        target = self.path(dirname, name)
        if self.is_local:
            tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
            self.fs.pipe_file(tmp, data)
            os.replace(tmp, target)
        else:
            self.fs.pipe_file(target, data)

    def _read(self, dirname: str, name: str) -> bytes | None:
        """A remote metadata file, read with a size cap before anything parses it (a sparse
        multi-GB manifest.sig must not fill memory); a FIFO on a shared mount is refused,
        never waited on."""
        cap = MAX_SIGNATURE_BYTES if name == SIGNATURE else MAX_MANIFEST_BYTES
        where = f"{self.artifact_url(dirname)}/{name}"
        try:
            if self.is_local:
                return read_capped(Path(self.path(dirname, name)), cap)
            with self.fs.open(self.path(dirname, name), "rb") as f:
                data = bytes(f.read(cap + 1))
        except FileNotFoundError:
            return None
        except NeuronctlError as exc:
            raise RemoteArtifactError(f"{where}: {exc.message}") from None
        if len(data) > cap:
            raise RemoteArtifactError(f"{where} is over the {cap}-byte limit")
        return data

    def _parse(self, dirname: str, data: bytes) -> Manifest:
        try:
            return Manifest.model_validate_json(data)
        except ValidationError as exc:
            raise RemoteArtifactError(
                f"{self.artifact_url(dirname)}/{MANIFEST} is not a neuronctl manifest: "
                f"{exc.errors()[0]['msg']}",
                "push the artifact again with `neuronctl artifacts push`",
            ) from None

    # -- pull ---------------------------------------------------------------------------------

    @_remote_errors
    def pull(
        self,
        dirname: str,
        store: Store,
        progress: Progress | None = None,
        policy: TrustPolicy | None = None,
        key: str = "",
    ) -> Published:
        """Download an artifact into `store`: signature checked against `policy` first, then
        every byte against the signed sha256 list, published atomically under its lock.

        `key` is the key as the user asked for it (a prefix of the artifact key, maybe all of
        it): the signed manifest's artifact key must start with every character of it.
        A local copy (pulled earlier, or built here) is a cache hit; its provenance is checked
        against `policy` just the same."""
        if not DIRNAME_RE.fullmatch(dirname):
            raise UsageError(f"{dirname!r} is not an artifact directory name")
        policy = policy if policy is not None else TrustPolicy.load()
        state: dict[str, Any] = {}

        def build(staging: Path) -> Manifest:
            manifest, provenance = self._checked_manifest(dirname, policy, key)
            state.update(staging=staging, remote_bytes=provenance.manifest_bytes)
            self._download(dirname, manifest, staging, progress or NullProgress())
            (staging / PROVENANCE).write_text(provenance.to_json())
            return manifest

        def on_step(step: str) -> None:
            # Store.publish re-records the staged files into manifest.json; that record must be
            # the remote one, or the manifest goes before the staging dir is kept as a failure.
            if step == "manifest-written":
                staging = state["staging"]
                problem = differs_from(read_manifest(staging), state["remote_bytes"])
                if problem:
                    (staging / MANIFEST).unlink()
                    raise RemoteArtifactError(f"{self.artifact_url(dirname)}: {problem}")

        if not is_intact(store.path(dirname)):
            # Refuse an untrusted remote before anything is staged; build checks it again
            # under the lock, on the bytes it then downloads against.
            self._checked_manifest(dirname, policy, key)
        published = store.publish(dirname, build, reuse=is_intact, on_step=on_step)
        if published.cache_hit:
            local = read_manifest(published.path)
            _check_key(local.artifact_key, key, str(published.path))
            check_origin(published.path, local, policy)
        return published

    @_remote_errors
    def check_trusted(
        self, dirname: str, policy: TrustPolicy | None = None, key: str = ""
    ) -> None:
        """Raise unless `policy` trusts the remote artifact; nothing is downloaded."""
        self._checked_manifest(dirname, policy if policy is not None else TrustPolicy.load(), key)

    def vouch(self, path: Path, policy: TrustPolicy | None = None) -> Vouch:
        """Who vouches for a pulled (or local) artifact under `policy`."""
        return check_origin(path, read_manifest(path), policy or TrustPolicy.load())

    def _checked_manifest(
        self, dirname: str, policy: TrustPolicy, key: str = ""
    ) -> tuple[Manifest, Provenance]:
        """The remote manifest, only after its signature and every path in it checked out."""
        url = self.artifact_url(dirname)
        raw = self._read(dirname, MANIFEST)
        if raw is None:
            if self.sizes(dirname):
                raise RemoteArtifactError(
                    f"{url} is incomplete: no {MANIFEST} (a push did not finish)",
                    "push it again with `neuronctl artifacts push`",
                )
            raise NotFoundError(f"no artifact {dirname} in {self.url}")
        signature = self._read(dirname, SIGNATURE)
        verify(raw, signature, policy, url)  # raises unless trusted (or allowed unsigned)
        manifest = self._parse(dirname, raw)  # the very bytes the signature covers
        if manifest.artifact_key[:KEY_LENGTH] != dirname:
            raise RemoteArtifactError(
                f"{url}/{MANIFEST} is for artifact {manifest.artifact_key[:KEY_LENGTH]}, "
                f"not {dirname}"
            )
        _check_key(manifest.artifact_key, key, f"{url}/{MANIFEST}")
        for rel in manifest.files:
            problem = entry_problem(rel)
            if problem:
                raise RemoteArtifactError(f"{url}/{MANIFEST} lists {rel!r}: {problem}")
        return manifest, Provenance(url, raw, signature)

    def _download(
        self, dirname: str, manifest: Manifest, staging: Path, progress: Progress
    ) -> None:
        """Fetch every listed file and check its sha256 before the manifest is written, so a
        failed pull never leaves a directory whose manifest vouches for bad bytes."""
        advance = progress.task(f"pull {dirname}", total=manifest.total_size())
        sizes = self.sizes(dirname)
        for rel, entry in manifest.files.items():
            if sizes.get(rel) != entry.size:
                found = "missing" if rel not in sizes else f"{sizes[rel]} bytes"
                raise RemoteArtifactError(
                    f"{self.artifact_url(dirname)}/{rel}: expected {entry.size} bytes, "
                    f"found {found}",
                    "the remote artifact is damaged; push it again with --force",
                )
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)

        def fetch(rel: str) -> None:
            got = self._fetch(dirname, rel, manifest.files[rel].size, staging / rel, advance)
            if got != manifest.files[rel].sha256:
                raise RemoteArtifactError(
                    f"{self.artifact_url(dirname)}/{rel} is corrupted: expected sha256 "
                    f"{manifest.files[rel].sha256[:12]}…, got {got[:12]}…",
                    "the remote artifact is damaged; push it again with --force",
                )

        _run_all(fetch, list(manifest.files))

    def _fetch(
        self, dirname: str, rel: str, size: int, dest: Path, advance: Callable[[float], None]
    ) -> str:
        """Copy one object, never more than its signed size (an object that grew after its
        size was checked is refused, not downloaded whole); returns the sha256 of the bytes
        written."""
        digest = hashlib.sha256()
        left = size
        with self._open_object(dirname, rel) as src:
            out = _on_this_host(lambda: open_output(dest), dest)
            try:
                while left > 0 and (chunk := src.read(min(HASH_CHUNK, left))):
                    digest.update(chunk)
                    _on_this_host(lambda: out.write(chunk), dest)
                    left -= len(chunk)
                    advance(len(chunk))
            finally:
                _on_this_host(out.close, dest)  # a full disk may say so only at the flush
            grew = bool(src.read(1))
        if left or grew:
            raise RemoteArtifactError(
                f"{self.artifact_url(dirname)}/{rel} changed size during the pull "
                f"(signed: {size} bytes)",
                "the remote artifact is being rewritten; pull again, or push it again with "
                "--force",
            )
        return digest.hexdigest()

    def _open_object(self, dirname: str, rel: str) -> Any:
        """A remote object for reading; on a shared mount only a regular file (a FIFO or a
        device there is refused at once, not waited on)."""
        path = self.path(dirname, rel)
        if not self.is_local:
            return self.fs.open(path, "rb")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise RemoteArtifactError(f"{self.artifact_url(dirname)}/{rel} is not a regular file")
        return os.fdopen(fd, "rb")


def _on_this_host(action: Callable[[], Any], dest: Path) -> Any:
    """A write to this host's disk: its failure is reported as local, never as the remote."""
    try:
        return action()
    except OSError as exc:
        raise local_disk_error(exc, dest) from None


def open_output(dest: Path) -> Any:
    """Where a pulled file is written (a seam: tests make it a full disk)."""
    return open(dest, "wb")


def resolve_artifacts_arg(
    value: str,
    store: Store,
    progress: Progress | None = None,
    policy: TrustPolicy | None = None,
) -> Path:
    """`--artifacts` value -> a local artifact directory; a remote URL is pulled first.

    Accepts `<store-url>/<KEY>` and `<store-url>/neuron-compiled-artifacts/<KEY>`.
    """
    if "://" not in value:
        return Path(value).expanduser()
    remote, dirname, key = _remote_artifact(value)
    return remote.pull(dirname, store, progress, policy, key).path


def check_remote_trust(value: str, policy: TrustPolicy | None = None) -> None:
    """Refuse a remote artifact `policy` does not trust, reading only its manifest and
    signature (what --dry-run does instead of pulling)."""
    remote, dirname, key = _remote_artifact(value)
    remote.check_trusted(dirname, policy, key)


def _remote_artifact(value: str) -> tuple[RemoteStore, str, str]:
    """The remote store an artifact URL names, the artifact's directory name in it, and the
    key as written in the URL (compared in full with the signed manifest)."""
    url, key = split_artifact_url(value)
    remote = open_remote(url)
    return remote, remote.resolve(key), key


def _check_key(artifact_key: str, wanted: str, where: str) -> None:
    """Every character of the requested key must match: not only the directory name."""
    if wanted and not artifact_key.startswith(wanted.lower()):
        raise RemoteArtifactError(
            f"{where} is for artifact {artifact_key}, not {wanted}",
            "check the key in the URL (`neuronctl artifacts list` shows full keys)",
        )


def split_artifact_url(value: str) -> tuple[str, str]:
    """`s3://b/p/KEY` -> (`s3://b/p`, `KEY`), dropping a trailing neuron-compiled-artifacts.

    A plain path (`/mnt/shared/KEY`) names a shared mount, as it does for push."""
    value = value.rstrip("/")
    if "://" not in value and value:
        value = "file://" + os.path.abspath(os.path.expanduser(value))
    scheme, _, rest = value.partition("://")
    parent, _, key = rest.rpartition("/")
    if not parent or not key:
        raise UsageError(
            f"{value!r} does not name a remote artifact", "use URL/KEY, e.g. s3://bucket/prefix/KEY"
        )
    if posixpath.basename(parent) == ARTIFACTS_DIR:
        parent = posixpath.dirname(parent)
    return f"{scheme}://{parent}", key


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _relative(name: str, base: str) -> str:
    name, base = name.rstrip("/"), base.rstrip("/")
    # Object stores return "bucket/key"; a file system may return a leading slash or not.
    if name.lstrip("/").startswith(base.lstrip("/") + "/"):
        return name.lstrip("/")[len(base.lstrip("/")) + 1 :]
    return ""


def entry_problem(rel: str) -> str | None:
    """Why a manifest entry cannot name a file of an artifact, or None when it can: the
    manifest's path rule, and none of the store's own file names."""
    if (problem := path_rule(rel)) is not None:
        return problem
    if rel in RESERVED_NAMES:
        return "a name the store reserves for itself"
    return None


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


def _map_all(work: Callable[[str], Any], items: list[str]) -> list[Any]:
    """`work` over items a few at a time (remote round trips), results in order."""
    if len(items) <= 1:
        return [work(item) for item in items]
    with ThreadPoolExecutor(max_workers=TRANSFER_THREADS) as pool:
        return list(pool.map(work, items))


def _run_all(work: Callable[[str], None], items: list[str]) -> None:
    """Run `work` over items a few at a time; the first failure is raised."""
    if len(items) <= 1:
        for item in items:
            work(item)
        return
    with ThreadPoolExecutor(max_workers=TRANSFER_THREADS) as pool:
        for future in [pool.submit(work, item) for item in items]:
            future.result()
