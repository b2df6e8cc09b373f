"""Checkpoints: open a local directory or a Hub id, read tensors lazily, digest the content.

`open_checkpoint` is the one entry point: a path that exists is read as-is; anything else that
looks like a Hub id is downloaded (or found in the Hugging Face cache) first, so every command
that names a model accepts both.
"""

from __future__ import annotations

import re
from pathlib import Path

from neuronctl.checkpoints.reader import Checkpoint, open_local
from neuronctl.errors import NotFoundError, UsageError

__all__ = ["Checkpoint", "open_checkpoint"]

HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def open_checkpoint(
    ref: str,
    revision: str | None = None,
    *,
    allow_pickle: bool = False,
    download: bool = True,
) -> Checkpoint:
    """A checkpoint from a local directory or a Hub id (downloaded unless `download=False`,
    in which case only the local Hugging Face cache is used)."""
    path = Path(ref).expanduser()
    if path.exists():
        if revision:
            raise UsageError(
                f"--revision {revision} was given for a local directory ({ref})",
                "drop --revision, or name a Hub id",
            )
        return open_local(ref, path.absolute(), allow_pickle=allow_pickle)
    if not looks_like_hub_id(ref):
        raise NotFoundError(f"{ref} does not exist", "name a checkpoint directory or a Hub id")
    if (parent := path.parent) != Path(".") and parent.is_dir():
        # ORG/NAME where ORG is a local directory: a mistyped path, not a Hub id to fetch
        raise NotFoundError(
            f"{ref} does not exist ({parent}/ is a local directory)",
            f"check the name (`ls {parent}`); a Hub id is only fetched when no local "
            f"directory {parent}/ is there",
        )
    from neuronctl.checkpoints.hub import snapshot

    local, sha = snapshot(ref, revision, cache_only=not download)
    return open_local(ref, local, revision=sha, allow_pickle=allow_pickle)


def looks_like_hub_id(ref: str) -> bool:
    return bool(HUB_ID_RE.match(ref)) and not ref.startswith((".", "~")) and ".." not in ref
