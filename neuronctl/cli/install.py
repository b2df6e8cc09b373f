"""`neuronctl install SOURCE_URI DEST_DIR`: one artifact onto a node, verified, ready to load."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from neuronctl.cli._common import AllowUnsignedOpt, JsonOpt, TrustKeyOpt, print_json
from neuronctl.errors import UsageError

if TYPE_CHECKING:
    from neuronctl.store.signing import TrustPolicy

ORDER = 42
PREFIX = "neuronctl install: "


def install_command(
    pairs: Annotated[
        list[str],
        typer.Argument(
            metavar="SOURCE_URI DEST_DIR",
            help="A remote artifact (URL/KEY as `artifacts pull` takes it, or an OCI registry's "
            "oci://REGISTRY/REPO:KEY or @sha256:DIGEST) and the directory to install it into; "
            "several pairs as KServe's storage initializer passes them.",
            show_default=False,
        ),
    ],
    trust_key: TrustKeyOpt = None,
    allow_unsigned: AllowUnsignedOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Install an artifact on this node: pull it, verify its signature and every byte, check
    that this host loads it without compiling, and record what was verified.

    Takes KServe's storage-initializer arguments (SOURCE_URI DEST_DIR pairs; non-zero exit on
    any failure), so its image works as a KServe ClusterStorageContainer, an init container or
    a job that fills a volume. Afterwards `neuronctl serve DEST_DIR` (or generate, validate)
    loads it with no further flag: the record in DEST_DIR/provenance.json names the key that
    verified it, and a load refuses it once that key is revoked.

    From a registry the signature is a referrer of the artifact's manifest (`oras discover`
    lists it) and each file a layer. A killed run leaves nothing that looks installed; a rerun
    keeps every file it verified and resumes a partial download (from a registry, by an HTTP
    Range request). Progress goes to stderr as plain lines.

    Examples:

      neuronctl install s3://my-bucket/neuron/3f9c2a /mnt/models --trust-key ci.pub

      NEURONCTL_TRUSTED_KEYS=/keys/ci.pub neuronctl install file:///mnt/shared/3f9c2a ./model

      neuronctl install oci://ghcr.io/my-org/neuron:3f9c2a /mnt/models --json

    Exit codes: 0 installed (and loadable here), 1 not found, untrusted, corrupted, or this
    host cannot load it, 2 usage.
    """
    from neuronctl.store.signing import TrustPolicy

    if len(pairs) % 2:
        raise UsageError(
            f"expected SOURCE_URI DEST_DIR pairs, got {len(pairs)} arguments",
            "e.g. neuronctl install s3://bucket/prefix/KEY /mnt/models",
        )
    policy = TrustPolicy.load(trust_key, allow_unsigned)
    done = [_install_one(src, Path(dest), policy) for src, dest in zip(pairs[::2], pairs[1::2],
                                                                        strict=True)]  # fmt: skip
    if json_out:
        print_json({"installed": done} if len(done) > 1 else done[0])


def _install_one(source: str, dest: Path, policy: TrustPolicy) -> dict[str, object]:
    from neuronctl.store.install import InstallError, install, withdraw
    from neuronctl.store.signing import TrustPolicy
    from neuronctl.validate import check_host, validate_artifact

    dest = dest.expanduser().absolute()
    log(f"installing {source} into {dest}")
    result = install(source, dest, policy, check_host, log)
    # The check a later load runs, with no key but the one the record names: what `serve
    # DEST_DIR` will find, whatever its host trusts.
    bare = TrustPolicy(allow_unsigned=policy.allow_unsigned, revoked=policy.revoked)
    report = validate_artifact(dest, policy=bare)
    if not report.reusable:
        withdraw(dest)
        reasons = "; ".join(f"{c.name}: {c.reason}" for c in report.failed)
        raise InstallError(f"{dest} would not load here: {reasons}",
                           f"see `neuronctl validate {dest}`")  # fmt: skip
    trust = next(c.reason for c in report.checks if c.name == "trust")
    log(
        f"installed {result.artifact_key[:20]} into {dest}: {result.files} files, "
        f"{result.downloaded_bytes} bytes downloaded, {result.kept_bytes} already verified here"
    )
    log(f"trust: {trust}; load it with: neuronctl serve {dest}")
    return result.as_dict()


def log(message: str) -> None:
    """A plain progress line for a container log: no colour, no wrapping."""
    sys.stderr.write(PREFIX + message + "\n")  # one write: lines from threads stay whole
    sys.stderr.flush()


def register(app: typer.Typer) -> None:
    app.command("install")(install_command)
