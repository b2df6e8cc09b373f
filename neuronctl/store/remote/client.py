"""RemoteStore, what a command holds for a remote store: what it holds (transport.py), and
push (push.py) and pull (pull.py) as its methods."""

from __future__ import annotations

from pathlib import Path

from neuronctl.progress import Progress
from neuronctl.store.local import Published, Store
from neuronctl.store.remote.pull import pull_artifact
from neuronctl.store.remote.push import PushResult, push_artifact
from neuronctl.store.remote.transport import Transport, open_fs
from neuronctl.store.signing import Signer, TrustPolicy


def open_remote(url: str) -> RemoteStore:
    """A remote store from a URL; a plain path means a shared mount (file://)."""
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
