"""What goes wrong with a remote store, as one-line errors that say whose fault it is: the
remote artifact (damaged, incomplete), the remote itself (network, credentials), or this
host's disk (full, read-only), never one blamed for another."""

from __future__ import annotations

import errno
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from neuronctl.errors import NeuronctlError


class RemoteArtifactError(NeuronctlError):
    """A remote artifact is incomplete, corrupted or not what its name says."""


class RemoteUnreachableError(NeuronctlError):
    """The remote store could not be reached: network, credentials, permissions."""


class LocalDiskError(NeuronctlError):
    """This host's disk refused a write (full, read-only, no permission): not the remote."""


LOCAL_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


def local_disk_error(exc: OSError, path: Path | str | None = None) -> LocalDiskError:
    where = path if path is not None else exc.filename
    return LocalDiskError(
        f"cannot write {where} on this host: {exc.strerror or exc}",
        "free space on that disk or make it writable, or use another store (--store, "
        "$NEURONCTL_STORE)",
    )


def on_this_host(action: Callable[[], Any], dest: Path) -> Any:
    """A write to this host's disk: its failure is reported as local, never as the remote."""
    try:
        return action()
    except OSError as exc:
        raise local_disk_error(exc, dest) from None


# Libraries whose exceptions mean "the remote said no or could not be reached".
_TRANSPORT_MODULES = frozenset(
    {
        "botocore",
        "aiobotocore",
        "aiohttp",
        "s3fs",
        "fsspec",
        "huggingface_hub",
        "httpx",
        "requests",
        "urllib3",
    }
)


def unreachable(url: str, exc: Exception) -> RemoteUnreachableError | None:
    module = type(exc).__module__.split(".")[0]
    if not isinstance(exc, OSError) and module not in _TRANSPORT_MODULES:
        return None  # a bug: let it surface as one
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "checksum" in type(exc).__name__.lower() or "checksum" in reason.lower():
        # The client's own integrity check (botocore's FlexibleChecksumError): the bytes
        # changed on the way, not the address.
        hint = (
            "the bytes were corrupted in transit (or on the remote): pull again; if it "
            "repeats, push the artifact again with --force"
        )
    elif type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
        hint = (
            "set AWS credentials (AWS_PROFILE, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY); "
            "AWS_ENDPOINT_URL selects an S3-compatible server"
        )
    else:
        hint = "check the URL, the network and the credentials"
    return RemoteUnreachableError(f"remote store {url}: {reason}", hint)


def remote_errors(operation: Callable[..., Any]) -> Callable[..., Any]:
    """Turn transport failures (no credentials, DNS, refused, denied) into one-line errors.

    Wraps an operation whose first argument is the remote store (transport.Transport)."""

    @functools.wraps(operation)
    def wrapper(remote: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return operation(remote, *args, **kwargs)
        except NeuronctlError:
            raise
        except Exception as exc:
            if isinstance(exc, OSError) and _is_local_disk(remote, exc):
                raise local_disk_error(exc) from None
            mapped = unreachable(remote.url, exc)
            if mapped is None:
                raise
            raise mapped from None

    return wrapper


def _is_local_disk(remote: Any, exc: OSError) -> bool:
    """A write refused by a disk of this host (the store, its staging), not by the remote: an
    absolute local path outside a shared-mount remote."""
    if exc.errno not in LOCAL_DISK_ERRNOS:
        return False
    name = str(exc.filename or "")
    if not name.startswith("/"):
        return False
    return not (remote.is_local and name.startswith(remote.artifacts.rstrip("/") + "/"))
