"""`neuronctl artifacts push | pull | keygen`: share artifacts through a remote store (S3, a
mount, the Hub), signed by the publisher and verified by every puller."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from neuronctl.cli._common import (
    REMOTE_ENV,
    AllowUnsignedOpt,
    JsonOpt,
    SignKeyOpt,
    StoreOpt,
    TrustKeyOpt,
    console,
    err_console,
    human_size,
    print_json,
)
from neuronctl.cli._groups import artifacts_app
from neuronctl.cli._progress import progress_for
from neuronctl.store.manifest import read_manifest
from neuronctl.store.remote.client import open_remote
from neuronctl.store.remote.urls import split_artifact_url
from neuronctl.store.resolve import open_store
from neuronctl.store.signing import (
    SIGNING_KEY_ENV,
    TRUSTED_KEYS_ENV,
    UNSIGNED,
    TrustPolicy,
    check_origin,
    generate_keypair,
    load_signer,
    trusted_keys_dir,
)

ORDER = 41

UrlArg = Annotated[
    str,
    typer.Argument(
        help="Remote store: s3://BUCKET/PREFIX, oci://REGISTRY/REPO, file:///mnt/shared or a "
        "path, hf://... "
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
        bool,
        typer.Option("--force", help="Upload every file, replacing what the remote holds."),
    ] = False,
    sign_key: SignKeyOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Upload an artifact to a remote store; its signature and then manifest.json go last.

    Files already remote with the same size and sha256 are skipped, so a re-push is a no-op.
    With a signing key (--sign-key or $NEURONCTL_SIGNING_KEY) the manifest, which lists the
    sha256 of every file, is signed; pullers verify it against the keys they trust.
    S3 uses the standard AWS credential chain; AWS_ENDPOINT_URL selects an S3-compatible server.
    oci://REGISTRY/REPO pushes one OCI artifact tagged with the key (a layer per file); its
    credentials come from `docker login` / `oras login` (docker config.json) or ORAS_USER
    and ORAS_PASS.

    Example: neuronctl artifacts push 3f9c2a s3://my-bucket/neuron --sign-key ci.key

    Example: neuronctl artifacts push 3f9c2a oci://ghcr.io/my-org/neuron --sign-key ci.key

    Exit codes: 0 pushed (or already there), 1 not found or the remote refused, 2 usage.
    """
    path = _local_artifact(artifact, store)
    signer = load_signer(sign_key)
    with progress_for(json_out, bytes_=True) as progress:
        result = open_remote(url).push(path, progress, force=force, signer=signer)
    data = {
        "url": result.url,
        "key": result.dirname,
        "artifact_key": result.artifact_key,
        "uploaded": result.uploaded,
        "uploaded_bytes": result.uploaded_bytes,
        "skipped_files": len(result.skipped),
        "skipped_bytes": result.skipped_bytes,
        "noop": result.noop,
        "signed_by": result.signed_by,
    }
    signed = f" (signed by key {result.signed_by})" if result.signed_by else " (unsigned)"
    if json_out:
        print_json(data)
    elif result.noop:
        console.print(f"{result.url} is already complete; nothing uploaded{signed}")
    else:
        console.print(
            f"pushed {result.url}: {len(result.uploaded)} files, "
            f"{human_size(result.uploaded_bytes)} uploaded, "
            f"{len(result.skipped)} files ({human_size(result.skipped_bytes)}) already there"
            f"{signed}"
        )


@artifacts_app.command("pull")
def pull_command(
    url: Annotated[
        str,
        typer.Argument(
            help="URL/KEY of a remote artifact, e.g. s3://bucket/prefix/3f9c2a (a unique "
            "key prefix is enough; .../neuron-compiled-artifacts/KEY and a plain path to a "
            "shared mount work too), or oci://REGISTRY/REPO:KEY (or :TAG, @sha256:DIGEST)."
        ),
    ],
    store: StoreOpt = None,
    trust_key: TrustKeyOpt = None,
    allow_unsigned: AllowUnsignedOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Download a remote artifact, verify its signature and every sha256, publish it
    atomically in a local store.

    The signature must be by a trusted key (--trust-key, $NEURONCTL_TRUSTED_KEYS,
    ~/.config/neuronctl/trusted-keys/); an unsigned or otherwise signed artifact is refused
    unless --allow-unsigned. The pull's record (provenance.json) names the key that verified
    it, so later loads need no --trust-key until that key is revoked
    ($NEURONCTL_REVOKED_KEYS, ~/.config/neuronctl/revoked-keys/). Two pulls of one key (even
    from two processes) download it once; an interrupted or failed pull leaves nothing that
    looks like an artifact.

    Example: neuronctl artifacts pull s3://my-bucket/neuron/3f9c2a --store /var/lib/neuron

    Example: neuronctl artifacts pull oci://ghcr.io/my-org/neuron:3f9c2a

    Exit codes: 0 pulled (or already local), 1 not found / corrupted / incomplete /
    untrusted, 2 usage.
    """
    if "://" not in url:  # a plain path is a shared mount, as push takes it
        url = Path(url).expanduser().absolute().as_uri()
    store_url, key = split_artifact_url(url)
    remote = open_remote(store_url)
    local = open_store(store)
    policy = TrustPolicy.load(trust_key, allow_unsigned)
    dirname = remote.resolve(key)
    with progress_for(json_out, bytes_=True) as progress:
        published = remote.pull(dirname, local, progress, policy, key)
    manifest = read_manifest(published.path)
    vouch = check_origin(published.path, manifest, policy)
    if vouch.kind == UNSIGNED:
        err_console.print(f"[yellow]warning:[/yellow] {vouch.describe()}", soft_wrap=True)
    data = {
        "path": str(published.path),
        "key": dirname,
        "artifact_key": manifest.artifact_key,
        "cache_hit": published.cache_hit,
        "downloaded_bytes": 0 if published.cache_hit else manifest.total_size(),
        # a registry pull knows what it reused from an interrupted one
        "reused_bytes": getattr(remote, "reused_bytes", 0),
        "trusted": vouch.kind,
        "key_id": vouch.key_id,
    }
    if hasattr(remote, "downloaded_bytes") and not published.cache_hit:
        data["downloaded_bytes"] = remote.downloaded_bytes
    if json_out:
        print_json(data)
    elif published.cache_hit:
        console.print(f"already in the local store: {published.path}")
    else:
        console.print(f"pulled {human_size(manifest.total_size())} into {published.path}")


@artifacts_app.command("keygen")
def keygen_command(
    name: Annotated[
        Path, typer.Argument(help="Path prefix: writes NAME.key (private) and NAME.pub.")
    ],
    force: Annotated[bool, typer.Option("--force", help="Overwrite existing files.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Make an EC P-256 key pair for signing artifacts (OpenSSF model-signing's key format).

    NAME.key signs (keep it in your CI's secret store; push reads it from --sign-key or
    $NEURONCTL_SIGNING_KEY). NAME.pub verifies: put it on every host that pulls or installs,
    in ~/.config/neuronctl/trusted-keys/ or $NEURONCTL_TRUSTED_KEYS. Both files work as they
    are with `model_signing sign key --private_key` and `model_signing verify key
    --public_key`.

    Example: neuronctl artifacts keygen ci-signing

    Exit codes: 0 written, 2 a file exists (use --force).
    """
    private, public, key_id = generate_keypair(name.expanduser(), force=force)
    data = {"private_key": str(private), "public_key": str(public), "key_id": key_id}
    if json_out:
        print_json(data)
        return
    console.print(f"key {key_id}: private {private} (mode 0600), public {public}")
    console.print(
        f"sign with: --sign-key {private}  (or {SIGNING_KEY_ENV}); trust with: "
        f"--trust-key {public}  (or {TRUSTED_KEYS_ENV}, or copy it to {trusted_keys_dir()}/)",
        soft_wrap=True,
    )


def register(app: typer.Typer) -> None:
    """Commands attach to `artifacts_app`, which cli/artifacts.py adds to the app."""
