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
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
POLL_SECONDS = 0.5


def die_with_parent(parent_pid: int, whole_group: bool = False) -> None:
    """Pool initializer: make this worker exit when `parent_pid` exits.

    whole_group: this process leads its own process group (started with
    start_new_session) and runs children that do not know about its parent (ninja, the
    compilers): when the parent dies, kill the whole group, not just this process."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            # SIGKILL cannot be handled: a group leader asks for SIGTERM and kills its group.
            death = signal.SIGTERM if whole_group else signal.SIGKILL
            if whole_group:
                signal.signal(signal.SIGTERM, lambda *_: _exit(whole_group))
            libc.prctl(PR_SET_PDEATHSIG, death, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # no prctl (an unusual libc): the watchdog below still applies
    if os.getppid() != parent_pid:  # the parent died before the rule was in place
        _exit(whole_group)
    watchdog = threading.Thread(
        target=_watch, args=(parent_pid, whole_group), name="parent-watchdog", daemon=True
    )
    watchdog.start()


def _watch(parent_pid: int, whole_group: bool) -> None:
    # Re-parenting (to init or a subreaper) changes getppid: that is the parent's death.
    stop = threading.Event()
    while not stop.wait(POLL_SECONDS):
        if os.getppid() != parent_pid:
            _exit(whole_group)


def _exit(whole_group: bool) -> None:
    if whole_group:
        os.killpg(os.getpgrp(), signal.SIGKILL)  # this process included
    os._exit(1)
