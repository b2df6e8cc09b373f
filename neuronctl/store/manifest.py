"""manifest.json: the single source of truth about an artifact, read back typed.

Every command that consumes an artifact reads what it needs from a `Manifest` (never from
flags, never from a backend's own config file). It is written last, after every other file is
complete and fsynced, so its presence means the files it lists were complete when it was
written. `is_intact` (compile's and pull's cache-hit rule) and `file_problems` (validate's
files check) are the same stat-only rule, here beside the record they check.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    field_serializer,
    field_validator,
)

from neuronctl import __version__
from neuronctl.errors import NeuronctlError, NotFoundError
from neuronctl.keys import FORMAT_VERSION, Keys
from neuronctl.spec import BuildSpec, ModelShape

MANIFEST = "manifest.json"
HASH_CHUNK = 8 * 1024 * 1024


class FileEntry(BaseModel):
    size: int
    sha256: str


class Source(BaseModel):
    """Where the weights came from."""

    model: str | None = None  # what the user named: a Hub id or a path
    path: str | None = None  # the local directory that was read
    revision: str | None = None  # the Hub commit sha, when from the Hub
    digest: str  # the checkpoint content digest (see checkpoints)


class Manifest(BaseModel):
    """Typed: `spec` is the finalized BuildSpec, `keys` the Keys, `shape` the parsed model
    shape. On disk the same JSON as ever (keys spelled graph_key/weights_key/artifact_key)."""

    format_version: int = FORMAT_VERSION
    neuronctl_version: str = __version__
    created: str = Field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    backend: str
    backend_versions: dict[str, str]
    host: dict[str, Any] = Field(default_factory=dict)
    spec: BuildSpec
    keys: Keys
    source: Source
    architecture: dict[str, Any]  # the model's config.json as compiled
    graphs: list[str] = Field(default_factory=list)  # relative paths of compiled graphs
    files: dict[str, FileEntry] = Field(default_factory=dict)

    @field_validator("keys", mode="before")
    @classmethod
    def _read_keys(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            try:
                return Keys.from_dict(value)
            except KeyError as exc:
                raise ValueError(f"keys has no {exc.args[0]}") from None
        return value

    @field_serializer("keys")
    def _write_keys(self, keys: Keys) -> dict[str, str]:
        return keys.as_dict()

    @property
    def artifact_key(self) -> str:
        return self.keys.artifact

    @property
    def shape(self) -> ModelShape:
        return ModelShape.from_config(self.architecture)

    def total_size(self) -> int:
        return sum(entry.size for entry in self.files.values())


def host_facts() -> dict[str, Any]:
    return {"machine": platform.machine(), "python": platform.python_version()}


def sha256_file(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(HASH_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
            if on_bytes:
                on_bytes(n)
    return h.hexdigest()


def iter_files(root: Path) -> Iterator[Path]:
    for dirpath, _dirs, names in os.walk(root):
        for name in sorted(names):
            path = Path(dirpath) / name
            if path.relative_to(root).as_posix() != MANIFEST:
                yield path


def record_files(root: Path, manifest: Manifest) -> Manifest:
    files = {
        p.relative_to(root).as_posix(): FileEntry(size=p.stat().st_size, sha256=sha256_file(p))
        for p in iter_files(root)
    }
    return manifest.model_copy(update={"files": dict(sorted(files.items()))})


def write_manifest(root: Path, manifest: Manifest) -> None:
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(manifest.model_dump_json(indent=2) + "\n")
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, root / MANIFEST)


def read_manifest(root: Path) -> Manifest:
    path = root / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise NotFoundError(
            f"{root} is not an artifact: no {MANIFEST}",
            "compile one with `neuronctl compile MODEL`",
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise NotFoundError(f"{path} is not valid JSON: {exc}") from None
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        raise NotFoundError(
            f"{path} is not a neuronctl manifest: {exc.errors()[0]['msg']}"
        ) from None


def file_problems(root: Path, manifest: Manifest) -> tuple[list[str], list[str], list[str]]:
    """Stat only: (missing, wrong size, outside the artifact)."""
    missing, wrong_size, unsafe = [], [], []
    for rel, entry in manifest.files.items():
        if not _inside(rel):
            unsafe.append(rel)
            continue
        try:
            size = (root / rel).stat().st_size
        except FileNotFoundError:
            missing.append(rel)
            continue
        if size != entry.size:
            wrong_size.append(f"{rel} ({size} bytes, recorded {entry.size})")
    return missing, wrong_size, unsafe


def _inside(rel: str) -> bool:
    parts = Path(rel).parts
    return bool(parts) and not Path(rel).is_absolute() and ".." not in parts


def is_intact(path: Path) -> bool:
    """Good enough for a cache hit: a manifest, and every file it lists at its size.

    A stat, not a hash, so a hit costs milliseconds whatever the model size. A damaged
    artifact is rebuilt (and replaced atomically) rather than reused.
    """
    return intact_problem(path) is None


def intact_problem(path: Path) -> str | None:
    """Why `path` is not intact (None when it is): what `-v` says about a cache miss."""
    if not (path / MANIFEST).is_file():
        return f"no artifact at {path}"
    try:
        missing, wrong_size, unsafe = file_problems(path, read_manifest(path))
    except (NeuronctlError, OSError) as exc:
        return f"unreadable manifest: {exc}"
    for what, items in (("missing", missing), ("wrong size", wrong_size), ("unsafe", unsafe)):
        if items:
            return f"{what}: {', '.join(items[:3])}"
    return None
