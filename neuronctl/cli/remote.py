"""`neuronctl artifacts push | pull`: share artifacts through a remote store (S3, a mount, Hub)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from neuronctl.cli._common import JsonOpt, StoreOpt, console, human_size, print_json
from neuronctl.cli._groups import artifacts_app
from neuronctl.cli._progress import progress_for
from neuronctl.store.manifest import read_manifest
from neuronctl.store.remote import open_remote, split_artifact_url
from neuronctl.store.resolve import open_store

ORDER = 41
REMOTE_ENV = "NEURONCTL_REMOTE"

UrlArg = Annotated[
    str,
    typer.Argument(
        help="Remote store: s3://BUCKET/PREFIX, file:///mnt/shared or a path, hf://... "
        f"(default: ${REMOTE_ENV}).",
        envvar=REMOTE_ENV,
        show_default=False,
    ),
]


def _local_artifact(key_or_path: str, store: Path | None) -> Path:
    return open_store(store).resolve(key_or_path)


@artifacts_app.command("push")
def push_command(
    artifact: Annotated[
        str, typer.Argument(help="Artifact key, directory name, unique prefix, or a path.")
    ],
    url: UrlArg,
    store: StoreOpt = None,
    force: Annotated[
        bool, typer.Option("--force", help="Upload every file even if the remote has it.")
    ] = False,
    json_out: JsonOpt = False,
) -> None:
    """Upload an artifact to a remote store; manifest.json goes last, marking it complete.

    Files already remote with the same size and sha256 are skipped, so a re-push is a no-op.
    S3 uses the standard AWS credential chain; AWS_ENDPOINT_URL selects an S3-compatible server.

    Example: neuronctl artifacts push 3f9c2a s3://my-bucket/neuron

    Exit codes: 0 pushed (or already there), 1 not found or the remote refused, 2 usage.
    """
    path = _local_artifact(artifact, store)
    with progress_for(json_out, bytes_=True) as progress:
        result = open_remote(url).push(path, progress, force=force)
    data = {
        "url": result.url,
        "key": result.dirname,
        "artifact_key": result.artifact_key,
        "uploaded": result.uploaded,
        "uploaded_bytes": result.uploaded_bytes,
        "skipped_files": len(result.skipped),
        "skipped_bytes": result.skipped_bytes,
        "noop": result.noop,
    }
    if json_out:
        print_json(data)
    elif result.noop:
        console.print(f"{result.url} is already complete; nothing uploaded")
    else:
        console.print(
            f"pushed {result.url}: {len(result.uploaded)} files, "
            f"{human_size(result.uploaded_bytes)} uploaded, "
            f"{len(result.skipped)} files ({human_size(result.skipped_bytes)}) already there"
        )


@artifacts_app.command("pull")
def pull_command(
    url: Annotated[
        str,
        typer.Argument(
            help="URL/KEY of a remote artifact, e.g. s3://bucket/prefix/3f9c2a (a unique "
            "key prefix is enough; .../neuron-compiled-artifacts/KEY works too)."
        ),
    ],
    store: StoreOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Download a remote artifact, verify every sha256, publish it atomically in a local store.

    Two pulls of one key (even from two processes) download it once; an interrupted pull
    leaves nothing that looks like an artifact.

    Example: neuronctl artifacts pull s3://my-bucket/neuron/3f9c2a --store /var/lib/neuron

    Exit codes: 0 pulled (or already local), 1 not found / corrupted / incomplete, 2 usage.
    """
    if "://" not in url:  # a plain path is a shared mount, as push takes it
        url = Path(url).expanduser().absolute().as_uri()
    store_url, key = split_artifact_url(url)
    remote = open_remote(store_url)
    local = open_store(store)
    dirname = remote.resolve(key)
    with progress_for(json_out, bytes_=True) as progress:
        published = remote.pull(dirname, local, progress)
    manifest = read_manifest(published.path)
    data = {
        "path": str(published.path),
        "key": dirname,
        "artifact_key": manifest.artifact_key,
        "cache_hit": published.cache_hit,
        "downloaded_bytes": 0 if published.cache_hit else manifest.total_size(),
    }
    if json_out:
        print_json(data)
    elif published.cache_hit:
        console.print(f"already in the local store: {published.path}")
    else:
        console.print(f"pulled {human_size(manifest.total_size())} into {published.path}")


def register(app: typer.Typer) -> None:
    """Commands attach to `artifacts_app`, which cli/artifacts.py adds to the app."""
