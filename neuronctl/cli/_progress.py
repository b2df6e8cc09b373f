"""Progress for long work: bars that redraw in place on a terminal, sparse plain lines in a log.

On a terminal, rich redraws the bars in place. Anything else written to stderr meanwhile must
go through rich too, or it scrolls the bars away and they are drawn again below it, one copy per
log line: neuronctl's log handler is pointed at rich's stderr while the bars are shown.

Elsewhere (CI logs, a pipe, a file) a redraw is a control character the reader sees as garbage
or as one line per update, so each task prints a line when it starts and one when it ends, and
every `PlainProgress.interval` seconds one line says what still runs. --json prints nothing.
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
    """The Progress protocol as log lines: a line when a task starts, one when it ends, and
    while any runs, one line every `interval` seconds saying what still runs (CI watchdogs
    stop a job that prints nothing for minutes; a 15-minute compile advances only at its end).
    """

    interval = 30.0

    def __init__(
        self,
        bytes_: bool = False,
        write: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._bytes = bytes_
        self._write = write or _write_stderr
        self._clock = clock
        self._start = clock()
        self._tasks: list[_PlainTask] = []
        self._lock = threading.Lock()  # graph workers report from their own threads

    def task(self, description: str, total: float | None = None) -> Callable[[float], None]:
        task = _PlainTask(description, total, self._clock())
        with self._lock:
            self._tasks.append(task)
            self._write(f"{description} ...")

        def advance(amount: float) -> None:
            with self._lock:
                if task.advance(amount):
                    self._write(f"{description}: done in {self._clock() - task.start:.1f} s")

        return advance

    def heartbeat(self) -> None:
        """One line naming what still runs, with how far each task with a total has got; the
        same line between tasks too (a compile traces before its first task and publishes
        after its last: silence there looked like a hang, for up to a whole interval more)."""
        with self._lock:
            after = f"still running after {self._clock() - self._start:.0f} s"
            running = [self._status(t) for t in self._tasks if not t.finished]
            if running:
                self._write(f"{after}: " + "; ".join(running))
            elif self._tasks:
                self._write(f"{after} (past: {self._tasks[-1].description})")
            else:
                self._write(after)

    @contextmanager
    def heartbeats(self) -> Iterator[PlainProgress]:
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(self.interval):
                self.heartbeat()

        thread = threading.Thread(target=beat, name="progress-heartbeat", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()

    def _status(self, task: _PlainTask) -> str:
        if not task.total or task.total <= 1:  # one step: there is no "how far"
            return task.description
        if self._bytes:
            amounts = f"{human_size(task.done)} of {human_size(task.total)}"
        else:
            amounts = f"{task.done:g} of {task.total:g}"
        return f"{task.description} {100 * task.done / task.total:.0f}% ({amounts})"


class _PlainTask:
    def __init__(self, description: str, total: float | None, start: float) -> None:
        self.description, self.total, self.start = description, total, start
        self.done = 0.0
        self.finished = False

    def advance(self, amount: float) -> bool:
        """Count `amount`; True the one time this reaches the total."""
        if self.finished:
            return False
        self.done += amount
        # Fractional advances can sum a hair short of the total.
        reached = self.total is not None and (
            self.done >= self.total or math.isclose(self.done, self.total)
        )
        self.finished = reached
        return reached


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
        with PlainProgress(bytes_).heartbeats() as plain:
            yield plain
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
