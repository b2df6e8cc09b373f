"""Pull: a remote artifact into the local store, trusting nothing its signed manifest does not
vouch for. The signature is checked before anything is staged, every object is read no
further than its signed size, and every downloaded byte is re-hashed before the artifact
becomes visible; a failed pull leaves one copy in the store's .failed/, never a manifest."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from neuronctl.errors import NeuronctlError, NotFoundError, UsageError
from neuronctl.keys import KEY_LENGTH
from neuronctl.progress import NullProgress, Progress
from neuronctl.store.local import Published, Store
from neuronctl.store.manifest import MANIFEST, Manifest, is_intact, read_manifest
from neuronctl.store.remote.errors import (
    RemoteArtifactError,
    RemoteUnreachableError,
    on_this_host,
    remote_errors,
)
from neuronctl.store.remote.transport import DIRNAME_RE, Transport, entry_problem, run_all
from neuronctl.store.signing import (
    PROVENANCE,
    SIGNATURE_NAMES,
    Provenance,
    TrustPolicy,
    check_origin,
    differs_from,
    verified_record,
    verify,
)


@remote_errors
def pull_artifact(
    remote: Transport,
    dirname: str,
    store: Store,
    progress: Progress | None = None,
    policy: TrustPolicy | None = None,
    key: str = "",
) -> Published:
    """Download an artifact into `store`: signature checked against `policy` first, then
    every byte against the signed sha256 list, published atomically under its lock.

    `key` is the key as the user asked for it (a prefix of the artifact key, maybe all of
    it): the signed manifest's artifact key must start with every character of it.
    A local copy (pulled earlier, or built here) is a cache hit; its provenance is checked
    against `policy` just the same."""
    if not DIRNAME_RE.fullmatch(dirname):
        raise UsageError(f"{dirname!r} is not an artifact directory name")
    policy = policy if policy is not None else TrustPolicy.load()
    state: dict[str, Any] = {}

    def build(staging: Path) -> Manifest:
        manifest, provenance = checked_manifest(remote, dirname, policy, key)
        state.update(staging=staging, remote_bytes=provenance.manifest_bytes)
        _download(remote, dirname, manifest, staging, progress or NullProgress())
        (staging / PROVENANCE).write_text(provenance.to_json())
        return manifest

    def on_step(step: str) -> None:
        # Store.publish re-records the staged files into manifest.json; that record must be
        # the remote one, or the manifest goes before the staging dir is kept as a failure.
        if step == "manifest-written":
            staging = state["staging"]
            problem = differs_from(read_manifest(staging), state["remote_bytes"])
            if problem:
                (staging / MANIFEST).unlink()
                raise RemoteArtifactError(f"{remote.artifact_url(dirname)}: {problem}")

    if not is_intact(store.path(dirname)):
        # Refuse an untrusted remote before anything is staged; build checks it again
        # under the lock, on the bytes it then downloads against.
        checked_manifest(remote, dirname, policy, key)
    published = store.publish(dirname, build, reuse=is_intact, on_step=on_step)
    if published.cache_hit:
        local = read_manifest(published.path)
        _check_key(local.artifact_key, key, str(published.path))
        check_origin(published.path, local, policy)
    return published


@remote_errors
def check_artifact_trusted(
    remote: Transport, dirname: str, policy: TrustPolicy | None = None, key: str = ""
) -> None:
    """Raise unless `policy` trusts the remote artifact; nothing is downloaded."""
    checked_manifest(remote, dirname, policy if policy is not None else TrustPolicy.load(), key)


def _check_key(artifact_key: str, wanted: str, where: str) -> None:
    """Every character of the requested key must match: not only the directory name."""
    if wanted and not artifact_key.startswith(wanted.lower()):
        raise RemoteArtifactError(
            f"{where} is for artifact {artifact_key}, not {wanted}",
            "check the key in the URL (`neuronctl artifacts list` shows full keys)",
        )


def checked_manifest(
    remote: Transport, dirname: str, policy: TrustPolicy, key: str = ""
) -> tuple[Manifest, Provenance]:
    """The remote manifest, only after its signature and every path in it checked out."""
    url = remote.artifact_url(dirname)
    raw = remote.read(dirname, MANIFEST)
    if raw is None:
        if remote.sizes(dirname):
            raise RemoteArtifactError(
                f"{url} is incomplete: no {MANIFEST} (a push did not finish)",
                "push it again with `neuronctl artifacts push`",
            )
        raise NotFoundError(f"no artifact {dirname} in {remote.url}")
    signature = read_remote_signature(remote, dirname)
    vouch = verify(raw, signature, policy, url)  # raises unless trusted (or allowed unsigned)
    manifest = remote.parse_manifest(dirname, raw)  # the very bytes the signature covers
    if manifest.artifact_key[:KEY_LENGTH] != dirname:
        raise RemoteArtifactError(
            f"{url}/{MANIFEST} is for artifact {manifest.artifact_key[:KEY_LENGTH]}, "
            f"not {dirname}"
        )
    _check_key(manifest.artifact_key, key, f"{url}/{MANIFEST}")
    for rel in manifest.files:
        problem = entry_problem(rel)
        if problem:
            raise RemoteArtifactError(f"{url}/{MANIFEST} lists {rel!r}: {problem}")
    return manifest, verified_record(url, raw, signature, vouch, policy)


def read_remote_signature(remote: Transport, dirname: str) -> bytes | None:
    """A remote artifact's signature: model.sig, else the legacy manifest.sig."""
    for name in SIGNATURE_NAMES:
        data = remote.read(dirname, name)
        if data is not None:
            return data
    return None


def _download(
    remote: Transport, dirname: str, manifest: Manifest, staging: Path, progress: Progress
) -> None:
    """Fetch every listed file and check its sha256 before the manifest is written, so a
    failed pull never leaves a directory whose manifest vouches for bad bytes."""
    advance = progress.task(f"pull {dirname}", total=manifest.total_size())
    sizes = remote.sizes(dirname)
    for rel, entry in manifest.files.items():
        if sizes.get(rel) != entry.size:
            found = "missing" if rel not in sizes else f"{sizes[rel]} bytes"
            raise RemoteArtifactError(
                f"{remote.artifact_url(dirname)}/{rel}: expected {entry.size} bytes, "
                f"found {found}",
                "the remote artifact is damaged; push it again with --force",
            )
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)

    def fetch(rel: str) -> None:
        got = _fetch(remote, dirname, rel, manifest.files[rel].size, staging / rel, advance)
        if got != manifest.files[rel].sha256:
            raise RemoteArtifactError(
                f"{remote.artifact_url(dirname)}/{rel} is corrupted: expected sha256 "
                f"{manifest.files[rel].sha256[:12]}…, got {got[:12]}…",
                "the remote artifact is damaged; push it again with --force",
            )

    run_all(fetch, list(manifest.files))


def _fetch(
    remote: Transport,
    dirname: str,
    rel: str,
    size: int,
    dest: Path,
    advance: Callable[[float], None],
) -> str:
    """Copy one object, never more than its signed size (an object that grew after its
    size was checked is refused, not downloaded whole); returns the sha256 of the bytes
    written."""
    digest = hashlib.sha256()
    left = size
    where = f"{remote.artifact_url(dirname)}/{rel}"
    with remote.open_object(dirname, rel) as src:
        out = on_this_host(lambda: open_output(dest), dest)
        try:
            while left > 0 and (
                chunk := read_within(src, min(READ_CHUNK, left), where, size - left, size)
            ):
                digest.update(chunk)
                on_this_host(lambda: out.write(chunk), dest)
                left -= len(chunk)
                advance(len(chunk))
        finally:
            on_this_host(out.close, dest)  # a full disk may say so only at the flush
        grew = bool(read_within(src, 1, where, size - left, size))
    if left or grew:
        raise RemoteArtifactError(
            f"{remote.artifact_url(dirname)}/{rel} changed size during the pull "
            f"(signed: {size} bytes)",
            "the remote artifact is being rewritten; pull again, or push it again with "
            "--force",
        )
    return digest.hexdigest()


# Each read of a pulled object must bring bytes within READ_STALL_SECONDS: a remote that drips a
# byte every few seconds never trips a socket's read timeout (each byte resets it), and held
# the key's lock for good. READ_CHUNK in READ_STALL_SECONDS is the slowest transfer accepted.
READ_CHUNK = 1024 * 1024
READ_STALL_SECONDS = 60.0


def read_within(src: Any, n: int, where: str, done: int, size: int) -> bytes:
    """src.read(n) on a daemon thread, waited for at most READ_STALL_SECONDS (a read that never
    returns cannot be interrupted; it is left behind and the pull fails, releasing its
    lock). Whatever a read raises mid-object is a remote failure said as one."""
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(_attempt(src, n)), daemon=True)
    thread.start()
    thread.join(READ_STALL_SECONDS)
    if not box:
        raise RemoteUnreachableError(
            f"{where}: no data for {READ_STALL_SECONDS:.0f} s at {done} of {size} bytes: the "
            "remote stalled",
            "check the network and the remote store, then pull again",
        )
    result = box[0]
    if isinstance(result, BaseException):
        if isinstance(result, NeuronctlError):
            raise result
        raise RemoteUnreachableError(
            f"{where}: the transfer broke off at {done} of {size} bytes "
            f"({type(result).__name__}: {result})",
            "check the network and the remote store, then pull again",
        ) from result
    return bytes(result)


def _attempt(src: Any, n: int) -> Any:
    try:
        return src.read(n)
    except BaseException as exc:  # handed back to the pulling thread
        return exc


def open_output(dest: Path) -> Any:
    """Where a pulled file is written (a seam: tests make it a full disk)."""
    return open(dest, "wb")
