"""Open an artifact's file without waiting on it: regular files only.

`open()` of a FIFO waits for a writer, forever if none comes; a character device may block on
every read. A FIFO put in place of a graph that was not loaded yet hung the engine thread on
its first use of it: every request hung and the process outlived SIGTERM. So an artifact's
files are opened with O_NONBLOCK (a FIFO then opens at once), checked to be regular files on
the open descriptor (no race with a swap of the path), and only then read, blocking again.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from neuronctl.errors import NeuronctlError


class NotRegularFileError(NeuronctlError):
    """An artifact's file is a FIFO, device, socket or directory: never read."""


def open_regular(path: Path) -> BinaryIO:
    """`open(path, "rb")`, refusing anything but a regular file without blocking on it.
    Symlinks are followed (an artifact's store layout may use them); what they name must be
    a regular file too."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(
                f"{path} is not a regular file ({kind_of(mode)}); refusing to read it",
                "an artifact holds regular files only: recompile or pull it again",
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_regular(path: Path) -> None:
    """Raise NotRegularFileError unless `path` is a regular file (opened without waiting)."""
    open_regular(path).close()


def kind_of(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory")):  # fmt: skip
        if test(mode):
            return name
    return "not a regular file"
