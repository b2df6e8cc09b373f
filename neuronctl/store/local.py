"""A local artifact store: `<root>/neuron-compiled-artifacts/<key>/`, published atomically.

Layout under `<root>/neuron-compiled-artifacts/`:
  <key>/                 complete artifacts only (they appear by rename)
  .staging/<key>.<id>/   work in progress; never looks like an artifact
  .locks/<key>.lock      one lock per key: one process builds, the others wait and reuse
  .trash/                replaced artifacts on their way out
  .failed/<key>.<id>/    what the last failed build of a key left, with its logs, until `gc`
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from neuronctl.errors import NeuronctlError, NotFoundError, UsageError
from neuronctl.store.manifest import (
    ARTIFACTS_DIR,
    MANIFEST,
    Manifest,
    read_manifest,
    record_files,
    write_manifest,
)

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from filelock import FileLock

STORE_ENV = "NEURONCTL_STORE"

StepHook = Callable[[str], None]


def user_cache_store() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "neuronctl"


def default_store_root() -> Path:
    """The one default store of every command: $NEURONCTL_STORE, else the user cache
    (~/.cache/neuronctl). `compile` publishes there and `artifacts push KEY`, `validate KEY`,
    `--artifacts KEY` look there, so a key printed by one command is found by the next."""
    if env := os.environ.get(STORE_ENV):
        return Path(env)
    return user_cache_store()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(dirpath))


def spelled_as_path(text: str) -> bool:
    """The one rule's test: a separator, or a leading `.` or `~`, makes a name a path."""
    return "/" in text or os.sep in text or text.startswith((".", "~"))


def is_artifact(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def is_store(path: Path) -> bool:
    """A store root or its neuron-compiled-artifacts directory."""
    return path.name == ARTIFACTS_DIR or (path / ARTIFACTS_DIR).is_dir()


def _in_use(final: Path) -> NeuronctlError:
    return NeuronctlError(
        f"{final} is not intact, but a running process (a server) holds it: refusing to "
        "replace an artifact in use",
        "stop the process that serves it, then run the command again",
    )


@dataclass(frozen=True)
class Published:
    path: Path
    cache_hit: bool  # True when another build (maybe a concurrent one) had made it


class Store:
    def __init__(self, root: Path) -> None:
        root = Path(root).expanduser().absolute()
        # The directory compile prints (`<root>/neuron-compiled-artifacts`) names the same store.
        self.root = root.parent if root.name == ARTIFACTS_DIR else root
        self.artifacts = self.root / ARTIFACTS_DIR

    @classmethod
    def containing(cls, artifact: Path) -> Store:
        """The store an artifact directory lives in (`<root>/neuron-compiled-artifacts/<key>`)."""
        artifact = Path(artifact).expanduser().absolute()
        if artifact.parent.name != ARTIFACTS_DIR or not is_artifact(artifact):
            raise UsageError(
                f"{artifact} is not an artifact in a store",
                f"name an artifact by key, or a directory under .../{ARTIFACTS_DIR}/",
            )
        return cls(artifact.parent.parent)

    def path(self, dirname: str) -> Path:
        return self.artifacts / dirname

    def _private(self, name: str) -> Path:
        path = self.artifacts / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def lock(self, dirname: str) -> FileLock:
        from filelock import FileLock  # only builds and gc lock: reading a store never does

        return FileLock(str(self._private(".locks") / f"{dirname}.lock"))

    def new_staging(self, dirname: str) -> Path:
        path = self._private(".staging") / f"{dirname}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        path.mkdir()
        return path

    def publish(
        self,
        dirname: str,
        build: Callable[[Path], Manifest],
        reuse: Callable[[Path], bool] = is_artifact,
        on_step: StepHook | None = None,
    ) -> Published:
        """Build into staging and rename into place, once per key across processes.

        `build` fills the staging directory and returns the manifest (without `files`);
        `reuse` decides whether an existing directory is good enough to skip the build.
        """
        step = on_step or (lambda _name: None)
        final = self.path(dirname)
        if reuse(final):
            return Published(final, cache_hit=True)
        with self._locked(dirname):
            if reuse(final):  # a concurrent process built it while we waited
                return Published(final, cache_hit=True)
            self._refuse_if_leased(final)  # before the build: it could never be published
            staging = self.new_staging(dirname)
            try:
                step("building")
                manifest = build(staging)
                step("built")
                manifest = record_files(staging, manifest)
                fsync_tree(staging)
                step("files-synced")
                write_manifest(staging, manifest)
                step("manifest-written")
                self._move_into_place(staging, final)
                step("published")
            except BaseException as exc:
                self._discard(staging, exc)
                raise
        return Published(final, cache_hit=False)

    @contextmanager
    def _locked(self, dirname: str) -> Iterator[None]:
        """The key's lock; when another process holds it, say so before waiting (a second
        pull of a key waited silently behind the first)."""
        from filelock import Timeout

        lock = self.lock(dirname)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            logger.warning(
                "waiting for another neuronctl process that is building or pulling %s "
                "(its lock: %s)", dirname[:12], lock.lock_file,
            )  # fmt: skip
            lock.acquire()
        try:
            yield
        finally:
            lock.release()

    def _discard(self, staging: Path, exc: BaseException) -> None:
        """A failed build keeps its staging dir (logs) under .failed/; an interrupted one goes."""
        if not isinstance(exc, Exception):
            shutil.rmtree(staging, ignore_errors=True)
            return
        failed = self._private(".failed")
        key = staging.name.split(".", 1)[0]
        for earlier in failed.glob(f"{key}.*"):  # one kept failure per key, not per attempt
            shutil.rmtree(earlier, ignore_errors=True)
        kept = failed / staging.name
        staging.rename(kept)
        if isinstance(exc, NeuronctlError) and exc.hint is None:
            exc.hint = f"build files and logs kept in {kept}; `neuronctl artifacts gc` removes them"

    def _refuse_if_leased(self, final: Path) -> None:
        from neuronctl.store.lease import unused  # lease.py builds on this module

        if final.exists():
            with unused(final) as free:
                if not free:
                    raise _in_use(final)

    def _move_into_place(self, staging: Path, final: Path) -> None:
        from neuronctl.store.lease import unused

        doomed = None
        if final.exists():  # a broken or partial directory: set it aside, never merge
            # Under its lease, taken exclusively: a process that loaded it (a server) keeps
            # what it mapped, and none starts loading it while it is swapped.
            with unused(final) as free:
                if not free:
                    raise _in_use(final)
                doomed = self._private(".trash") / f"{final.name}.{uuid.uuid4().hex[:8]}"
                final.rename(doomed)
                staging.rename(final)
        else:
            staging.rename(final)
        fsync_dir(self.artifacts)
        if doomed is not None:
            # Only our own: other processes rename into .trash concurrently (remove, publish).
            shutil.rmtree(doomed, ignore_errors=True)

    def iter_artifacts(self) -> Iterator[tuple[Path, Manifest | None]]:
        """Every visible entry; the manifest is None for a directory that is not an artifact."""
        if not self.artifacts.is_dir():
            return
        for path in sorted(self.artifacts.iterdir()):
            if path.name.startswith(".") or not path.is_dir():
                continue
            try:
                yield path, read_manifest(path)
            except NotFoundError:
                yield path, None

    def resolve(self, key_or_path: str) -> Path:
        """What a command's KEY|PATH argument names: a path when it is spelled like one
        (has a separator, starts with `.` or `~`), else an artifact of this store by key or
        unique prefix. A bare name is never looked up in the working directory: whoever can
        write there must not be able to stand in for a key of the store.

        A path to a store (its root or its neuron-compiled-artifacts directory) is refused
        with a hint: it holds artifacts, it is not one."""
        path = Path(key_or_path).expanduser()
        if spelled_as_path(key_or_path):
            if not is_artifact(path) and is_store(path):
                raise UsageError(
                    f"{path} is an artifact store, not an artifact",
                    f"name an artifact by key: --store {path} KEY (see `neuronctl artifacts list`)",
                )
            return path
        try:
            return self.find(key_or_path)
        except NotFoundError as exc:
            if path.is_dir():
                exc.hint = f"a bare name is a key of the store; for the directory, write ./{path}"
            raise

    def find(self, key_or_prefix: str) -> Path:
        """An artifact by full key, directory name or unique prefix of either."""
        if not key_or_prefix or "/" in key_or_prefix:
            raise UsageError(f"{key_or_prefix!r} is not an artifact key")
        matches = [
            path
            for path, manifest in self.iter_artifacts()
            if manifest is not None
            and (
                path.name.startswith(key_or_prefix)
                or manifest.artifact_key.startswith(key_or_prefix)
            )
        ]
        if not matches:
            raise NotFoundError(
                f"no artifact {key_or_prefix!r} in {self.artifacts}",
                "see `neuronctl artifacts list`",
            )
        if len(matches) > 1:
            names = ", ".join(p.name for p in matches)
            raise UsageError(f"{key_or_prefix!r} matches several artifacts: {names}")
        return matches[0]

    def remove(self, path: Path) -> None:
        """Remove an artifact so that no reader ever sees it half-deleted."""
        with self.lock(path.name):
            doomed = self._private(".trash") / f"{path.name}.{uuid.uuid4().hex[:8]}"
            try:
                path.rename(doomed)
            except FileNotFoundError:  # `rm` and `gc` raced: the other one removed it
                raise NotFoundError(f"{path} is already removed") from None
            shutil.rmtree(doomed, ignore_errors=True)

    def stale_staging(self) -> list[Path]:
        """Staging dirs whose key is not locked: left by a killed or failed process."""
        staging_root = self.artifacts / ".staging"
        if not staging_root.is_dir():
            return []
        from filelock import Timeout

        stale = []
        for path in sorted(staging_root.iterdir()):
            dirname = path.name.split(".", 1)[0]
            try:
                with self.lock(dirname).acquire(timeout=0):
                    stale.append(path)
            except Timeout:
                continue  # someone is building it now
        return stale
