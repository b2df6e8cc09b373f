"""manifest.json: the single source of truth about an artifact.

Every command that consumes an artifact reads what it needs from here, never from flags.
It is written last, after every other file is complete and fsynced, so its presence means
the files it lists were complete when it was written.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from neuronctl import __version__
from neuronctl.errors import NotFoundError
from neuronctl.keys import FORMAT_VERSION

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
    format_version: int = FORMAT_VERSION
    neuronctl_version: str = __version__
    created: str = Field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    backend: str
    backend_versions: dict[str, str]
    host: dict[str, Any] = Field(default_factory=dict)
    spec: dict[str, Any]
    keys: dict[str, str]  # graph_key, weights_key, artifact_key
    source: Source
    architecture: dict[str, Any]  # the model's config.json as compiled
    graphs: list[str] = Field(default_factory=list)  # relative paths of compiled graphs
    files: dict[str, FileEntry] = Field(default_factory=dict)

    @property
    def artifact_key(self) -> str:
        return self.keys["artifact_key"]

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
