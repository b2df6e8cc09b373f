"""Writes under a shared mount that never follow a symbolic link.

Whoever can write to a shared mount can plant a link under its `neuron-compiled-artifacts/`
(the artifact's directory, or `graphs/` inside it) pointing anywhere the pusher can write: a
path-based copy follows it and overwrites files outside the remote. Here every directory below
the remote's root is opened relative to its parent's descriptor with O_NOFOLLOW (created when
missing), and the file is written and renamed into place, or removed, relative to the last
one: a link anywhere on the way is refused, never followed. The root itself is the user's
choice (a link they name is theirs to name).
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from neuronctl.store.remote.errors import RemoteArtifactError

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@contextmanager
def parent_dir(root: str, rel: str, create: bool = True) -> Iterator[tuple[int, str]]:
    """A descriptor of the directory that holds `root/rel` (each directory below `root`
    opened without following links, made when missing where `create`) and the file's name."""
    parts = PurePosixPath(rel).parts
    if create:
        os.makedirs(root, exist_ok=True)  # the root: the user's own path, links and all
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            child = _enter(fd, part, f"{root}/{rel}", create)
            os.close(fd)
            fd = child
        yield fd, parts[-1]
    finally:
        os.close(fd)


def _enter(parent: int, name: str, where: str, create: bool) -> int:
    """The directory `name` in `parent`, made if missing (where `create`), never a link."""
    if create:
        try:
            os.mkdir(name, 0o755, dir_fd=parent)
        except FileExistsError:
            pass
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise RemoteArtifactError(
                f"{where}: {name} on its way is a symbolic link or not a directory; "
                "refusing to write through it",
                "someone planted it in the remote store: remove it by hand and push again",
            ) from None
        raise


def put_file(source: Path, root: str, rel: str) -> None:
    """Copy `source` to `root/rel`: beside it first, then renamed into place (a rename
    replaces a link at the target itself, it does not write through it)."""
    with parent_dir(root, rel) as (fd, name), open(source, "rb") as src:
        _write(fd, name, lambda out: shutil.copyfileobj(src, out))


def put_bytes(data: bytes, root: str, rel: str) -> None:
    with parent_dir(root, rel) as (fd, name):
        _write(fd, name, lambda out: out.write(data))


def _write(fd: int, name: str, fill: Callable[[BinaryIO], object]) -> None:
    tmp = f"{name}.tmp-{uuid.uuid4().hex[:8]}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    out_fd = os.open(tmp, flags, 0o644, dir_fd=fd)
    try:
        with os.fdopen(out_fd, "wb") as out:
            fill(out)
        os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
    except BaseException:
        os.unlink(tmp, dir_fd=fd)
        raise


def remove(root: str, rel: str) -> None:
    """Remove `root/rel` (a link there is removed itself, never what it points at)."""
    try:
        with parent_dir(root, rel, create=False) as (fd, name):
            os.unlink(name, dir_fd=fd)
    except FileNotFoundError:
        pass
