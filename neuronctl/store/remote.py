"""Remote artifact stores over fsspec: a shared mount (file://), S3 (s3://), the Hub (hf://).

A remote store has the local layout: `<url>/neuron-compiled-artifacts/<dirname>/...`, and the
same completeness rule: an artifact is complete when its manifest.json exists, so push uploads
manifest.json last and pull trusts nothing the manifest does not vouch for.

How push knows a remote file's sha256 without downloading it:
  1. the remote manifest.json of an earlier push lists every file's size and sha256;
  2. on S3 every object neuronctl uploads carries its sha256 as user metadata
     (`x-amz-meta-sha256`), which lets an interrupted push (no manifest yet) resume;
  a file whose remote size and sha256 (from either source) match the local one is skipped.
  Neither source re-reads the remote bytes; `push --force` uploads everything again.
Pull re-hashes every downloaded byte before the artifact becomes visible.
"""

from __future__ import annotations

import functools
import os
import posixpath
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from fsspec.callbacks import Callback

from neuronctl.errors import NeuronctlError, NotFoundError, UsageError
from neuronctl.keys import KEY_LENGTH
from neuronctl.progress import NullProgress, Progress
from neuronctl.store.local import ARTIFACTS_DIR, Published, Store
from neuronctl.store.manifest import MANIFEST, FileEntry, Manifest, is_intact, read_manifest

SHA_METADATA = "sha256"  # S3 user metadata key holding an object's sha256
TRANSFER_THREADS = 4  # files moved at once; s3fs also splits large files into ranged parts


class RemoteArtifactError(NeuronctlError):
    """A remote artifact is incomplete, corrupted or not what its name says."""


class RemoteUnreachableError(NeuronctlError):
    """The remote store could not be reached: network, credentials, permissions."""


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


def _unreachable(url: str, exc: Exception) -> RemoteUnreachableError | None:
    module = type(exc).__module__.split(".")[0]
    if not isinstance(exc, OSError) and module not in _TRANSPORT_MODULES:
        return None  # a bug: let it surface as one
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
        hint = (
            "set AWS credentials (AWS_PROFILE, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY); "
            "AWS_ENDPOINT_URL selects an S3-compatible server"
        )
    else:
        hint = "check the URL, the network and the credentials"
    return RemoteUnreachableError(f"remote store {url}: {reason}", hint)


def _remote_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """Turn transport failures (no credentials, DNS, refused, denied) into one-line errors."""

    @functools.wraps(method)
    def wrapper(self: RemoteStore, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except NeuronctlError:
            raise
        except Exception as exc:
            mapped = _unreachable(self.url, exc)
            if mapped is None:
                raise
            raise mapped from None

    return wrapper


@dataclass
class PushResult:
    url: str  # the remote artifact directory
    dirname: str
    artifact_key: str
    uploaded: list[str] = field(default_factory=list)  # relative paths, manifest.json included
    skipped: list[str] = field(default_factory=list)
    uploaded_bytes: int = 0
    skipped_bytes: int = 0

    @property
    def noop(self) -> bool:
        return not self.uploaded


class _BytesCallback(Callback):
    """fsspec reports bytes per transfer; forward them to a progress advance, thread-safely
    enough for a progress bar (rich's advance takes its own lock)."""

    def __init__(self, advance: Callable[[float], None]) -> None:
        super().__init__()
        self.advance = advance
        self.reported = 0

    def call(self, *args: Any, **kwargs: Any) -> None:
        pass

    def relative_update(self, inc: int = 1) -> None:
        self.reported += inc
        self.advance(inc)

    def absolute_update(self, value: int) -> None:
        self.relative_update(value - self.reported)

    def finish(self, size: int) -> None:
        """Account for bytes a file system did not report (LocalFileSystem reports none)."""
        if size > self.reported:
            self.relative_update(size - self.reported)


def _fs_options(protocol: str) -> dict[str, Any]:
    # A fresh instance per store: s3fs caches instances and listings per process, which would
    # hide objects another process just pushed and keep stale credentials/endpoints.
    options: dict[str, Any] = {"skip_instance_cache": True}
    if protocol in ("s3", "s3a"):
        options["use_listings_cache"] = False
    if protocol in ("file", "local"):
        options["auto_mkdir"] = True
    return options


def open_remote(url: str) -> RemoteStore:
    """A remote store from a URL; a plain path means a shared mount (file://)."""
    import fsspec.core

    url = url.rstrip("/")
    if not url:
        raise UsageError("empty remote store URL", "e.g. s3://my-bucket/neuron")
    if "://" not in url:
        url = "file://" + os.path.abspath(os.path.expanduser(url))
    protocol = url.split("://", 1)[0]
    try:
        fs, root = fsspec.core.url_to_fs(url, **_fs_options(protocol))
    except ImportError as exc:
        raise UsageError(f"{protocol}:// needs an extra package: {exc}") from None
    except ValueError as exc:
        raise UsageError(f"cannot open remote store {url!r}: {exc}") from None
    except Exception as exc:  # some file systems connect at once (ftp://, sftp://)
        mapped = _unreachable(url, exc)
        if mapped is None:
            raise
        raise mapped from None
    return RemoteStore(fs, root.rstrip("/"), url)


class RemoteStore:
    def __init__(self, fs: Any, root: str, url: str) -> None:
        self.fs = fs
        self.url = url
        self.artifacts = posixpath.join(root, ARTIFACTS_DIR)
        self.is_local = "file" in _protocols(fs)
        self.is_s3 = "s3" in _protocols(fs)

    def path(self, dirname: str, rel: str = "") -> str:
        return (
            posixpath.join(self.artifacts, dirname, rel)
            if rel
            else posixpath.join(self.artifacts, dirname)
        )

    def artifact_url(self, dirname: str) -> str:
        return f"{self.url}/{ARTIFACTS_DIR}/{dirname}"

    # -- reading ------------------------------------------------------------------------------

    @_remote_errors
    def has(self, dirname: str) -> bool:
        """A remote artifact is complete when its manifest.json exists."""
        return bool(self.fs.exists(self.path(dirname, MANIFEST)))

    @_remote_errors
    def manifest(self, dirname: str) -> Manifest | None:
        try:
            data = self.fs.cat_file(self.path(dirname, MANIFEST))
        except FileNotFoundError:
            return None
        try:
            return Manifest.model_validate_json(data)
        except ValueError:
            raise RemoteArtifactError(
                f"{self.artifact_url(dirname)}/{MANIFEST} is not a neuronctl manifest",
                "push the artifact again with `neuronctl artifacts push`",
            ) from None

    @_remote_errors
    def sizes(self, dirname: str) -> dict[str, int]:
        """Every remote file of an artifact with its size, by relative path."""
        base = self.path(dirname)
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        sizes = {}
        for name, info in found.items():
            rel = _relative(name, base)
            if rel and info.get("type", "file") == "file":
                sizes[rel] = int(info["size"])
        return sizes

    @_remote_errors
    def list_keys(self) -> list[str]:
        """Directory names of complete remote artifacts."""
        try:
            entries = self.fs.ls(self.artifacts, detail=False)
        except FileNotFoundError:
            return []
        names = sorted(posixpath.basename(e.rstrip("/")) for e in entries)
        return [n for n in names if not n.startswith(".") and self.has(n)]

    @_remote_errors
    def resolve(self, key_or_prefix: str) -> str:
        """A directory name from a full artifact key, a directory name or a unique prefix."""
        key = key_or_prefix.strip("/")
        if not key or "/" in key or key.startswith("."):
            raise UsageError(f"{key_or_prefix!r} is not an artifact key")
        if len(key) >= KEY_LENGTH:
            return key[:KEY_LENGTH]
        matches = [name for name in self.list_keys() if name.startswith(key)]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise NotFoundError(f"no artifact {key!r} in {self.url}")
        raise UsageError(f"{key!r} matches several remote artifacts: {', '.join(matches)}")

    # -- push ---------------------------------------------------------------------------------

    @_remote_errors
    def push(
        self, artifact: Path, progress: Progress | None = None, *, force: bool = False
    ) -> PushResult:
        """Upload a local artifact: every file, then manifest.json last."""
        artifact = Path(artifact)
        local = read_manifest(artifact)
        _check_local(artifact, local)
        dirname = artifact.name
        result = PushResult(self.artifact_url(dirname), dirname, local.artifact_key)
        remote = self.manifest(dirname)
        if remote is not None and remote.artifact_key != local.artifact_key:
            raise RemoteArtifactError(
                f"{result.url} holds artifact {remote.artifact_key[:12]}, "
                f"not {local.artifact_key[:12]}",
                "remove the remote directory by hand; keys never collide by accident",
            )
        sizes = self.sizes(dirname)
        if not force and remote is not None and _complete(remote, sizes):
            # A complete artifact of this key is there: first push wins, even if this build's
            # bytes differ (compiles need not be bit-reproducible), so pullers never see a mix.
            result.skipped = [*remote.files, MANIFEST]
            result.skipped_bytes = remote.total_size()
            return result
        if remote is not None:
            # Repairing a damaged remote artifact: make it incomplete first.
            self.fs.rm_file(self.path(dirname, MANIFEST))
        todo = self._files_to_upload(dirname, local, remote, sizes, force, result)
        advance = (progress or NullProgress()).task(
            f"push {dirname}", total=sum(local.files[r].size for r in todo)
        )
        _run_all(lambda rel: self._upload(artifact, dirname, rel, local.files[rel], advance), todo)
        self._upload(artifact, dirname, MANIFEST, None, advance)
        result.uploaded = [*todo, MANIFEST]
        result.uploaded_bytes = sum(local.files[r].size for r in todo)
        return result

    def _files_to_upload(
        self,
        dirname: str,
        local: Manifest,
        remote: Manifest | None,
        sizes: dict[str, int],
        force: bool,
        result: PushResult,
    ) -> list[str]:
        todo = []
        for rel, entry in local.files.items():
            if not force and sizes.get(rel) == entry.size:
                if self._remote_sha256(dirname, rel, remote) == entry.sha256:
                    result.skipped.append(rel)
                    result.skipped_bytes += entry.size
                    continue
            todo.append(rel)
        return todo

    def _remote_sha256(self, dirname: str, rel: str, remote: Manifest | None) -> str | None:
        if remote is not None and rel in remote.files:
            return remote.files[rel].sha256
        if self.is_s3:
            try:
                return self.fs.metadata(self.path(dirname, rel)).get(SHA_METADATA)
            except FileNotFoundError:
                return None
        return None

    def _upload(
        self,
        artifact: Path,
        dirname: str,
        rel: str,
        entry: FileEntry | None,
        advance: Callable[[float], None],
    ) -> None:
        source = artifact / rel
        target = self.path(dirname, rel)
        callback = _BytesCallback(advance) if entry is not None else Callback()
        kwargs: dict[str, Any] = {}
        if self.is_s3 and entry is not None:
            kwargs["Metadata"] = {SHA_METADATA: entry.sha256}
        if self.is_local:
            # A shared mount has no atomic object PUT: copy beside, then rename into place.
            tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
            self.fs.put_file(str(source), tmp, callback=callback)
            os.replace(tmp, target)
        else:
            self.fs.put_file(str(source), target, callback=callback, **kwargs)
        if entry is not None:
            callback.finish(entry.size)

    # -- pull ---------------------------------------------------------------------------------

    @_remote_errors
    def pull(self, dirname: str, store: Store, progress: Progress | None = None) -> Published:
        """Download an artifact into `store`, verified, published atomically under its lock."""
        if "/" in dirname or dirname.startswith(".") or not dirname:
            raise UsageError(f"{dirname!r} is not an artifact directory name")
        state: dict[str, Any] = {}

        def build(staging: Path) -> Manifest:
            manifest = self._complete_manifest(dirname)
            state.update(staging=staging, manifest=manifest)
            self._download(dirname, manifest, staging, progress or NullProgress())
            return manifest

        def on_step(step: str) -> None:
            # Store.publish re-hashes the staged files into manifest.json before the rename;
            # checking that record against the remote manifest verifies every byte once.
            if step == "manifest-written":
                self._verify(dirname, state["manifest"], read_manifest(state["staging"]))

        return store.publish(dirname, build, reuse=is_intact, on_step=on_step)

    def _complete_manifest(self, dirname: str) -> Manifest:
        manifest = self.manifest(dirname)
        url = self.artifact_url(dirname)
        if manifest is None:
            if self.sizes(dirname):
                raise RemoteArtifactError(
                    f"{url} is incomplete: no {MANIFEST} (a push did not finish)",
                    "push it again with `neuronctl artifacts push`",
                )
            raise NotFoundError(f"no artifact {dirname} in {self.url}")
        if manifest.artifact_key[:KEY_LENGTH] != dirname:
            raise RemoteArtifactError(
                f"{url}/{MANIFEST} is for artifact {manifest.artifact_key[:KEY_LENGTH]}, "
                f"not {dirname}"
            )
        for rel in manifest.files:
            if not _safe_relative(rel):
                raise RemoteArtifactError(f"{url}/{MANIFEST} lists an unsafe path {rel!r}")
        return manifest

    def _download(
        self, dirname: str, manifest: Manifest, staging: Path, progress: Progress
    ) -> None:
        advance = progress.task(f"pull {dirname}", total=manifest.total_size())
        sizes = self.sizes(dirname)
        for rel, entry in manifest.files.items():
            if sizes.get(rel) != entry.size:
                found = "missing" if rel not in sizes else f"{sizes[rel]} bytes"
                raise RemoteArtifactError(
                    f"{self.artifact_url(dirname)}/{rel}: expected {entry.size} bytes, "
                    f"found {found}",
                    "the remote artifact is damaged; push it again with --force",
                )
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)

        def fetch(rel: str) -> None:
            callback = _BytesCallback(advance)
            self.fs.get_file(self.path(dirname, rel), str(staging / rel), callback=callback)
            callback.finish(manifest.files[rel].size)

        _run_all(fetch, list(manifest.files))

    def _verify(self, dirname: str, expected: Manifest, got: Manifest) -> None:
        for rel, entry in expected.files.items():
            have = got.files.get(rel)
            if have != entry:
                detail = "missing" if have is None else f"sha256 {have.sha256[:12]}…"
                raise RemoteArtifactError(
                    f"{self.artifact_url(dirname)}/{rel} is corrupted: expected sha256 "
                    f"{entry.sha256[:12]}…, got {detail}",
                    "the remote artifact is damaged; push it again with --force",
                )
        extra = sorted(set(got.files) - set(expected.files))
        if extra:
            raise RemoteArtifactError(f"unexpected file {extra[0]} in the pulled artifact")


def resolve_artifacts_arg(value: str, store: Store, progress: Progress | None = None) -> Path:
    """`--artifacts` value -> a local artifact directory; a remote URL is pulled first.

    Accepts `<store-url>/<KEY>` and `<store-url>/neuron-compiled-artifacts/<KEY>`.
    """
    if "://" not in value:
        return Path(value).expanduser()
    url, dirname = split_artifact_url(value)
    remote = open_remote(url)
    return remote.pull(remote.resolve(dirname), store, progress).path


def split_artifact_url(value: str) -> tuple[str, str]:
    """`s3://b/p/KEY` -> (`s3://b/p`, `KEY`), dropping a trailing neuron-compiled-artifacts."""
    value = value.rstrip("/")
    scheme, _, rest = value.partition("://")
    parent, _, key = rest.rpartition("/")
    if not parent or not key:
        raise UsageError(
            f"{value!r} does not name a remote artifact", "use URL/KEY, e.g. s3://bucket/prefix/KEY"
        )
    if posixpath.basename(parent) == ARTIFACTS_DIR:
        parent = posixpath.dirname(parent)
    return f"{scheme}://{parent}", key


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _relative(name: str, base: str) -> str:
    name, base = name.rstrip("/"), base.rstrip("/")
    # Object stores return "bucket/key"; a file system may return a leading slash or not.
    if name.lstrip("/").startswith(base.lstrip("/") + "/"):
        return name.lstrip("/")[len(base.lstrip("/")) + 1 :]
    return ""


def _safe_relative(rel: str) -> bool:
    path = PurePosixPath(rel)
    return bool(rel) and not path.is_absolute() and ".." not in path.parts and rel != MANIFEST


def _check_local(artifact: Path, manifest: Manifest) -> None:
    """Never publish a damaged local artifact: at least every file must have its size."""
    for rel, entry in manifest.files.items():
        path = artifact / rel
        size = path.stat().st_size if path.is_file() else None
        if size != entry.size:
            raise RemoteArtifactError(
                f"{path}: expected {entry.size} bytes, found {size}",
                f"check it with `neuronctl validate --deep {artifact}`",
            )


def _complete(remote: Manifest, sizes: dict[str, int]) -> bool:
    return all(sizes.get(rel) == entry.size for rel, entry in remote.files.items())


def _run_all(work: Callable[[str], None], items: list[str]) -> None:
    """Run `work` over items a few at a time; the first failure is raised."""
    if len(items) <= 1:
        for item in items:
            work(item)
        return
    with ThreadPoolExecutor(max_workers=TRANSFER_THREADS) as pool:
        for future in [pool.submit(work, item) for item in items]:
            future.result()
