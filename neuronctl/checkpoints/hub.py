"""Hugging Face Hub downloads: a revision pinned to a commit sha, safetensors preferred.

The flow is one `model_info` call (resolves a branch or tag to a sha, lists the files), a file
selection made here (so config and tokenizer files are always taken and pickle weights skipped
whenever safetensors exist), then `snapshot_download` at the sha. A re-run finds every file in
the cache and transfers no file body.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
import shutil
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuronctl.errors import CheckpointError, NeuronctlError, NotFoundError, UsageError

# Always downloaded, whatever --include/--exclude say: what every consumer of a model needs.
ESSENTIAL = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "*.tiktoken",
)


def model_files(directory: Path) -> list[Path]:
    """The ESSENTIAL files present in a checkpoint directory (globs expanded): what an artifact
    carries beside its graphs and weights, so what its key must cover."""
    found = {p for pattern in ESSENTIAL for p in directory.glob(pattern) if p.is_file()}
    return sorted(found)


def copy_model_files(model_dir: Path, staging: Path) -> None:
    """Config and tokenizer files into an artifact being built, so it is self-contained:
    serve/generate need nothing else. A file the backend already wrote is kept."""
    for src in model_files(model_dir):
        if not (staging / src.name).exists():
            shutil.copyfile(src, staging / src.name)


# Skipped when the repository has safetensors weights: the same weights in other formats.
DUPLICATE_WEIGHTS = (
    "*.bin",
    "*.pth",
    "*.pt",
    "original/*",
    "consolidated*",
    "*.h5",
    "*.msgpack",
    "*.ot",
)
SHA_RE = re.compile(r"^[0-9a-f]{40}$")
GATED = "this model is gated: accept its license on the Hub and set HF_TOKEN"

logger = logging.getLogger(__name__)


@dataclass
class Download:
    repo_id: str
    revision: str | None  # what was asked for (branch, tag, sha) or None for the default
    sha: str  # the commit it resolved to
    path: Path
    files: list[str]


def offline() -> bool:
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in {"1", "ON", "YES", "TRUE"} or bool(constants.HF_HUB_OFFLINE)


def cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now (not at import)."""
    if env := os.environ.get("HF_HUB_CACHE"):
        return Path(env)
    if env := os.environ.get("HF_HOME"):
        return Path(env) / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def endpoint() -> str:
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


def select_files(
    files: Iterable[str], include: Sequence[str] = (), exclude: Sequence[str] = ()
) -> list[str]:
    """The files to download: essentials always; otherwise --include/--exclude, and no
    duplicate weight formats when safetensors exist."""
    files = sorted(files)
    skip = list(exclude)
    if any(f.endswith(".safetensors") for f in files):
        skip += DUPLICATE_WEIGHTS
    chosen = []
    for name in files:
        if _matches(name, ESSENTIAL):
            chosen.append(name)
        elif (not include or _matches(name, include)) and not _matches(name, skip):
            chosen.append(name)
    return chosen


def _matches(name: str, patterns: Iterable[str]) -> bool:
    base = name.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatch(name, p) or fnmatch.fnmatch(base, p) for p in patterns)


def resolve_revision(repo_id: str, revision: str | None) -> tuple[str, list[str]]:
    """(commit sha, file names) of `repo_id` at `revision` (default branch if None)."""
    from huggingface_hub import HfApi

    logger.debug("resolving %s at %s on %s", repo_id, revision or "the default branch", endpoint())
    with hub_errors(repo_id, revision):
        info = HfApi(endpoint=endpoint()).model_info(repo_id, revision=revision)
    if not info.sha:
        raise CheckpointError(f"the Hub did not return a commit for {repo_id}")
    files = [s.rfilename for s in info.siblings or []]
    asked = revision or "the default branch"
    logger.info("%s at %s is commit %s (%d files)", repo_id, asked, info.sha, len(files))
    return info.sha, files


def download(
    repo_id: str,
    revision: str | None = None,
    *,
    local_dir: Path | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    show_progress: bool = False,
) -> Download:
    """Download (or find in the cache) `repo_id` at `revision`; see the module docstring.

    `show_progress` shows huggingface_hub's own bars, as `hf download` does
    (HF_HUB_DISABLE_PROGRESS_BARS=1 turns them off)."""
    from huggingface_hub import snapshot_download

    if offline():
        logger.info("HF_HUB_OFFLINE is set: looking for %s in the local cache only", repo_id)
        return _from_cache(repo_id, revision, local_dir)
    sha, files = resolve_revision(repo_id, revision)
    chosen = select_files(files, include, exclude)
    logger.info("fetching %d of %d files of %s@%s", len(chosen), len(files), repo_id, sha)
    logger.debug("chosen: %s", ", ".join(chosen))
    with hub_errors(repo_id, revision):
        path = snapshot_download(
            repo_id,
            revision=sha,
            allow_patterns=chosen,
            local_dir=local_dir,
            cache_dir=cache_dir(),
            endpoint=endpoint(),
            tqdm_class=_bars(show_progress),
            max_workers=4,
        )
    if local_dir is None:
        remember_ref(repo_id, revision or "main", sha)
    logger.info("%s@%s is at %s", repo_id, sha, path)
    return Download(repo_id, revision, sha, Path(path), chosen)


def remember_ref(repo_id: str, revision: str, sha: str) -> None:
    """Record branch/tag -> sha in the cache (snapshot_download skips it when given a sha), so
    an offline run can still resolve the name."""
    if SHA_RE.match(revision):
        return
    from huggingface_hub.file_download import repo_folder_name

    ref = cache_dir() / repo_folder_name(repo_id=repo_id, repo_type="model") / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    if not ref.is_file() or ref.read_text() != sha:
        tmp = ref.with_name(f".{ref.name}.{os.getpid()}.tmp")
        tmp.write_text(sha)
        os.replace(tmp, ref)
        logger.debug("recorded %s %s -> %s in the cache", repo_id, revision, sha)


def _from_cache(repo_id: str, revision: str | None, local_dir: Path | None) -> Download:
    from huggingface_hub import snapshot_download

    with hub_errors(repo_id, revision):
        path = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                local_dir=local_dir,
                cache_dir=cache_dir(),
                local_files_only=True,
            )
        )
    sha = path.name if SHA_RE.match(path.name) else (revision or "")
    files = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    files = [f for f in files if not f.startswith(".cache/")]
    logger.info("%s@%s found in the local cache at %s", repo_id, sha or "?", path)
    return Download(repo_id, revision, sha, path, files)


def snapshot(repo_id: str, revision: str | None, cache_only: bool = False) -> tuple[Path, str]:
    """(local directory, commit sha) for a Hub id: downloaded, or the cache only."""
    if cache_only:
        result = _from_cache(repo_id, revision, None)
    else:
        result = download(repo_id, revision)
    return result.path, result.sha


@contextmanager
def hub_errors(repo_id: str, revision: str | None) -> Iterator[None]:
    """Turn huggingface_hub exceptions into one-line neuronctl errors."""
    try:
        yield
    except NeuronctlError:
        raise
    except Exception as exc:
        mapped = map_hub_error(exc, repo_id, revision)
        if mapped is None:
            raise
        logger.debug("huggingface_hub raised (shown as: %s)", mapped, exc_info=exc)
        raise mapped from None


# The HTTP clients huggingface_hub has used (requests up to 0.x, httpx, httpx2 in 1.x-2.x):
# their transport errors (refused, DNS, TLS, timeouts) reach us unwrapped. Matched by module
# so that no version of the hub needs a client it does not depend on.
HTTP_CLIENT_MODULES = frozenset({"requests", "urllib3", "httpx", "httpx2", "httpcore"})


def map_hub_error(exc: BaseException, repo_id: str, revision: str | None) -> NeuronctlError | None:
    """A one-line error for what huggingface_hub raised, through its public exception types
    (`huggingface_hub.errors`) and the transport errors of whichever HTTP client it uses."""
    from huggingface_hub import errors

    rev = f" at revision {revision}" if revision else ""
    if isinstance(exc, errors.HFValidationError):  # a malformed id, before any request
        return UsageError(f"{repo_id!r} is not a Hub model id", "use ORG/NAME, or a local path")
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, errors.GatedRepoError) or status in (401, 403):
        return CheckpointError(
            f"{repo_id}: {GATED}",
            "if it is private, set HF_TOKEN to a token with read access to it",
        )
    if isinstance(exc, errors.RevisionNotFoundError):
        return NotFoundError(f"{repo_id} has no revision {revision!r} on the Hub")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return NotFoundError(f"no model {repo_id!r} on the Hub", "check the id (owner/name)")
    if isinstance(exc, errors.LocalEntryNotFoundError | errors.OfflineModeIsEnabled):
        return CheckpointError(
            f"{repo_id}{rev} is not in the local Hugging Face cache ({cache_dir()}) "
            "and downloads are off (HF_HUB_OFFLINE=1)",
            f"run `neuronctl download {repo_id}` with network access first",
        )
    transport = type(exc).__module__.split(".")[0] in HTTP_CLIENT_MODULES
    if transport or isinstance(exc, errors.HfHubHTTPError | ConnectionError | TimeoutError):
        return CheckpointError(
            f"cannot download {repo_id}{rev} from {endpoint()}: {str(exc).splitlines()[0]}",
            "check the network, or set HF_HUB_OFFLINE=1 to use the local cache",
        )
    return None


def _bars(show: bool) -> Any:
    """The tqdm class for snapshot_download: None for huggingface_hub's own bars, else that
    class switched off, for callers that print nothing (--json, and checkpoints opened by
    compile or serve)."""
    if show:
        return None
    from huggingface_hub.utils import tqdm

    class NoBars(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "disable": True})

    return NoBars
