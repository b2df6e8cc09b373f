"""Worker processes that die with the process that started them.

A compile's worker pool is a set of spawned interpreters. When the compile process is killed
with SIGKILL (a CI timeout, the OOM killer), nothing tells them: busy workers keep compiling
into a staging directory nobody will publish, idle ones wait on their queue forever. Two
guards, both set up by `die_with_parent` as the pool's initializer:

- Linux: prctl(PR_SET_PDEATHSIG, SIGKILL) asks the kernel to kill the worker when its parent
  dies (immediately, even in the middle of a C++ compile);
- everywhere: a daemon thread that polls the parent pid and exits the worker when the parent
  is gone (covers other platforms, and the kernel rule's one gap: it is tied to the parent
  *thread* that spawned the worker).

A process that runs other programs asks for `whole_tree`: it kills everything below it
before it exits. Both kinds do: the kernel build runs ninja and the compilers, and a graph
worker runs AOTInductor's C++ compiler, which otherwise ran on, orphaned, after a SIGKILLed
compile (for minutes on a large model).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PR_SET_CHILD_SUBREAPER = 36
POLL_SECONDS = 0.5


def die_with_parent(parent_pid: int, whole_tree: bool = False) -> None:
    """Pool initializer: make this worker exit when `parent_pid` exits.

    whole_tree: this process runs programs that know nothing of its parent (ninja, the
    compilers): when the parent dies, or on SIGTERM, kill every process below this one first
    (`kill_tree`).

    The kernel's rule fires when the *thread* that started this process exits (prctl(2)),
    not only the process: a ProcessPoolExecutor starts spawn workers in the thread that calls
    submit(), so that thread must outlive the pool (build_graphs holds it until the pool has
    shut down)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            # SIGKILL cannot be handled: a tree's root asks for SIGTERM and kills its tree.
            death = signal.SIGTERM if whole_tree else signal.SIGKILL
            if whole_tree:
                libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
                signal.signal(signal.SIGTERM, lambda *_: _exit(whole_tree))
            libc.prctl(PR_SET_PDEATHSIG, death, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # no prctl (an unusual libc): the watchdog below still applies
    if os.getppid() != parent_pid:  # the parent died before the rule was in place
        _exit(whole_tree)
    watchdog = threading.Thread(
        target=_watch, args=(parent_pid, whole_tree), name="parent-watchdog", daemon=True
    )
    watchdog.start()


def _watch(parent_pid: int, whole_tree: bool) -> None:
    # Re-parenting (to init or a subreaper) changes getppid: that is the parent's death.
    stop = threading.Event()
    while not stop.wait(POLL_SECONDS):
        if os.getppid() != parent_pid:
            _exit(whole_tree)


def _exit(whole_tree: bool) -> None:
    if whole_tree:
        kill_tree()
        # Our group only if we lead it (the kernel build runs in a session of its own). A
        # graph worker shares its compile's group, which may hold the user's shell pipeline
        # or the test runner that started the compile.
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpgrp(), signal.SIGKILL)  # this process included
    os._exit(1)


def kill_tree() -> None:
    """SIGKILL every process below this one. A process-group kill is not enough: ninja starts
    each command in a process group of its own (its subprocess-posix.cc, POSIX_SPAWN_SETPGROUP,
    so that Ctrl-C reaches only ninja). This process is a child subreaper, so the
    orphans of what it kills become its children, and the next look finds them."""
    for _ in range(20):
        below = descendants(os.getpid())
        if not below:
            return
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def descendants(root: int) -> list[int]:
    """Live processes below `root` (Linux /proc; elsewhere none are found)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if state != "Z":
            parents[int(stat.parent.name)] = int(ppid)
    found: list[int] = []
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier}
        found += frontier
    return found
