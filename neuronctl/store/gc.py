"""Garbage collection: leftovers of killed or failed builds, and artifacts past a policy."""

from __future__ import annotations

import logging
import re
import shutil
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from pydantic import ByteSize, TypeAdapter, ValidationError

from neuronctl.errors import NotFoundError, UsageError
from neuronctl.store.lease import unused
from neuronctl.store.local import Store
from neuronctl.store.manifest import Manifest

logger = logging.getLogger(__name__)

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> timedelta:
    match = _DURATION.match(text.strip())
    if not match:
        raise UsageError(f"--older-than: {text!r} is not a duration", "e.g. 12h, 7d, 2w")
    return timedelta(seconds=float(match.group(1)) * _SECONDS[match.group(2)])


class BinaryByteSize(ByteSize):
    """pydantic's ByteSize read with the units --max-size has always had: K, M, G, T, P, E
    are powers of 1024 with or without "B" or "iB" (1G = 1GB = 1GiB, as `du -h` prints),
    where ByteSize alone reads "1GB" as 10**9. Plain numbers are bytes."""

    byte_sizes = {"b": 1} | {
        f"{prefix}{suffix}": 1024 ** (power + 1)
        for power, prefix in enumerate("kmgtpe")
        for suffix in ("", "b", "ib")
    }


_SIZE = TypeAdapter(BinaryByteSize)


def parse_size(text: str) -> int:
    """Bytes in a size such as 500M, 20G, 1.5TiB or 4096; UsageError if it is not one."""
    # ByteSize's pattern is not anchored at the end: refuse trailing words here.
    if re.fullmatch(ByteSize.byte_string_pattern + r"\s*", text):
        try:
            return int(_SIZE.validate_python(text.strip()))
        except ValidationError:
            pass  # a unit ByteSize does not know, e.g. "5x"
    raise UsageError(
        f"--max-size: {text!r} is not a size", "e.g. 500M, 20G or 1T (binary: 1G = 1024**3 bytes)"
    )


@dataclass
class GcReport:
    removed: list[Path] = field(default_factory=list)  # artifacts
    leftovers: list[Path] = field(default_factory=list)  # staging, failed, trash
    in_use: list[Path] = field(default_factory=list)  # doomed, but a running process holds it
    freed_bytes: int = 0
    dry_run: bool = False

    def as_dict(self) -> dict[str, object]:
        return {
            "removed": [str(p) for p in self.removed],
            "leftovers": [str(p) for p in self.leftovers],
            "in_use": [str(p) for p in self.in_use],
            "freed_bytes": self.freed_bytes,
            "dry_run": self.dry_run,
        }


def created(manifest: Manifest) -> datetime:
    return datetime.fromisoformat(manifest.created)


def doomed_artifacts(
    artifacts: list[tuple[Path, Manifest]],
    keep_last: int | None,
    older_than: timedelta | None,
    max_size: int | None,
) -> list[tuple[Path, Manifest]]:
    newest_first = sorted(artifacts, key=lambda item: created(item[1]), reverse=True)
    doomed: dict[Path, Manifest] = {}
    if keep_last is not None:
        doomed.update(newest_first[keep_last:])
    if older_than is not None:
        cutoff = datetime.now(UTC) - older_than
        doomed.update((p, m) for p, m in newest_first if created(m) < cutoff)
    if max_size is not None:
        total = 0
        for path, manifest in newest_first:
            total += manifest.total_size()
            if total > max_size:
                doomed[path] = manifest
    return [(p, m) for p, m in newest_first if p in doomed]


def leftovers(store: Store) -> list[Path]:
    paths = store.stale_staging()
    for name in (".failed", ".trash"):
        folder = store.artifacts / name
        if folder.is_dir():
            paths.extend(sorted(folder.iterdir()))
    return paths + _registry_layers(store)


def _registry_layers(store: Store) -> list[Path]:
    """Layers killed registry pulls kept for a re-run (oci.BLOB_CACHE), only while no pull
    runs (every staging dir stale): a running pull links from them."""
    cache = store.artifacts / ".oci-blobs"
    staging = store.artifacts / ".staging"
    if not cache.is_dir():
        return []
    if staging.is_dir() and len(list(staging.iterdir())) > len(store.stale_staging()):
        return []
    return sorted(cache.iterdir())


def _tree_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def collect(
    store: Store,
    keep_last: int | None = None,
    older_than: timedelta | None = None,
    max_size: int | None = None,
    dry_run: bool = False,
) -> GcReport:
    if keep_last is not None and keep_last < 0:
        # A negative N would slice from the end and remove the newest artifacts.
        raise UsageError(f"--keep-last: {keep_last} is negative", "e.g. --keep-last 5")
    report = GcReport(dry_run=dry_run)
    artifacts = [(p, m) for p, m in store.iter_artifacts() if m is not None]
    for path, manifest in doomed_artifacts(artifacts, keep_last, older_than, max_size):
        with unused(path) as free:  # held across the removal: nobody starts loading it
            if not free:
                # The report lists it (gc's one line); a warning here said it a second time.
                logger.info("keeping artifact %s: a running process uses it", path.name)
                report.in_use.append(path)
                continue
            logger.info("%s artifact %s (created %s)", _verb(dry_run), path.name, manifest.created)
            if not dry_run:
                try:
                    store.remove(path)
                except NotFoundError:  # a concurrent `rm` or `gc` got there first
                    continue
        report.removed.append(path)
        report.freed_bytes += manifest.total_size()
    for path in leftovers(store):
        logger.info("%s leftover %s", _verb(dry_run), path)
        report.leftovers.append(path)
        report.freed_bytes += _tree_size(path)
        if not dry_run and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif not dry_run:
            path.unlink(missing_ok=True)
    return report


def _verb(dry_run: bool) -> str:
    return "would remove" if dry_run else "removing"
