"""Build claims: one builder per key across every plan and host that shares a remote store.

A claim is a small JSON object, `<root>/neuron-compiled-artifacts/.claims/<dirname>.json`,
created only where none exists: a hard link on a shared mount (atomic, and refused where the
name exists; every directory on the way opened without following links, nofollow.py), a
conditional PUT (`If-None-Match: *`) on S3 through s3fs's exclusive mode "xb". Whoever
created it builds; everyone else waits for the manifest (the artifact published) or for the
claim to go (the build failed). A holder rewrites its claim's expiry while it works; a
claim past its expiry is a dead holder's and is taken over. Listings skip the `.claims`
directory (names starting with a dot are never keys).

Remotes without an exclusive create (the Hub, OCI registries) have no claims: a build there
is checked against the remote before it starts, and push's first-push-wins keeps the remote
whole, but two builders that start at once both compile.
"""

from __future__ import annotations

import json
import os
import posixpath
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

from neuronctl.store.local import ARTIFACTS_DIR
from neuronctl.store.remote import nofollow
from neuronctl.store.remote.errors import remote_errors
from neuronctl.store.remote.transport import DIRNAME_RE, Transport

CLAIMS_DIR = ".claims"
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class ClaimsUnsupported(Exception):  # noqa: N818 - a capability, not an error
    """This remote cannot create an object only where none exists."""


@dataclass
class Claim:
    remote: Transport
    dirname: str
    token: str
    ttl_s: float
    owner: str
    refreshed: float = 0.0  # time.monotonic() of the last write

    def body(self) -> bytes:
        record = {"token": self.token, "owner": self.owner, "expires": time.time() + self.ttl_s}
        return json.dumps(record).encode()

    def refresh(self) -> bool:
        """Push the expiry on; False when the claim is no longer this holder's."""
        return bool(_refresh(self.remote, self))

    def release(self) -> None:
        _release(self.remote, self)


@remote_errors
def _refresh(remote: Transport, claim: Claim) -> bool:
    held = read_claim(remote, claim.dirname)
    if held is None or held.get("token") != claim.token:
        return False
    _write(remote, claim.dirname, claim.body())
    claim.refreshed = time.monotonic()
    return True


@remote_errors
def _release(remote: Transport, claim: Claim) -> None:
    held = read_claim(remote, claim.dirname)
    if held is not None and held.get("token") == claim.token:
        _remove(remote, claim.dirname)


def supports_claims(remote: object) -> bool:
    return isinstance(remote, Transport) and (remote.is_local or remote.is_s3)


@remote_errors
def try_claim(remote: Transport, dirname: str, ttl_s: float, owner: str = "") -> Claim | None:
    """The claim on `dirname`, or None while another holder's claim is alive. A claim past
    its expiry is taken over once."""
    if not DIRNAME_RE.fullmatch(dirname):
        raise ValueError(f"not an artifact directory name: {dirname!r}")
    claim = Claim(remote, dirname, uuid.uuid4().hex, ttl_s, owner or default_owner())
    for _ in range(2):
        if _create(remote, dirname, claim.body()):
            claim.refreshed = time.monotonic()
            return claim
        if live_holder(remote, dirname) is not None:
            return None
        _remove(remote, dirname)  # a dead holder's
    return None


@remote_errors
def live_holder(remote: Transport, dirname: str) -> str | None:
    """Who holds a live claim on `dirname` (its owner string), or None."""
    held = read_claim(remote, dirname)
    if held is None or float(held.get("expires", 0)) < time.time():
        return None
    return str(held.get("owner") or "another builder")


def read_claim(remote: Transport, dirname: str) -> dict[str, Any] | None:
    data = remote.read(CLAIMS_DIR, f"{dirname}.json")  # capped like a manifest
    if data is None:
        return None
    try:
        held = json.loads(data)
    except ValueError:
        return {}  # half-written or foreign: not alive (no expiry), taken over
    return held if isinstance(held, dict) else {}


def default_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _rel(dirname: str) -> str:
    return posixpath.join(ARTIFACTS_DIR, CLAIMS_DIR, f"{dirname}.json")


def _create(remote: Transport, dirname: str, body: bytes) -> bool:
    """Write the claim only where none exists; False when one does."""
    if remote.is_local:
        # Written beside it, then linked into place: a link is atomic and fails where the
        # name exists, so no reader ever sees a claim half-written.
        with nofollow.parent_dir(remote.root, _rel(dirname)) as (fd, name):
            tmp = f"{name}.{uuid.uuid4().hex[:8]}.tmp"
            with os.fdopen(os.open(tmp, CREATE_FLAGS, 0o644, dir_fd=fd), "wb") as f:
                f.write(body)
            try:
                os.link(tmp, name, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp, dir_fd=fd)
        return True
    if not remote.is_s3:
        raise ClaimsUnsupported(remote.url)
    try:
        with remote.fs.open(remote.path(CLAIMS_DIR, f"{dirname}.json"), "xb") as f:
            f.write(body)
    except FileExistsError:
        return False
    return True


def _write(remote: Transport, dirname: str, body: bytes) -> None:
    remote.put_bytes(CLAIMS_DIR, f"{dirname}.json", body)


def _remove(remote: Transport, dirname: str) -> None:
    try:
        remote.remove(CLAIMS_DIR, f"{dirname}.json")
    except FileNotFoundError:
        pass
