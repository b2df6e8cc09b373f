"""Whether any other user can change an artifact's bytes: the file-system half of the load rule.

An artifact is "written by nobody else" when its directory, every directory and file inside
it, and the two directories above it (`<root>/neuron-compiled-artifacts/<key>` in a store, the
same three on a shared mount) are owned by this user or by root and writable by no other user
(a group-write bit only for this user's own primary group), and nothing inside is a symbolic
link or anything but a directory or a regular file. Whoever owns the files could change them,
but this user and root run the code anyway (docs/security.md, "The load rule").

The two directories above matter because whoever can write there can rename the artifact away
and put another in its place between a check and a load; a sticky one (like /tmp) is fine,
as others cannot rename or remove what this user owns there.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def others_can_write(artifact: Path) -> str | None:
    """Why another user could change what `artifact` holds, or None when nobody else can.
    Judged on the resolved directory: a link into a shared mount is judged by where it leads."""
    real = Path(artifact).resolve()
    for directory in (real.parent.parent, real.parent):
        problem = _entry_problem(directory, follow=True, sticky_ok=True)
        if problem:
            return problem
    return _tree_problem(real)


def _tree_problem(top: Path) -> str | None:
    """The first entry of `top`, or of anything inside it, that another user could change."""
    problem = _entry_problem(top, follow=True)
    if problem:
        return problem
    try:
        for dirpath, dirnames, filenames in os.walk(top, onerror=_raise):
            for name in sorted(dirnames) + sorted(filenames):
                problem = _entry_problem(Path(dirpath) / name, follow=False)
                if problem:
                    return problem
    except OSError as exc:  # a directory inside that cannot be listed is not judged: refused
        return f"{exc.filename or top}: {exc.strerror}"
    return None


def _raise(exc: OSError) -> None:
    raise exc


def _entry_problem(path: Path, follow: bool, sticky_ok: bool = False) -> str | None:
    """Why another user could change `path`, or None. `sticky_ok`: a directory above the
    artifact may be writable by all if it is sticky (like /tmp): others may add entries
    there, but not rename or remove this user's."""
    try:
        info = os.stat(path) if follow else os.lstat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link; an artifact holds only its own files"
    if not (stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode)):
        return f"{path} is not a regular file or a directory"
    if info.st_uid not in (os.geteuid(), 0):
        return f"{path} is owned by uid {info.st_uid}, not by this user"
    if sticky_ok and stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX:
        return None
    if info.st_mode & 0o002 or (info.st_mode & 0o020 and info.st_gid != os.getegid()):
        return f"{path} is writable by other users"
    return None
