"""The content digest of a checkpoint, cheap to recompute.

digest = sha256(canonical JSON of {relative file name: sha256 of the file}) over config.json and
the weight files. Two ways avoid re-reading gigabytes:
- a Hugging Face cache snapshot links each LFS file to `blobs/<sha256>`: the name is the hash;
- any other file's hash is cached in `<user cache>/neuronctl/digests.json`, keyed by absolute
  path and trusted while (size, mtime_ns, inode) are unchanged. `rehash=True` ignores the cache.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from neuronctl.checkpoints.hub import model_files
from neuronctl.keys import digest as json_digest
from neuronctl.store.local import user_cache_store
from neuronctl.store.manifest import sha256_file

logger = logging.getLogger(__name__)

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
CACHE_FILE = "digests.json"


def weights_digest(root: Path, weight_files: list[Path], rehash: bool = False) -> str:
    """Over config.json and the weight files of the checkpoint in `root`."""
    return json_digest(file_hashes(root, [root / "config.json", *weight_files], rehash=rehash))


def model_files_digest(root: Path, rehash: bool = False) -> str:
    """Over the files an artifact carries beside its weights (tokenizer, generation config):
    not weights, but what serve reads (EOS ids, chat template), so the artifact key covers it."""
    return json_digest(file_hashes(root, model_files(root), rehash=rehash))


def file_hashes(root: Path, files: list[Path], rehash: bool = False) -> dict[str, str]:
    """{path relative to root: sha256} using the Hub blob names and the stat cache."""
    cache = DigestCache()
    hashes: dict[str, str] = {}
    for path in files:
        rel = path.relative_to(root).as_posix()
        blob = hub_blob_sha256(path)
        if blob:
            logger.debug("digest of %s: named by its Hub cache blob", rel)
        hashes[rel] = blob or cache.sha256(path, rehash=rehash)
    cache.save()
    return hashes


def hub_blob_sha256(path: Path) -> str | None:
    """The sha256 a Hugging Face cache snapshot file's blob is named by, if it is one."""
    if not path.is_symlink():
        return None
    target = Path(os.path.realpath(path))
    if target.parent.name == "blobs" and SHA256_RE.match(target.name):
        return target.name
    return None  # a git (sha1) blob such as config.json: hash it


class DigestCache:
    """sha256 per absolute path, valid while the file's size, mtime and inode are unchanged."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or user_cache_store() / CACHE_FILE
        self.entries = self._load()
        self.changed: dict[str, dict[str, Any]] = {}

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}  # no cache yet, or a damaged one: hashing again is always correct
        return data if isinstance(data, dict) else {}

    def sha256(self, path: Path, rehash: bool = False) -> str:
        key = str(path.resolve())
        st = path.stat()
        stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}
        entry = self.entries.get(key)
        if not rehash and entry and all(entry.get(k) == v for k, v in stamp.items()):
            logger.debug("digest cache hit: %s (size, mtime and inode unchanged)", path)
            return str(entry["sha256"])
        logger.info("hashing %s (%d bytes): %s", path, st.st_size, _miss_reason(entry, rehash))
        sha = sha256_file(path)
        self.entries[key] = self.changed[key] = {**stamp, "sha256": sha}
        return sha

    def save(self) -> None:
        if not self.changed:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        from filelock import FileLock  # loading an artifact's weights never saves digests

        # Merge under a lock: another process may have cached other files meanwhile.
        with FileLock(str(self.path) + ".lock"):
            merged = {**self._load(), **self.changed}
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(merged, indent=0, sort_keys=True))
            os.replace(tmp, self.path)
        self.changed = {}


def _miss_reason(entry: dict[str, Any] | None, rehash: bool) -> str:
    if rehash:
        return "--rehash"
    if not entry:
        return "not in the digest cache"
    return "changed since it was cached (size, mtime or inode)"
