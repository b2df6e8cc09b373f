"""`neuronctl deploy TARGET ARTIFACT`: manifests for Kubernetes, KServe, vLLM's
production-stack, LeaderWorkerSet or KubeRay that install the artifact from its remote on
each node and serve it without compiling, checked against the real schemas."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from neuronctl.cli._common import REMOTE_ENV, JsonOpt, StoreOpt, err_console, print_json
from neuronctl.errors import UsageError
from neuronctl.vllm.detect import TARGET_HELP as VLLM_TARGET_HELP

if TYPE_CHECKING:
    from neuronctl.store.manifest import Manifest

ORDER = 43
ORCHESTRATORS = ("k8s", "kserve", "production-stack", "lws", "rayservice")


def deploy_command(
    target: Annotated[str, typer.Argument(help=" | ".join(ORCHESTRATORS) + ".")],
    artifact: Annotated[
        str,
        typer.Argument(
            help="Artifact KEY, PATH, or a remote URL/KEY already pulled (its manifest is "
            "read locally; the remote must hold the same artifact)."
        ),
    ],
    image: Annotated[
        str,
        typer.Option("--image", help="Server image: vLLM with the Neuron SDK, or neuronctl."),
    ],
    remote: Annotated[
        str | None,
        typer.Option(
            "--remote",
            envvar=REMOTE_ENV,
            help="Remote the pods install from: s3://BUCKET/PREFIX, oci://REGISTRY/REPO, ... "
            f"(default: ${REMOTE_ENV}, or the store of a URL artifact).",
            show_default=False,
        ),
    ] = None,
    install_image: Annotated[
        str | None,
        typer.Option("--install-image", help="Image with neuronctl for the install step "
                     "(default: --image; it checks the node with the same SDK).",
                     show_default=False),
    ] = None,
    name: Annotated[
        str | None,
        typer.Option("--name", help="Object name (default: from the model's name).",
                     show_default=False),
    ] = None,
    namespace: Annotated[
        str | None, typer.Option("--namespace", "-n", help="Namespace.", show_default=False)
    ] = None,
    server: Annotated[
        str | None,
        typer.Option("--server", help="vllm | neuronctl (default: vllm for Neuron artifacts, "
                     "neuronctl for torch ones).", show_default=False),
    ] = None,
    vllm_target: Annotated[
        str | None,
        typer.Option("--vllm-target", help="vLLM in the image: " + VLLM_TARGET_HELP,
                     show_default=False),
    ] = None,
    instance_type: Annotated[
        str | None,
        typer.Option("--instance-type", help="EC2 instance type of the nodes, e.g. "
                     "inf2.24xlarge: whole devices, a node selector, and the capacity and "
                     "--target checks.", show_default=False),
    ] = None,
    neuron_sdk: Annotated[
        str | None,
        typer.Option("--neuron-sdk", help="Neuron SDK release of the image, e.g. 2.24: "
                     "refused unless it is the one that compiled the artifact.",
                     show_default=False),
    ] = None,
    sdk_version: Annotated[
        list[str] | None,
        typer.Option("--sdk-version", help="PKG==VERSION installed in the image (repeat): "
                     "each must be the version that compiled the artifact.",
                     show_default=False),
    ] = None,
    replicas: Annotated[int, typer.Option("--replicas", min=1, help="Model servers.")] = 1,
    served_model_name: Annotated[
        str | None,
        typer.Option("--served-model-name", help="Model id clients send (default: the model "
                     "the artifact was compiled from).", show_default=False),
    ] = None,
    trusted_keys_secret: Annotated[
        str | None,
        typer.Option("--trusted-keys-secret", help="Secret holding the publishers' public keys: "
                     "mounted for the install step, named in $NEURONCTL_TRUSTED_KEYS.",
                     show_default=False),
    ] = None,
    kubernetes: Annotated[
        str, typer.Option("--kubernetes", help="Kubernetes version the objects are checked for.")
    ] = "1.33",
    no_check: Annotated[
        bool, typer.Option("--no-check", help="Skip the offline schema checks.")
    ] = False,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Write the YAML here instead of stdout.",
                     show_default=False),
    ] = None,
    store: StoreOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Write the manifests that run ARTIFACT on an orchestrator, installed from --remote.

    Each pod first runs `neuronctl install URI /mnt/models` (the KServe storage-initializer
    contract: pull, verify, check the node; non-zero on any failure), then the server: vLLM
    with exactly the flags and variables `neuronctl serve --engine vllm --dry-run` prints, or
    `neuronctl serve`. Neuron resources come from the tp degree, memory from the artifact's
    size; a startup probe waits on /v1/models, the grace period covers the server's drain.

    Refused, with the reason: an artifact the remote does not hold, and one the named
    --instance-type / --neuron-sdk / --sdk-version would compile again. Every document is
    checked offline against Kubernetes' API schemas (--kubernetes) and each project's CRD
    schema before it is printed.

    Examples:

      neuronctl deploy k8s 3f2a9c --remote s3://bucket/neuron --image my/vllm-neuron:2.24 \\
          --vllm-target plugin@0.4.1 --instance-type inf2.24xlarge --neuron-sdk 2.24 \\
          | kubectl apply -f -

      neuronctl deploy kserve 3f2a9c --remote oci://registry.local/models --image my/vllm:0.13

      neuronctl deploy production-stack 3f2a9c --image my/vllm:0.13 -o values.yaml

      neuronctl deploy k8s 3f2a9c --image my/neuronctl:latest --server neuronctl --json

    Exit codes: 0 written, 1 not published / would compile / not found, 2 usage error.
    """
    from neuronctl.fleet.instances import parse_versions
    from neuronctl.fleet.schemacheck import check_documents
    from neuronctl.fleet.targets import TARGETS
    from neuronctl.fleet.workload import DeployOptions, plan_workload

    if target not in TARGETS:
        raise UsageError(f"unknown target {target!r}", "use " + " | ".join(ORCHESTRATORS))
    manifest, remote_url = read_artifact(artifact, remote, store)
    options = DeployOptions(
        image=image,
        install_image=install_image,
        name=name,
        namespace=namespace,
        server=server,
        vllm_target=vllm_target,
        instance_type=instance_type,
        neuron_sdk=neuron_sdk,
        sdk_versions=parse_versions(sdk_version or []),
        replicas=replicas,
        served_model_name=served_model_name,
        keys_secret=trusted_keys_secret,
    )
    from neuronctl.store.remote.client import open_remote

    workload = plan_workload(manifest, open_remote(remote_url), options)
    documents = TARGETS[target](workload)
    checked = [] if no_check else check_documents(documents, kubernetes)
    if json_out:
        print_json({"target": target, "workload": workload.summary(), "checked": checked,
                    "documents": documents})  # fmt: skip
        return
    text = render_yaml(documents, target, workload.notes)
    if output is None:
        print(text, end="")
    else:
        output.write_text(text)
        err_console.print(f"wrote {output}")
    for line in checked:
        err_console.print(f"checked: {line}")


def read_artifact(ref: str, remote: str | None, store: Path | None) -> tuple[Manifest, str]:
    """The artifact's manifest, from the local store, and the remote its pods install from."""
    from neuronctl.store.manifest import read_manifest
    from neuronctl.store.resolve import NotPulledError, is_url, resolve_artifact

    if remote is None and is_url(ref):
        from neuronctl.store.remote.urls import split_artifact_url

        remote = split_artifact_url(ref)[0]
    if not remote:
        raise UsageError("no remote store named", f"pass --remote URL or set ${REMOTE_ENV}")
    try:
        path = resolve_artifact(ref, store, fetch=False)
    except NotPulledError as exc:
        raise UsageError(exc.message, f"pull it first: neuronctl artifacts pull {ref}") from None
    return read_manifest(path), remote


def render_yaml(documents: list[dict[str, object]], target: str, notes: list[str]) -> str:
    import yaml

    head = [f"# generated by: neuronctl deploy {target}"]
    head += [f"# note: {n}" for n in notes]
    body = "---\n".join(
        yaml.safe_dump(json.loads(json.dumps(d)), sort_keys=False, width=1000) for d in documents
    )
    return "\n".join(head) + "\n" + body


def register(app: typer.Typer) -> None:
    app.command("deploy")(deploy_command)
