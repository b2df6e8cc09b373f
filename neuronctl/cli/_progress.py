"""Progress for long work: bars that redraw in place on a terminal, sparse plain lines in a log.

On a terminal, rich redraws the bars in place. Anything else written to stderr meanwhile must
go through rich too, or it scrolls the bars away and they are drawn again below it, one copy per
log line: neuronctl's log handler is pointed at rich's stderr while the bars are shown.

Elsewhere (CI logs, a pipe, a file) a redraw is a control character the reader sees as garbage
or as one line per update, so each task prints a line when it starts, at most one every
`PlainProgress.interval` seconds while it runs, and one when it ends. --json prints nothing.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    SpinnerColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)

from neuronctl.cli._common import err_console, human_size
from neuronctl.progress import NullProgress


class RichProgress:
    """Adapts rich.progress.Progress to the backends' Progress protocol: one line per task."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress

    def task(self, description: str, total: float | None = None) -> Callable[[float], None]:
        task_id = self._progress.add_task(description, total=total)
        return lambda advance: self._progress.advance(task_id, advance)


class PlainProgress:
    """The Progress protocol as log lines: start, a heartbeat while it runs, done."""

    interval = 30.0  # seconds between a running task's lines: CI watchdogs want a sign of life

    def __init__(
        self,
        bytes_: bool = False,
        write: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._bytes = bytes_
        self._write = write or _write_stderr
        self._clock = clock
        self._lock = threading.Lock()  # graph workers report from their own threads

    def task(self, description: str, total: float | None = None) -> Callable[[float], None]:
        self._write(f"{description} ...")
        return _PlainTask(self, description, total).advance

    def _so_far(self, done: float, total: float | None) -> str:
        amount = human_size(done) if self._bytes else f"{done:g}"
        if not total:
            return f"{amount} so far"
        whole = human_size(total) if self._bytes else f"{total:g}"
        return f"{100 * done / total:.0f}% ({amount} of {whole})"


class _PlainTask:
    def __init__(self, owner: PlainProgress, description: str, total: float | None) -> None:
        self.owner, self.description, self.total = owner, description, total
        self.start = self.last = owner._clock()
        self.done = 0.0
        self.finished = False

    def advance(self, amount: float) -> None:
        owner = self.owner
        with owner._lock:
            if self.finished:
                return
            self.done += amount
            now = owner._clock()
            if self.total is not None and _reached(self.done, self.total):
                self.finished = True
                owner._write(f"{self.description}: done in {now - self.start:.1f} s")
            elif now - self.last >= owner.interval:
                self.last = now
                owner._write(f"{self.description}: {owner._so_far(self.done, self.total)}")


def _reached(done: float, total: float) -> bool:
    return done >= total or math.isclose(done, total)  # fractional advances sum short


def _write_stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


@contextmanager
def progress_for(
    quiet: bool, bytes_: bool = False
) -> Iterator[RichProgress | PlainProgress | NullProgress]:
    if quiet:
        yield NullProgress()
        return
    if not err_console.is_terminal or err_console.is_dumb_terminal:  # TERM=dumb: no redraw
        yield PlainProgress(bytes_)
        return
    columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn()]
    columns += [DownloadColumn()] if bytes_ else [TaskProgressColumn()]
    columns.append(TimeElapsedColumn())
    with Progress(*columns, console=err_console, transient=False) as progress, _logs_above():
        yield RichProgress(progress)


@contextmanager
def _logs_above() -> Iterator[None]:
    """Point neuronctl's log handler at sys.stderr as it is now: inside the bars' context, rich's
    proxy, which prints each line above the bars. The handler kept the real stderr."""
    handlers = [
        h
        for h in logging.getLogger("neuronctl").handlers
        if isinstance(h, logging.StreamHandler) and getattr(h, "_neuronctl", False)
    ]
    kept = [h.setStream(sys.stderr) for h in handlers]
    try:
        yield
    finally:
        for handler, stream in zip(handlers, kept, strict=True):
            if stream is not None:
                handler.setStream(stream)
