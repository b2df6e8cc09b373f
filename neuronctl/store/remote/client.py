"""What a command holds for a remote store: a RemoteStore (fsspec: what it holds in
transport.py, push.py and pull.py as its methods) or an OciStore (oci.py, a registry), with
the same methods."""

from __future__ import annotations

from pathlib import Path

from neuronctl.progress import Progress
from neuronctl.store.local import Published, Store
from neuronctl.store.remote.oci import OciStore
from neuronctl.store.remote.oci_ref import is_oci
from neuronctl.store.remote.pull import check_artifact_trusted, pull_artifact
from neuronctl.store.remote.push import PushResult, push_artifact
from neuronctl.store.remote.transport import Transport, open_fs
from neuronctl.store.signing import Signer, TrustPolicy


def open_remote(url: str) -> RemoteStore | OciStore:
    """A remote store from a URL; a plain path means a shared mount (file://), `oci://` a
    registry (never fsspec's Oracle object storage)."""
    if is_oci(url):
        return OciStore(url)
    return RemoteStore(*open_fs(url))


class RemoteStore(Transport):
    def push(
        self,
        artifact: Path,
        progress: Progress | None = None,
        *,
        force: bool = False,
        signer: Signer | None = None,
    ) -> PushResult:
        """Upload a local artifact (push.push_artifact)."""
        return push_artifact(self, artifact, progress, force=force, signer=signer)

    def pull(
        self,
        dirname: str,
        store: Store,
        progress: Progress | None = None,
        policy: TrustPolicy | None = None,
        key: str = "",
    ) -> Published:
        """Download an artifact into `store`, verified (pull.pull_artifact)."""
        return pull_artifact(self, dirname, store, progress, policy, key)

    def check_trusted(
        self, dirname: str, policy: TrustPolicy | None = None, key: str = ""
    ) -> None:
        """Raise unless `policy` trusts the remote artifact (pull.check_artifact_trusted)."""
        check_artifact_trusted(self, dirname, policy, key)
