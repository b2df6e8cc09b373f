"""A remote store's files over fsspec: its layout and the names an artifact's files may have,
reads capped before anything parses them, writes that land whole, the sha256 a remote object
attests of itself, and a few transfers at once.

Nothing here decides what to upload or whether to trust what was read: push.py and pull.py do.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
import stat
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fsspec.callbacks import Callback
from pydantic import ValidationError

from neuronctl.errors import NeuronctlError, NotFoundError, UsageError
from neuronctl.keys import KEY_LENGTH
from neuronctl.store.local import ARTIFACTS_DIR
from neuronctl.store.manifest import (
    HASH_CHUNK,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    Manifest,
    path_rule,
    read_capped,
)
from neuronctl.store.remote import nofollow
from neuronctl.store.remote.errors import RemoteArtifactError, remote_errors, unreachable
from neuronctl.store.signing import MAX_SIGNATURE_BYTES, PROVENANCE, SIGNATURE_NAMES

SHA_METADATA = "sha256"  # S3 user metadata key holding an object's sha256
# Names an artifact's own files can never have: the store's bookkeeping lives there.
RESERVED_NAMES = frozenset({MANIFEST, MANIFEST + ".tmp", *SIGNATURE_NAMES, PROVENANCE})
DIRNAME_RE = re.compile(rf"[0-9a-f]{{{KEY_LENGTH}}}")
TRANSFER_THREADS = 4  # files moved at once; s3fs also splits large files into ranged parts


def entry_problem(rel: str) -> str | None:
    """Why a manifest entry cannot name a file of an artifact, or None when it can: the
    manifest's path rule, and none of the store's own file names."""
    if (problem := path_rule(rel)) is not None:
        return problem
    if rel in RESERVED_NAMES:
        return "a name the store reserves for itself"
    return None


def _fs_options(protocol: str) -> dict[str, Any]:
    # A fresh instance per store: s3fs caches instances and listings per process, which would
    # hide objects another process just pushed and keep stale credentials/endpoints.
    options: dict[str, Any] = {"skip_instance_cache": True}
    if protocol in ("s3", "s3a"):
        options["use_listings_cache"] = False
    if protocol in ("file", "local"):
        options["auto_mkdir"] = True
    return options


def open_fs(url: str) -> tuple[Any, str, str]:
    """The file system, root path and normalized URL of a remote store; a plain path means a
    shared mount (file://)."""
    import fsspec.core

    url = url.rstrip("/")
    if not url:
        raise UsageError("empty remote store URL", "e.g. s3://my-bucket/neuron")
    if "://" not in url:
        url = "file://" + os.path.abspath(os.path.expanduser(url))
    protocol = url.split("://", 1)[0]
    if protocol.lower() == "oci":  # a registry (oci.py); fsspec would take it for Oracle's
        raise UsageError(f"{url!r} is an OCI registry, not a file system")
    try:
        fs, root = fsspec.core.url_to_fs(url, **_fs_options(protocol))
    except ImportError as exc:
        raise UsageError(f"{protocol}:// needs an extra package: {exc}") from None
    except ValueError as exc:
        raise UsageError(f"cannot open remote store {url!r}: {exc}") from None
    except Exception as exc:  # some file systems connect at once (ftp://, sftp://)
        mapped = unreachable(url, exc)
        if mapped is None:
            raise
        raise mapped from None
    return fs, root.rstrip("/"), url


class Transport:
    """The files of one remote store: `<root>/neuron-compiled-artifacts/<dirname>/<rel>`."""

    def __init__(self, fs: Any, root: str, url: str) -> None:
        self.fs = fs
        self.url = url
        self.root = root
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

    # -- what the remote holds -----------------------------------------------------------------

    @remote_errors
    def has(self, dirname: str) -> bool:
        """A remote artifact is complete when its manifest.json exists."""
        return bool(self.fs.exists(self.path(dirname, MANIFEST)))

    @remote_errors
    def manifest(self, dirname: str) -> Manifest | None:
        data = self.read(dirname, MANIFEST)
        return None if data is None else self.parse_manifest(dirname, data)

    @remote_errors
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

    @remote_errors
    def list_keys(self) -> list[str]:
        """Directory names of complete remote artifacts."""
        try:
            entries = self.fs.ls(self.artifacts, detail=False)
        except FileNotFoundError:
            return []
        names = sorted(posixpath.basename(e.rstrip("/")) for e in entries)
        return [n for n in names if not n.startswith(".") and self.has(n)]

    @remote_errors
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

    # -- reading -------------------------------------------------------------------------------

    def read(self, dirname: str, name: str) -> bytes | None:
        """A remote manifest.json or signature, read with a size cap before anything parses
        it (a sparse multi-GB manifest.sig must not fill memory); a FIFO on a shared mount is
        refused, never waited on."""
        cap = MAX_SIGNATURE_BYTES if name in SIGNATURE_NAMES else MAX_MANIFEST_BYTES
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

    def parse_manifest(self, dirname: str, data: bytes) -> Manifest:
        try:
            return Manifest.model_validate_json(data)
        except ValidationError as exc:
            raise RemoteArtifactError(
                f"{self.artifact_url(dirname)}/{MANIFEST} is not a neuronctl manifest: "
                f"{exc.errors()[0]['msg']}",
                "push the artifact again with `neuronctl artifacts push`",
            ) from None

    def open_object(self, dirname: str, rel: str) -> Any:
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

    def object_sha256(self, dirname: str, rel: str) -> str | None:
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

    # -- writing -------------------------------------------------------------------------------

    def put_file(
        self, source: Path, dirname: str, rel: str, sha256: str, callback: Callback
    ) -> None:
        """Upload one file whose bytes hash to `sha256` (on S3 the object carries it)."""
        target = self.path(dirname, rel)
        kwargs: dict[str, Any] = {}
        if self.is_s3:
            kwargs["Metadata"] = {SHA_METADATA: sha256}
        if self.is_local:
            # A shared mount has no atomic object PUT: copy beside, then rename into place,
            # following no link planted on the way (nofollow.py).
            nofollow.put_file(source, self.root, self._below_root(dirname, rel))
        else:
            self.fs.put_file(str(source), target, callback=callback, **kwargs)

    def put_bytes(self, dirname: str, name: str, data: bytes) -> None:
        target = self.path(dirname, name)
        if self.is_local:
            nofollow.put_bytes(data, self.root, self._below_root(dirname, name))
        else:
            self.fs.pipe_file(target, data)

    def remove(self, dirname: str, rel: str) -> None:
        """Remove one file of a remote artifact (on a shared mount, never through a link)."""
        if self.is_local:
            nofollow.remove(self.root, self._below_root(dirname, rel))
        else:
            self.fs.rm_file(self.path(dirname, rel))

    def _below_root(self, dirname: str, rel: str) -> str:
        return posixpath.join(ARTIFACTS_DIR, dirname, rel)


class BytesCallback(Callback):
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


def map_all(work: Callable[[str], Any], items: list[str]) -> list[Any]:
    """`work` over items a few at a time (remote round trips), results in order."""
    if len(items) <= 1:
        return [work(item) for item in items]
    with ThreadPoolExecutor(max_workers=TRANSFER_THREADS) as pool:
        return list(pool.map(work, items))


def run_all(work: Callable[[str], None], items: list[str]) -> None:
    """Run `work` over items a few at a time; the first failure is raised."""
    if len(items) <= 1:
        for item in items:
            work(item)
        return
    with ThreadPoolExecutor(max_workers=TRANSFER_THREADS) as pool:
        for future in [pool.submit(work, item) for item in items]:
            future.result()


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _relative(name: str, base: str) -> str:
    name, base = name.rstrip("/"), base.rstrip("/")
    # Object stores return "bucket/key"; a file system may return a leading slash or not.
    if name.lstrip("/").startswith(base.lstrip("/") + "/"):
        return name.lstrip("/")[len(base.lstrip("/")) + 1 :]
    return ""
