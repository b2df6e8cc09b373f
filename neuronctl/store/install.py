"""Install: one remote artifact into a directory on a node, verified, for any orchestrator.

`neuronctl install SOURCE_URI DEST_DIR` takes KServe's storage-initializer contract, so one
image serves as a KServe storage container, an init container, or a job that fills a volume.
DEST_DIR is the artifact itself afterwards (`serve DEST_DIR` loads it):

  DEST_DIR/<files>          every file the signed manifest lists, each sha256-checked
  DEST_DIR/model.sig        the signature, as the remote holds it (`model_signing verify` reads it)
  DEST_DIR/provenance.json  the record: URL, signed manifest, signature, the key that verified
  DEST_DIR/manifest.json    the signed bytes, written last: the artifact is installed from here
  DEST_DIR/.neuronctl-install/  only while in progress: partial downloads, by sha256

Order, so that a run killed anywhere leaves nothing that looks installed and a rerun
downloads nothing it already verified: the signature is checked and this host's checks run
before any download; an earlier install of another artifact loses its manifest.json first;
each file is downloaded into .neuronctl-install/<sha256>.part (a rerun resumes it from where
it stopped), hashed, and renamed into place; a file already in place is kept when its sha256
is the signed one; then the signature, the record and manifest.json go in by rename.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuronctl.checks import Check
from neuronctl.errors import NeuronctlError, UsageError
from neuronctl.store.manifest import HASH_CHUNK, MANIFEST, FileEntry, Manifest, sha256_file
from neuronctl.store.remote.errors import RemoteArtifactError, on_this_host, remote_errors
from neuronctl.store.remote.oci_ref import is_oci
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
    """Install the artifact at `source` (URL/KEY of any remote neuronctl reads) into `dest`.

    `host_checks` judges this host from the manifest (validate's versions and capacity
    checks); any failure stops the install before a byte is downloaded."""
    if is_oci(source):  # a registry holds layers, not objects by path (Transport)
        raise UsageError(
            f"install does not read OCI registries yet: {source}",
            "pull it into a store on the node (`neuronctl artifacts pull URL --store DIR`), "
            "or install from s3:// or a shared mount",
        )
    remote, dirname, key = remote_artifact(source)
    assert isinstance(remote, Transport)  # every remote but a registry is one
    return _install(remote, dirname, key, dest, policy, host_checks, log)


@remote_errors  # the remote's failures (credentials, network) as one-line errors
def _install(
    remote: Transport,
    dirname: str,
    key: str,
    dest: Path,
    policy: TrustPolicy,
    host_checks: HostChecks,
    log: Log,
) -> Installed:
    manifest, record = checked_manifest(remote, dirname, policy, key)
    url = remote.artifact_url(dirname)
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
        fetch = _Fetcher(remote, dirname, dest, work, log, result)
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
    dest.mkdir(parents=True, exist_ok=True)
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

    def __init__(
        self, remote: Transport, dirname: str, dest: Path, work: Path, log: Log, result: Installed
    ) -> None:
        self.remote = remote
        self.dirname = dirname
        self.dest = dest
        self.work = work
        self.log = log
        self.result = result
        self.sizes = remote.sizes(dirname)
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
        if self.sizes.get(rel) != entry.size:
            found = "missing" if rel not in self.sizes else f"{self.sizes[rel]} bytes"
            raise RemoteArtifactError(
                f"{self.remote.artifact_url(self.dirname)}/{rel}: expected {entry.size} bytes, "
                f"found {found}",
                "the remote artifact is damaged; push it again with --force",
            )
        part = self.work / (hashlib.sha256(rel.encode()).hexdigest()[:24] + ".part")
        got = self._download(rel, entry.size, part)
        if got != entry.sha256:
            part.unlink(missing_ok=True)
            raise RemoteArtifactError(
                f"{self.remote.artifact_url(self.dirname)}/{rel} is corrupted: expected sha256 "
                f"{entry.sha256[:12]}…, got {got[:12]}…",
                "the remote artifact is damaged; push it again with --force",
            )
        _place(part, target, self.dest)
        self.log(f"verified {rel} ({_mib(entry.size)})")

    def _download(self, rel: str, size: int, part: Path) -> str:
        """Fetch into `part` up to `size` bytes, resuming what an earlier run left; the sha256
        of the whole file."""
        digest = hashlib.sha256()
        have = part.stat().st_size if part.exists() else 0
        with self.remote.open_object(self.dirname, rel) as src:
            have = _resume(src, part, have if have <= size else 0, digest)
            if have:
                self.log(f"resuming {rel} at {_mib(have)} of {_mib(size)}")
                self.count(kept=have)
            else:
                self.log(f"downloading {rel} ({_mib(size)})")
            done = self._copy(src, part, have, size, digest, rel)
        if done != size:
            raise RemoteArtifactError(
                f"{self.remote.artifact_url(self.dirname)}/{rel} ended at {done} bytes "
                f"(signed: {size})",
                "the remote artifact is being rewritten; install again",
            )
        return digest.hexdigest()

    def _copy(self, src: Any, part: Path, done: int, size: int, digest: Any, rel: str) -> int:
        logged = done
        with open(part, "ab") as out:
            while done < size and (chunk := src.read(min(HASH_CHUNK, size - done))):
                digest.update(chunk)
                on_this_host(lambda: out.write(chunk), part)
                done += len(chunk)
                self.count(downloaded=len(chunk))
                if done - logged >= LOG_EVERY:
                    out.flush()
                    self.log(f"downloading {rel}: {_mib(done)} of {_mib(size)}")
                    logged = done
        return done


def _resume(src: Any, part: Path, have: int, digest: Any) -> int:
    """Where to go on from: the bytes of `part` a killed run left (hashed into `digest`, the
    remote object moved past them), or 0 with `part` emptied when the object cannot seek."""
    if have:
        try:
            src.seek(have)
        except (OSError, ValueError, AttributeError):
            have = 0
    if not have:
        part.write_bytes(b"")
        return 0
    with open(part, "rb") as f:
        left = have
        while left and (chunk := f.read(min(HASH_CHUNK, left))):
            digest.update(chunk)
            left -= len(chunk)
    return have


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
