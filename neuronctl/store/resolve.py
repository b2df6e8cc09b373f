"""The one rule for what names an artifact, used by every command that takes one.

- a URL (`s3://bucket/prefix/KEY`, `file:///…/KEY`, optionally with a
  `/neuron-compiled-artifacts/` segment, or a registry's `oci://REGISTRY/REPO:KEY` or
  `...@sha256:DIGEST`): the artifact in that remote store, pulled (verified) into the local
  store first;
- a path (contains a separator, starts with `.` or `~`): that directory;
- anything else: a key, directory name or unique prefix in the local store (never a directory
  of the working directory: `./name` names that one).

The local store is `--store` (its root or its `neuron-compiled-artifacts` directory), else the
one default (`store.local.default_store_root`: $NEURONCTL_STORE, else ~/.cache/neuronctl).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

from neuronctl.errors import NotFoundError, UsageError
from neuronctl.progress import Progress
from neuronctl.store.local import Store, default_store_root, is_artifact, spelled_as_path
from neuronctl.store.manifest import is_intact

if TYPE_CHECKING:
    from neuronctl.store.signing import TrustPolicy

logger = logging.getLogger(__name__)
# A bare name spelled like a key (or a prefix of one) is never sent on to the Hub.
KEY_LIKE = re.compile(r"[0-9a-f]{6,64}")


def open_store(store: Path | None = None) -> Store:
    return Store(store if store is not None else default_store_root())


def is_url(ref: str) -> bool:
    return "://" in ref


class NotPulledError(NotFoundError):
    """A trusted remote holds the artifact; it is not in the local store yet."""


def resolve_artifact(
    ref: str | Path | None,
    store: Path | Store | None = None,
    *,
    fetch: bool = True,
    progress: Progress | None = None,
    policy: TrustPolicy | None = None,
) -> Path:
    """The local artifact directory `ref` names. With `fetch=False` a URL is never pulled:
    an artifact not yet in the local store is a NotPulledError (what --dry-run reports) once
    the remote is known to hold it under a trusted signature."""
    if ref is None or not str(ref).strip():
        raise UsageError(
            "no artifact given",
            "pass an artifact KEY, PATH or URL (--artifacts, or $NEURON_COMPILED_ARTIFACTS)",
        )
    local = store if isinstance(store, Store) else open_store(store)
    text = str(ref)
    if not is_url(text):
        path = local.resolve(text)
        logger.info("artifact %s -> %s", text, path)
        return path
    from neuronctl.store.remote.urls import (
        check_remote_trust,
        resolve_artifacts_arg,
        split_artifact_url,
    )

    if not fetch:
        _url, key = split_artifact_url(text)
        try:
            found: Path | None = local.find(key)
        except NotFoundError:
            found = None
        if found is None or not is_intact(found):
            check_remote_trust(text, policy)  # a dry run still says an untrusted one is refused
            raise NotPulledError(
                f"{text} is not in the local store {local.artifacts} yet",
                "without --dry-run it is pulled (sha256-verified) first",
            )
        return found
    logger.info("pulling %s into %s", text, local.artifacts)
    return resolve_artifacts_arg(text, local, progress, policy=policy)


def artifact_or_checkpoint(ref: str, store: Path | None = None) -> Path | None:
    """For a command that takes an artifact or a checkpoint (`inspect`): the artifact `ref`
    names under the one rule, or None when it names none, so it is a checkpoint (a Hub id,
    or a directory without a manifest). A URL is never pulled here. A bare name is a key of
    the store first, never a directory of the working directory; one spelled like a key that
    no artifact has is not found rather than looked up on the Hub."""
    if is_url(ref):
        return resolve_artifact(ref, store, fetch=False)
    if spelled_as_path(ref):
        path = Path(ref).expanduser().absolute()
        return path if is_artifact(path) else None
    try:
        return open_store(store).find(ref)
    except NotFoundError as exc:
        if KEY_LIKE.fullmatch(ref):
            exc.hint = "a Hub id is ORG/NAME; a directory here is ./" + ref
            raise
        return None
