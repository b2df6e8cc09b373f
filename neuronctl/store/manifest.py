"""manifest.json: the single source of truth about an artifact, read back typed.

Every command that consumes an artifact reads what it needs from a `Manifest` (never from
flags, never from a backend's own config file). It is written last, after every other file is
complete and fsynced, so its presence means the files it lists were complete when it was
written. `is_intact` (compile's and pull's cache-hit rule) and `file_problems` /
`stray_files` (validate's files checks) are one stat-only rule, here beside the record they
check, so what compile reuses is exactly what validate calls reusable.

The path rule, for every file a manifest names (applied when a manifest is read, so publish,
validate, load, push and pull all get it): relative, POSIX separators only, no `..` or `.`
component, not manifest.json or its .tmp. On disk every listed file is a regular file reached
through no symlink. `record_sha256` covers what the build recorded (spec, keys, backend and
versions, architecture, source, graphs, the torch backend's op choice): an edited spec is
noticed before any load.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import stat
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    field_serializer,
    field_validator,
)

from neuronctl import __version__
from neuronctl.errors import NeuronctlError, NotFoundError
from neuronctl.keys import FORMAT_VERSION, Keys, canonical_json
from neuronctl.spec import BuildSpec, ModelShape

MANIFEST = "manifest.json"
ARTIFACTS_DIR = "neuron-compiled-artifacts"  # a store's artifacts, under its root (local.py)
MANIFEST_TMP = MANIFEST + ".tmp"
HASH_CHUNK = 8 * 1024 * 1024
# Metadata is read with a cap before it is parsed: a hostile or broken manifest.json cannot
# exhaust memory. 64 MiB holds the manifest of an artifact with several hundred thousand files.
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
# A store's private directories: what is under them is never an artifact (store/local.py).
# Beside an artifact, never part of it: the record of a pull or install and the signatures
# (store/signing.py reads them; no loader does).
BOOKKEEPING = frozenset({"provenance.json", "model.sig", "manifest.sig"})
PRIVATE_DIRS = frozenset({".staging", ".failed", ".trash", ".locks"})
# Stray files with these suffixes could be picked up by a loader (a graph, a weight shard,
# a config), so an unlisted one makes the artifact untrustworthy. Anything else is noted only.
LOADER_SUFFIXES = (".safetensors", ".pt", ".pt2", ".neff", ".json", ".bin", ".so", ".ntff")
# What record_sha256 covers: what the build decided. Not files (their own sha256s), host
# facts or timestamps.
RECORDED = ("format_version", "backend", "backend_versions", "spec", "keys", "source",
            "architecture", "graphs", "ops")


def path_rule(rel: str) -> str | None:
    """Why `rel` may not name a file of an artifact (None when it may)."""
    if not rel or "\\" in rel or "\x00" in rel:
        return "empty, or has a backslash or NUL"
    if rel.startswith("/") or (len(rel) > 1 and rel[1] == ":"):
        return "absolute"
    parts = rel.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "has an empty, '.' or '..' component"
    if rel in (MANIFEST, MANIFEST_TMP):
        return "is the manifest itself"
    return None


class FileEntry(BaseModel):
    size: int
    sha256: str


class Source(BaseModel):
    """Where the weights came from."""

    model: str | None = None  # what the user named: a Hub id or a path
    path: str | None = None  # the local directory that was read
    revision: str | None = None  # the Hub commit sha, when from the Hub
    digest: str  # the checkpoint content digest (see checkpoints)


MatmulPath = Literal["kernel", "onednn", "aten", "gemv"]
WeightLayout = Literal["plain", "packed", "blocked"]
ChosenBy = Literal["measure", "rules"]
ComputeDtype = Literal["float32", "bfloat16", "float16"]


class RowChoice(BaseModel):
    """The matmul path and the compute dtype (activations and matmuls) of the graphs that
    run at `rows` rows, and what each candidate (`path/layout/dtype`) measured: ms for one
    step's projections, timed at `timed_rows`; empty when chosen by rule."""

    rows: int
    path: MatmulPath
    compute: ComputeDtype
    timed_rows: int | None = None
    ms: dict[str, float] = Field(default_factory=dict)


class OpChoice(BaseModel):
    """How a torch artifact's graphs multiply (backends/torch/opchoice.py): the one layout
    its weights are read in, and per row count the path reading it. Decides how the weights
    are laid out at load, so it is part of the record."""

    layout: WeightLayout
    rows: list[RowChoice]
    chosen_by: ChosenBy

    def row(self, rows: int) -> RowChoice:
        for row in self.rows:
            if row.rows == rows:
                return row
        raise KeyError(rows)

    def path_for(self, rows: int) -> str:
        return self.row(rows).path

    @property
    def computes(self) -> set[str]:
        return {row.compute for row in self.rows}

    @property
    def paths(self) -> set[str]:
        return {row.path for row in self.rows}


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
    ops: OpChoice | None = None  # torch: the matmul paths (None for the other backends)
    record_sha256: str | None = None  # over RECORDED; set by record_files at publish

    @field_validator("files")
    @classmethod
    def _files_follow_the_path_rule(cls, files: dict[str, FileEntry]) -> dict[str, FileEntry]:
        _check_paths(files)
        return files

    @field_validator("graphs")
    @classmethod
    def _graphs_follow_the_path_rule(cls, graphs: list[str]) -> list[str]:
        _check_paths(graphs)
        return graphs

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

    def recorded_sha256(self) -> str:
        data = self.model_dump(mode="json", include=set(RECORDED))
        return hashlib.sha256(canonical_json(data).encode()).hexdigest()

    def record_problem(self) -> str | None:
        """Why the recorded build facts cannot be trusted (None when they can)."""
        if self.record_sha256 is not None and self.record_sha256 != self.recorded_sha256():
            return (
                f"{MANIFEST} was edited after the build (its spec, keys or versions no longer "
                "match record_sha256)"
            )
        return None


def served_name(model: str | None, revision: str | None) -> str | None:
    """A Hub id as compiled; for a local path, the Hub id of a cache snapshot
    (.../models--ORG--NAME/snapshots/SHA) or the folder's name."""
    if not model or revision:
        return model
    parts = Path(model).parts
    for i, part in enumerate(parts[:-1]):
        if part.startswith("models--") and parts[i + 1] == "snapshots":
            return part.removeprefix("models--").replace("--", "/")
    return Path(model).name or model


def _check_paths(paths: Any) -> None:
    for rel in paths:
        why = path_rule(rel)
        if why is not None:
            raise ValueError(f"file path {rel!r} is not allowed: {why}")


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
    for dirpath, dirs, names in os.walk(root):
        dirs.sort()
        names = names + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]
        for name in sorted(names):
            path = Path(dirpath) / name
            if path.relative_to(root).as_posix() != MANIFEST:
                yield path


def record_files(root: Path, manifest: Manifest) -> Manifest:
    """The manifest to publish: every file (plain files only) with its size and sha256, and
    the record digest. Validated, so a path the rule refuses fails the build, not a reader.
    A manifest that arrives with a record digest (a pull) must still match it."""
    if (edited := manifest.record_problem()) is not None:
        raise NeuronctlError(edited)
    files = {}
    for p in iter_files(root):
        rel = p.relative_to(root).as_posix()
        mode = p.lstat().st_mode
        if not stat.S_ISREG(mode):
            raise NeuronctlError(f"the build left {rel}, which is not a plain file (a symlink?)")
        files[rel] = FileEntry(size=p.stat().st_size, sha256=sha256_file(p))
    data = manifest.model_dump(mode="json")
    data["files"] = dict(sorted((k, v.model_dump()) for k, v in files.items()))
    try:
        recorded = Manifest.model_validate(data)
    except ValidationError as exc:
        raise NeuronctlError(f"the build's manifest is invalid: {exc.errors()[0]['msg']}") from None
    return recorded.model_copy(update={"record_sha256": recorded.recorded_sha256()})


def write_manifest(root: Path, manifest: Manifest) -> None:
    tmp = root / MANIFEST_TMP
    tmp.write_text(manifest.model_dump_json(indent=2) + "\n")
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, root / MANIFEST)


def read_capped(path: Path, cap: int) -> bytes:
    """A small local file's bytes, refused above `cap` bytes and unless it is a regular file.

    Opened non-blocking and checked with fstat, so a FIFO (or a device) named like a
    manifest fails at once instead of hanging the reader; never reads more than cap + 1."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NeuronctlError(f"{path} is not a regular file")
        if info.st_size > cap:
            raise NeuronctlError(f"{path} is {info.st_size} bytes, over the {cap}-byte limit")
        chunks, left = [], cap + 1
        while left > 0 and (chunk := os.read(fd, min(left, HASH_CHUNK))):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > cap:  # it grew since the fstat
        raise NeuronctlError(f"{path} is over the {cap}-byte limit")
    return data


# How deeply a manifest's JSON may nest: its own records go 4 levels deep; a hostile one
# nested thousands deep was an internal RecursionError in the parser.
MAX_JSON_DEPTH = 32
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth_problem(data: bytes, limit: int = MAX_JSON_DEPTH) -> str | None:
    """Why `data` nests deeper than `limit` (counted outside strings, before any parse)."""
    depth = 0
    for byte in _JSON_STRING.sub(b"", data).translate(None, _NOT_BRACKETS):
        depth += 1 if byte in b"[{" else -1
        if depth > limit:
            return f"nests deeper than {limit} levels"
    return None


def load_json_capped(path: Path, cap: int = MAX_MANIFEST_BYTES) -> Any:
    """A small JSON file parsed, after read_capped and json_depth_problem: NeuronctlError
    for a file too large, too deep or not JSON; FileNotFoundError as it is."""
    data = read_capped(path, cap)
    if (problem := json_depth_problem(data)) is not None:
        raise NeuronctlError(f"{path} {problem}; it is not a neuronctl manifest")
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise NeuronctlError(f"{path} is not valid JSON: {exc}") from None


def read_manifest(root: Path) -> Manifest:
    path = root / MANIFEST
    try:
        data = load_json_capped(path)
    except NeuronctlError as exc:
        raise NotFoundError(exc.message) from None
    except FileNotFoundError:
        raise NotFoundError(
            f"{root} is not an artifact: no {MANIFEST}",
            "compile one with `neuronctl compile MODEL`",
        ) from None
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        raise NotFoundError(
            f"{path} is not a neuronctl manifest: {exc.errors()[0]['msg']}"
        ) from None


def file_problems(root: Path, manifest: Manifest) -> tuple[list[str], list[str], list[str]]:
    """Stat only: (missing, wrong size, unsafe). Unsafe: a path the rule refuses (a manifest
    built by hand), a symlink anywhere on the way, or something that is not a plain file."""
    missing, wrong_size, unsafe = [], [], []
    for rel, entry in manifest.files.items():
        if path_rule(rel) is not None:
            unsafe.append(rel)
            continue
        try:
            why = _not_plain(root, rel)
        except FileNotFoundError:
            missing.append(rel)
            continue
        if why:
            unsafe.append(f"{rel} ({why})")
            continue
        size = (root / rel).lstat().st_size
        if size != entry.size:
            wrong_size.append(f"{rel} ({size} bytes, recorded {entry.size})")
    return missing, wrong_size, unsafe


def _not_plain(root: Path, rel: str) -> str | None:
    """Why root/rel is not a plain file reached through plain directories (lstat each part)."""
    path = root
    parts = rel.split("/")
    for i, part in enumerate(parts):
        path = path / part
        mode = path.lstat().st_mode
        if stat.S_ISLNK(mode):
            return "a symlink"
        last = i == len(parts) - 1
        if last and stat.S_ISDIR(mode):
            return "a directory"
        if last and not stat.S_ISREG(mode):
            return "not a plain file"
    return None


def stray_files(root: Path, manifest: Manifest) -> tuple[list[str], list[str]]:
    """Files (and symlinks) in the artifact its manifest does not list: (risky, harmless).
    Risky ones a loader could read (LOADER_SUFFIXES) or are symlinks."""
    listed = set(manifest.files) | {MANIFEST}
    risky, harmless = [], []
    for path in iter_files(root):
        rel = path.relative_to(root).as_posix()
        if rel in listed:
            continue
        if path.is_symlink() or rel.endswith(LOADER_SUFFIXES) and rel not in BOOKKEEPING:
            risky.append(rel)
        else:
            harmless.append(rel)
    return sorted(risky), sorted(harmless)


def leftover_problem(path: Path) -> str | None:
    """A store's private directories (.staging, .failed, .trash) hold what a killed or failed
    build or pull left: never an artifact, whatever its manifest says."""
    for parent in Path(path).absolute().parts:
        if parent in PRIVATE_DIRS:
            return (
                f"{path} is under a store's {parent}/ (what an interrupted or failed build or "
                "pull left): not an artifact; `neuronctl artifacts gc` removes it"
            )
    return None


def is_intact(path: Path) -> bool:
    """Good enough for a cache hit: exactly what validate's artifact and files checks accept.

    A stat, not a hash, so a hit costs milliseconds whatever the model size. A damaged
    artifact is rebuilt (and replaced atomically) rather than reused.
    """
    return intact_problem(path) is None


def intact_problem(path: Path) -> str | None:
    """Why `path` is not intact (None when it is): what `-v` says about a cache miss."""
    if (leftover := leftover_problem(path)) is not None:
        return leftover
    if not (path / MANIFEST).is_file():
        return f"no artifact at {path}"
    try:
        manifest = read_manifest(path)
        missing, wrong_size, unsafe = file_problems(path, manifest)
        risky, _ = stray_files(path, manifest)
    except (NeuronctlError, OSError) as exc:
        return f"unreadable manifest: {exc}"
    if (edited := manifest.record_problem()) is not None:
        return edited
    problems = (("missing", missing), ("wrong size", wrong_size), ("unsafe", unsafe),
                ("unlisted files a loader could read", risky))
    for what, items in problems:
        if items:
            return f"{what}: {', '.join(items[:3])}"
    return None
