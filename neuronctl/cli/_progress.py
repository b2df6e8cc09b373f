"""Rich progress for long work; silent when output is for machines or not a terminal."""

from __future__ import annotations

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

from neuronctl.cli._common import err_console
from neuronctl.progress import NullProgress


class RichProgress:
    """Adapts rich.progress.Progress to the backends' Progress protocol: one line per task."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress

    def task(self, description: str, total: float | None = None) -> Callable[[float], None]:
        task_id = self._progress.add_task(description, total=total)
        return lambda advance: self._progress.advance(task_id, advance)


@contextmanager
def progress_for(quiet: bool, bytes_: bool = False) -> Iterator[RichProgress | NullProgress]:
    if quiet or not err_console.is_terminal:
        yield NullProgress()
        return
    columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn()]
    columns += [DownloadColumn()] if bytes_ else [TaskProgressColumn()]
    columns.append(TimeElapsedColumn())
    with Progress(*columns, console=err_console, transient=False) as progress:
        yield RichProgress(progress)
