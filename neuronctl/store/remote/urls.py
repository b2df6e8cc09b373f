"""`URL/KEY` names a remote artifact: `s3://bucket/prefix/KEY`, a shared mount's
`/mnt/shared/KEY`, either maybe with `neuron-compiled-artifacts/` before the key."""

from __future__ import annotations

import os
import posixpath
from pathlib import Path

from neuronctl.errors import UsageError
from neuronctl.progress import Progress
from neuronctl.store.local import ARTIFACTS_DIR, Store
from neuronctl.store.remote.client import RemoteStore, open_remote
from neuronctl.store.remote.oci import OciStore
from neuronctl.store.remote.oci_ref import GRAMMAR, is_oci, parse_oci_url
from neuronctl.store.signing import TrustPolicy


def resolve_artifacts_arg(
    value: str,
    store: Store,
    progress: Progress | None = None,
    policy: TrustPolicy | None = None,
) -> Path:
    """`--artifacts` value -> a local artifact directory; a remote URL is pulled first.

    Accepts `<store-url>/<KEY>` and `<store-url>/neuron-compiled-artifacts/<KEY>`.
    """
    if "://" not in value:
        return Path(value).expanduser()
    remote, dirname, key = remote_artifact(value)
    return remote.pull(dirname, store, progress, policy, key).path


def check_remote_trust(value: str, policy: TrustPolicy | None = None) -> None:
    """Refuse a remote artifact `policy` does not trust, reading only its manifest and
    signature (what --dry-run does instead of pulling)."""
    remote, dirname, key = remote_artifact(value)
    remote.check_trusted(dirname, policy, key)


def remote_artifact(value: str) -> tuple[RemoteStore | OciStore, str, str]:
    """The remote store an artifact URL names, the artifact's directory name in it, and the
    key as written in the URL (compared in full with the signed manifest)."""
    url, key = split_artifact_url(value)
    remote = open_remote(url)
    return remote, remote.resolve(key), key


def split_artifact_url(value: str) -> tuple[str, str]:
    """`s3://b/p/KEY` -> (`s3://b/p`, `KEY`), dropping a trailing neuron-compiled-artifacts.

    A plain path (`/mnt/shared/KEY`) names a shared mount, as it does for push.
    `oci://REGISTRY/REPO:TAG` -> (`oci://REGISTRY/REPO`, `TAG`), and `...@sha256:D` ->
    (`oci://REGISTRY/REPO`, `@sha256:D`): a registry names an artifact by tag or digest."""
    value = value.rstrip("/")
    if is_oci(value):
        ref = parse_oci_url(value)
        if ref.reference is None:
            raise UsageError(f"{value!r} names a repository, not an artifact",
                             "add the tag (the artifact key) or digest: " + GRAMMAR)
        return ref.store_url, f"@{ref.digest}" if ref.digest else str(ref.tag)
    if "://" not in value and value:
        value = "file://" + os.path.abspath(os.path.expanduser(value))
    scheme, _, rest = value.partition("://")
    parent, _, key = rest.rpartition("/")
    if not parent or not key:
        raise UsageError(
            f"{value!r} does not name a remote artifact", "use URL/KEY, e.g. s3://bucket/prefix/KEY"
        )
    if posixpath.basename(parent) == ARTIFACTS_DIR:
        parent = posixpath.dirname(parent)
    return f"{scheme}://{parent}", key
