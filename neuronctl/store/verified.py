"""What was hashed is what is loaded: a private, sealed copy of a file, hashed as it is copied.

A loader that hashes a file and then opens it again by name loads whatever the name holds by
then: a graph swapped after the check (graphs load lazily, on first use) runs in the process
under a signature that never covered it. Instead the file is read once, through one
descriptor, into a memfd (anonymous memory with a file's interface) while it is hashed; a
copy whose hash is not the manifest's is refused, and the copy is sealed (no write, no
resize) so that nothing changes it afterwards. Loaders that want a path (torch's AOTInductor
package loader, dlopen through torch.ops.load_library, torch.export.load) get
`/proc/self/fd/N`, which names that copy and nothing else.

Off Linux (no memfd) the copy is a file in a fresh directory only this user can read, removed
when the process exits.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import stat
import sys
import tempfile
import weakref
from pathlib import Path

from neuronctl import process
from neuronctl.errors import CheckpointError
from neuronctl.store.files import NotRegularFileError, kind_of
from neuronctl.store.manifest import HASH_CHUNK

SEALS = ("F_SEAL_SEAL", "F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_WRITE")


class VerifiedCopy:
    """A private copy of `source` whose bytes hash to the manifest's sha256. Loaders open
    `path`; `close()` (or garbage collection) frees the copy once what it held is loaded."""

    def __init__(self, source: Path, fd: int, path: Path, temporary: bool) -> None:
        self.source = source
        self.path = path
        self._release = weakref.finalize(self, _release, fd, path if temporary else None)

    def close(self) -> None:
        self._release()


def _release(fd: int, temporary: Path | None) -> None:
    os.close(fd)
    if temporary is not None:
        temporary.unlink(missing_ok=True)


def verified_copy(source: Path, sha256: str, what: str = "") -> VerifiedCopy:
    """Copy `source` into private memory, hashing it as it is read; CheckpointError when the
    bytes are not the ones the manifest records (`sha256`)."""
    fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # opened without waiting: a FIFO would block the engine
            raise NotRegularFileError(f"{source} is not a regular file ({kind_of(mode)})",
                                      "recompile the artifact")
        copy, path = _new_copy(source.name)
        result = VerifiedCopy(source, copy, path, temporary=not str(path).startswith("/proc"))
        digest = _copy_hashing(fd, copy)
    finally:
        os.close(fd)
    if digest != sha256:
        result.close()
        raise CheckpointError(
            f"{what or source} is not the file the artifact's manifest records (sha256 "
            f"{digest[:12]}…, recorded {sha256[:12]}…): it changed after the artifact was "
            "checked", "do not use it; pull or compile the artifact again",
        )
    _seal(copy)
    return result


def _copy_hashing(fd: int, copy: int) -> str:
    digest = hashlib.sha256()
    while chunk := os.read(fd, HASH_CHUNK):
        digest.update(chunk)
        view = memoryview(chunk)
        while view:
            view = view[os.write(copy, view):]
    return digest.hexdigest()


def _new_copy(name: str) -> tuple[int, Path]:
    """A writable descriptor for the copy, and the path loaders open it by."""
    if sys.platform == "linux" and hasattr(os, "memfd_create"):
        flags = os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 0)
        fd = os.memfd_create(f"neuronctl-{name}", flags)
        return fd, Path(f"/proc/self/fd/{fd}")
    fd, path = tempfile.mkstemp(prefix="copy-", suffix=f"-{name}", dir=_private_dir())
    return fd, Path(path)


_directory: str | None = None


def _private_dir() -> str:
    global _directory
    if _directory is None:
        _directory = tempfile.mkdtemp(prefix="neuronctl-verified-")  # mode 0700
        process.at_exit(shutil.rmtree, _directory, True)
    return _directory


def _seal(fd: int) -> None:
    """No write, resize or further seal on the copy from now on (where Linux offers seals)."""
    add = getattr(fcntl, "F_ADD_SEALS", None)
    seals = [getattr(fcntl, name, None) for name in SEALS]
    if add is None or None in seals:
        return
    try:
        fcntl.fcntl(fd, add, sum(s for s in seals if s is not None))
    except OSError:
        pass  # the fallback file: only this user can reach it
