"""A graph build that never ends, for the graph-worker timeout test. Standard library only,
so a spawned worker starts in a fraction of a second."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import NamedTuple


class Job(NamedTuple):
    """What _build_in_pool reads of a GraphJob: its name (and here, where to note the pid)."""

    name: str
    staging: str


def hang(job: Job) -> str:
    (Path(job.staging) / f"{os.getpid()}.pid").write_text("")
    time.sleep(600)
    return ""


def hang_below(job: Job) -> str:
    """`hang`, with a program running below the worker (what AOTInductor's compiler is):
    notes `<worker pid> <program pid>` in `<staging>/<worker pid>.tree`."""
    import subprocess

    program = subprocess.Popen(["sleep", "600"])
    note = Path(job.staging) / f"{os.getpid()}.tree"
    note.with_suffix(".part").write_text(f"{os.getpid()} {program.pid}")
    note.with_suffix(".part").rename(note)
    time.sleep(600)
    return ""
