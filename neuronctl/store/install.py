"""Install: one remote artifact into a directory on a node, verified, for any orchestrator.

`neuronctl install SOURCE_URI DEST_DIR` takes KServe's storage-initializer contract, so one
image serves as a KServe storage container, an init container, or a job that fills a volume.
DEST_DIR is the artifact itself afterwards (`serve DEST_DIR` loads it):

  DEST_DIR/<files>          every file the signed manifest lists, each sha256-checked
  DEST_DIR/model.sig        the signature, as the remote holds it (`model_signing verify` reads it)
  DEST_DIR/provenance.json  the record: URL, signed manifest, signature, the key that verified
  DEST_DIR/manifest.json    the signed bytes, written last: the artifact is installed from here
  DEST_DIR/.neuronctl-install/  only while in progress: partial downloads, named by the
                            sha256 of their path (two files of one content never share one)

Order, so that a run killed anywhere leaves nothing that looks installed and a rerun
downloads nothing it already verified: the signature is checked and this host's checks run
before any download; an earlier install of another artifact loses its manifest.json first;
each file is downloaded into .neuronctl-install/<name>.part (a rerun resumes it from where
it stopped, and starts it again when the whole does not hash out), hashed, and renamed into
place; a file already in place is kept when its sha256 is the signed one; then the
signature, the record and manifest.json go in by rename.

One sequence for every source (`_Source`): a Transport's objects (s3://, file://, hf://...,
resumed by seeking) or an OCI registry's layers (oci://, resumed by an HTTP Range request;
the signature a referrer of the artifact's manifest, OciStore.checked).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from neuronctl.checks import Check
from neuronctl.errors import NeuronctlError, UsageError
from neuronctl.store.manifest import HASH_CHUNK, MANIFEST, FileEntry, Manifest, sha256_file
from neuronctl.store.remote import oci
from neuronctl.store.remote.errors import RemoteArtifactError, on_this_host, remote_errors
from neuronctl.store.remote.oci import OciStore
from neuronctl.store.remote.oci_layout import Blob
from neuronctl.store.remote.oci_ref import SCHEME as OCI_SCHEME
from neuronctl.store.remote.pull import checked_manifest
from neuronctl.store.remote.transport import Transport, run_all
from neuronctl.store.remote.urls import remote_artifact
from neuronctl.store.signing import (
    PROVENANCE,
    SIGNATURE_NAMES,
    SIGNED,
    UNSIGNED,
    Provenance,
    TrustPolicy,
    public_key_from_pem,
    signature_file,
)

WORK_DIR = ".neuronctl-install"
PREVIOUS = "previous-files.json"  # what an earlier install of another artifact left
LOG_EVERY = 16 * 2**20  # a progress line per this many bytes of one file

Log = Callable[[str], None]
HostChecks = Callable[[Manifest], list[Check]]
Chunks = tuple[int, Iterator[bytes]]  # where the bytes start, and the bytes


class InstallError(NeuronctlError):
    """The artifact was not installed; the message names what to fix."""


@dataclass
class Installed:
    path: Path
    url: str
    artifact_key: str
    trusted: str  # signing.SIGNED or UNSIGNED
    key_id: str | None
    files: int = 0
    downloaded_bytes: int = 0
    kept_bytes: int = 0  # already in place (or partly downloaded) and verified

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "url": self.url,
            "artifact_key": self.artifact_key,
            "trusted": self.trusted,
            "key_id": self.key_id,
            "files": self.files,
            "downloaded_bytes": self.downloaded_bytes,
            "kept_bytes": self.kept_bytes,
        }


def install(
    source: str,
    dest: Path,
    policy: TrustPolicy,
    host_checks: HostChecks,
    log: Log,
) -> Installed:
    """Install the artifact at `source` (URL/KEY of any remote neuronctl reads, or an OCI
    registry's oci://REGISTRY/REPO:TAG or @sha256:DIGEST) into `dest`.

    `host_checks` judges this host from the manifest (validate's versions and capacity
    checks); any failure stops the install before a byte is downloaded."""
    _check_scheme(source)
    remote, dirname, key = remote_artifact(source)
    if isinstance(remote, OciStore):
        return _run(remote, _RegistrySource(remote, dirname, key), dest, policy, host_checks, log)
    return _run(remote, _TransportSource(remote, dirname, key), dest, policy, host_checks, log)


def _check_scheme(source: str) -> None:
    """An unknown scheme is a usage error that names the known ones, before any lookup."""
    scheme, found, _ = source.partition("://")
    if not found:
        return  # a plain path: a shared mount
    import fsspec

    if scheme.lower() != OCI_SCHEME and scheme.lower() not in fsspec.available_protocols():
        raise UsageError(
            f"unknown URI scheme {scheme}:// in {source!r}",
            "install reads s3://, gs://, hf://, file:// (or a plain path) and oci:// "
            "(an OCI registry), e.g. s3://my-bucket/neuron/KEY",
        )


class _Source(Protocol):
    """Where an install reads one artifact from: a Transport's objects, or a registry's
    layers. Both give the signed manifest only after its signature checked out, and each
    file's bytes from an offset on."""

    url: str

    def checked(self, policy: TrustPolicy) -> tuple[Manifest, Provenance]: ...

    def check_size(self, rel: str, entry: FileEntry) -> None: ...

    def chunks(
        self, rel: str, entry: FileEntry, start: int
    ) -> contextlib.AbstractContextManager[Chunks]: ...


class _TransportSource:
    def __init__(self, remote: Transport, dirname: str, key: str) -> None:
        self.remote, self.dirname, self.key = remote, dirname, key
        self.url = remote.artifact_url(dirname)
        self.sizes: dict[str, int] | None = None

    def checked(self, policy: TrustPolicy) -> tuple[Manifest, Provenance]:
        return checked_manifest(self.remote, self.dirname, policy, self.key)

    def check_size(self, rel: str, entry: FileEntry) -> None:
        if self.sizes is None:
            self.sizes = self.remote.sizes(self.dirname)
        if self.sizes.get(rel) != entry.size:
            found = "missing" if rel not in self.sizes else f"{self.sizes[rel]} bytes"
            raise RemoteArtifactError(
                f"{self.url}/{rel}: expected {entry.size} bytes, found {found}",
                "the remote artifact is damaged; push it again with --force",
            )

    @contextlib.contextmanager
    def chunks(self, rel: str, entry: FileEntry, start: int) -> Iterator[Chunks]:
        """The object from `start` on, or from 0 when it cannot seek."""
        with self.remote.open_object(self.dirname, rel) as src:
            if start:
                try:
                    src.seek(start)
                except (OSError, ValueError, AttributeError):
                    start = 0
            yield start, _read(src, entry.size - start)


def _read(src: Any, left: int) -> Iterator[bytes]:
    while left > 0 and (chunk := src.read(min(HASH_CHUNK, left))):
        left -= len(chunk)
        yield chunk


class _RegistrySource:
    """An OCI registry: the signature a referrer of the manifest, each file a layer whose
    descriptor the signed manifest was checked against (OciStore.checked)."""

    def __init__(self, store: OciStore, dirname: str, key: str) -> None:
        self.store, self.dirname, self.key = store, dirname, key
        self.url = store.artifact_url(dirname)

    def checked(self, policy: TrustPolicy) -> tuple[Manifest, Provenance]:
        _artifact, manifest, record = self.store.checked(self.dirname, policy, self.key)
        return manifest, record

    def check_size(self, rel: str, entry: FileEntry) -> None:
        """Nothing to ask: every layer's descriptor is the signed sha256 and size."""

    @contextlib.contextmanager
    def chunks(self, rel: str, entry: FileEntry, start: int) -> Iterator[Chunks]:
        """The layer from `start` on: an HTTP Range request; a registry that ignores it
        sends the whole layer, whose head is skipped."""
        if start >= entry.size:
            yield start, iter(())
            return
        blob = Blob(f"sha256:{entry.sha256}", entry.size)
        chunks = oci.blob_chunks(self.store.registry, blob, rel, start)
        try:
            yield start, chunks
        finally:
            chunks.close()


@remote_errors  # the remote's failures (credentials, network) as one-line errors
def _run(
    remote: Any,
    source: _Source,
    dest: Path,
    policy: TrustPolicy,
    host_checks: HostChecks,
    log: Log,
) -> Installed:
    return _install(source, dest, policy, host_checks, log)


def _install(
    source: _Source,
    dest: Path,
    policy: TrustPolicy,
    host_checks: HostChecks,
    log: Log,
) -> Installed:
    manifest, record = source.checked(policy)
    url = source.url
    key_id = _key_id(record)
    log(f"verified {url}: " + (f"signed by trusted key {key_id}" if key_id else
                               "NOT signed, accepted with --allow-unsigned"))  # fmt: skip
    failed = [c for c in host_checks(manifest) if not c.ok]
    if failed:
        raise InstallError(
            f"{url} would not load on this host: "
            + "; ".join(f"{c.name}: {c.reason}" for c in failed),
            "install it on a host that matches, or compile it for this one",
        )
    log(f"this host can load it ({manifest.backend}, tp {manifest.spec.tp_degree})")
    trusted = UNSIGNED if key_id is None else SIGNED
    result = Installed(dest, url, manifest.artifact_key, trusted, key_id, len(manifest.files))
    with _locked(_prepare(dest)) as work:
        if _installed_bytes(dest) != record.manifest_bytes:
            _unmark(dest, work)
        fetch = _Fetcher(source, dest, work, log, result)
        run_all(lambda rel: fetch.ensure(rel, manifest.files[rel]), sorted(manifest.files))
        _remove_previous(dest, work, manifest)
        _mark(dest, record)
    shutil.rmtree(dest / WORK_DIR, ignore_errors=True)
    return result


def _key_id(record: Provenance) -> str | None:
    if record.key_pem is None:
        return None
    return public_key_from_pem(record.key_pem.encode(), "the verifying key").key_id


def _prepare(dest: Path) -> Path:
    """DEST_DIR exists, writable by no one else (a load trusts the record only then), and
    holds nothing but a neuronctl install, finished or not; returns the work directory."""
    dest = on_this_host(lambda: _made(dest), dest)
    entries = {p.name for p in dest.iterdir()}
    if entries and not entries & {WORK_DIR, PROVENANCE}:
        raise UsageError(
            f"{dest} is not empty and holds no neuronctl install",
            "install into an empty directory (KServe's /mnt/models is one)",
        )
    work = dest / WORK_DIR
    work.mkdir(mode=0o700, exist_ok=True)
    return work


def _made(dest: Path) -> Path:
    """DEST_DIR, made or taken; the directories it makes 0755 whatever the umask (a load
    refuses an artifact whose directory, or either above it, others can write)."""
    for path in reversed([p for p in (dest, *dest.parents) if not p.exists()]):
        path.mkdir(exist_ok=True)
        os.chmod(path, 0o755)
    info = dest.stat()
    if info.st_mode & 0o022:
        try:  # an emptyDir volume is mode 0777: the record would not be trusted there
            os.chmod(dest, stat.S_IMODE(info.st_mode) & ~0o022)
        except PermissionError:
            raise InstallError(
                f"{dest} is writable by other users and this user cannot change that",
                "run the install as the directory's owner (or root), or mount it 0755",
            ) from None
    return dest


@contextlib.contextmanager
def _locked(work: Path) -> Iterator[Path]:
    """One install into a directory at a time (a second waits, then finds it done)."""
    fd = os.open(work / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield work
    finally:
        os.close(fd)


def withdraw(dest: Path) -> None:
    """Make an install stop looking installed (a check after it failed); its verified files
    stay for the next run to keep."""
    (dest / MANIFEST).unlink(missing_ok=True)


def _installed_bytes(dest: Path) -> bytes | None:
    try:
        return (dest / MANIFEST).read_bytes()
    except FileNotFoundError:
        return None


def _unmark(dest: Path, work: Path) -> None:
    """Make an earlier install stop looking installed before anything changes; remember its
    files, so that those the new artifact does not list go at the end."""
    old = dest / MANIFEST
    if old.exists():
        try:
            files = list(Manifest.model_validate_json(old.read_bytes()).files)
        except ValueError:
            files = []
        _write(work / PREVIOUS, json.dumps(files).encode())
        old.unlink()
    for name in (PROVENANCE, *SIGNATURE_NAMES):
        (dest / name).unlink(missing_ok=True)


def _remove_previous(dest: Path, work: Path, manifest: Manifest) -> None:
    try:
        previous = json.loads((work / PREVIOUS).read_bytes())
    except FileNotFoundError:
        return
    for rel in set(previous) - set(manifest.files):
        path = dest / rel
        if ".." not in Path(rel).parts and (path.is_file() or path.is_symlink()):
            path.unlink()
    (work / PREVIOUS).unlink()


def _mark(dest: Path, record: Provenance) -> None:
    """The signature, the record, then manifest.json: installed from the last rename on."""
    if record.signature is not None:
        _write(dest / signature_file(record.signature), record.signature)
    _write(dest / PROVENANCE, record.to_json().encode())
    _write(dest / MANIFEST, record.manifest_bytes)


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _Fetcher:
    """Puts one verified file in place: kept if it is there already, else downloaded (a
    partial download resumed) and hashed."""

    def __init__(self, source: _Source, dest: Path, work: Path, log: Log,
                 result: Installed) -> None:
        self.source = source
        self.dest = dest
        self.work = work
        self.log = log
        self.result = result
        self.lock = threading.Lock()

    def count(self, downloaded: int = 0, kept: int = 0) -> None:
        with self.lock:
            self.result.downloaded_bytes += downloaded
            self.result.kept_bytes += kept

    def ensure(self, rel: str, entry: FileEntry) -> None:
        target = self.dest / rel
        if _same_file(target, entry):
            self.log(f"kept {rel} ({_mib(entry.size)}, sha256 verified)")
            self.count(kept=entry.size)
            return
        self.source.check_size(rel, entry)
        part = self.work / (hashlib.sha256(rel.encode()).hexdigest()[:24] + ".part")
        have = part.stat().st_size if part.exists() else 0
        start = have if have <= entry.size else 0
        got = self._download(rel, entry, part, start)
        if got != entry.sha256 and start:  # the head a killed run left was not this file's
            self.count(kept=-start)
            got = self._download(rel, entry, part, 0)
        if got != entry.sha256:
            part.unlink(missing_ok=True)
            raise RemoteArtifactError(
                f"{self.source.url}/{rel} is corrupted: expected sha256 "
                f"{entry.sha256[:12]}…, got {got[:12]}…",
                "the remote artifact is damaged; push it again with --force",
            )
        _place(part, target, self.dest)
        self.log(f"verified {rel} ({_mib(entry.size)})")

    def _download(self, rel: str, entry: FileEntry, part: Path, have: int) -> str:
        """Fetch into `part` up to the file's size, going on after the `have` bytes an
        earlier run left when the source can; the sha256 of the whole file."""
        digest = hashlib.sha256()
        size = entry.size
        with self.source.chunks(rel, entry, have) as (start, chunks):
            if start:
                _hash_head(part, start, digest)
                self.log(f"resuming {rel} at {_mib(start)} of {_mib(size)}")
                self.count(kept=start)
            else:
                part.write_bytes(b"")
                self.log(f"downloading {rel} ({_mib(size)})")
            done = self._copy(chunks, part, start, size, digest, rel)
        if done != size:
            raise RemoteArtifactError(
                f"{self.source.url}/{rel} ended at {done} bytes (signed: {size})",
                "the remote artifact is being rewritten; install again",
            )
        return digest.hexdigest()

    def _copy(self, chunks: Iterator[bytes], part: Path, done: int, size: int, digest: Any,
              rel: str) -> int:
        logged = done
        with open(part, "ab") as out:
            for chunk in chunks:
                digest.update(chunk)
                on_this_host(functools.partial(out.write, chunk), part)
                done += len(chunk)
                self.count(downloaded=len(chunk))
                if done - logged >= LOG_EVERY:
                    out.flush()
                    self.log(f"downloading {rel}: {_mib(done)} of {_mib(size)}")
                    logged = done
        return done


def _hash_head(part: Path, have: int, digest: Any) -> None:
    """Hash the `have` bytes a killed run left in `part`: verified with the rest."""
    with open(part, "rb") as f:
        left = have
        while left and (chunk := f.read(min(HASH_CHUNK, left))):
            digest.update(chunk)
            left -= len(chunk)


def _same_file(path: Path, entry: FileEntry) -> bool:
    try:
        info = path.lstat()
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(info.st_mode) or info.st_size != entry.size:
        return False
    return sha256_file(path) == entry.sha256


def _place(part: Path, target: Path, dest: Path) -> None:
    """Rename a verified download into place; no directory on the way may be a symlink."""
    here = dest
    for name in Path(target.relative_to(dest)).parts[:-1]:
        here = here / name
        if here.is_symlink():
            here.unlink()
        here.mkdir(mode=0o755, exist_ok=True)
    if target.is_symlink() or target.is_dir():
        shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink()
    os.chmod(part, 0o644)
    os.replace(part, target)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
