"""Leases: a process that loads an artifact from a store holds it, and `gc` leaves it alone.

A lease is a shared flock(2) on `<store>/neuron-compiled-artifacts/.leases/<key>.lease`,
held from before the artifact is read until the process exits. Any number of servers share
it; `gc` takes it exclusively, without waiting, around the removal, so it removes only what
nobody holds, and nobody starts holding what it is removing. The kernel drops a lock when
its process dies, however it dies, so a killed server never leaves an artifact pinned.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from neuronctl.store.manifest import ARTIFACTS_DIR

logger = logging.getLogger(__name__)

LEASES_DIR = ".leases"


def lease_file(artifact: Path) -> Path | None:
    """Where an artifact's lease lives; None for a directory outside a store (gc never
    reaches it). Judged on the resolved directory, as the load rule judges it: a server that
    opened the artifact through a link holds the lease `rm` and `gc` of the artifact take."""
    artifact = Path(artifact).expanduser().resolve()
    if artifact.parent.name != ARTIFACTS_DIR:
        return None
    return artifact.parent / LEASES_DIR / f"{artifact.name}.lease"


class Lease:
    """A held lease; `release()` (or the process's exit) lets gc remove the artifact."""

    def __init__(self, fd: int | None) -> None:
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def hold(artifact: Path, across_exec: bool = False) -> Lease:
    """Take a shared lease on an artifact before reading it; waits only while a gc of this
    very artifact is removing it. A store this process cannot write to gives no lease (a
    store it cannot write to, it cannot gc either). across_exec: the program this process
    execs next (vLLM) keeps holding it."""
    path = lease_file(artifact)
    if path is None:
        return Lease(None)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        logger.info("no lease on %s (%s): gc may remove it while in use", artifact, exc)
        return Lease(None)
    fcntl.flock(fd, fcntl.LOCK_SH)
    os.set_inheritable(fd, across_exec)
    return Lease(fd)


@contextmanager
def unused(artifact: Path) -> Iterator[bool]:
    """Hold an artifact's lease exclusively if nobody holds it: yields True when free (the
    caller may remove it now), False when a process is using it."""
    path = lease_file(artifact)
    if path is None:
        yield True
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
        if not artifact.exists():  # removed: its lease file goes with it
            path.unlink(missing_ok=True)
    finally:
        os.close(fd)
