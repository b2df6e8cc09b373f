"""What every orchestrator's manifest says the same way: where the artifact comes from, the
install step, the server's command line and variables, the Neuron resources, memory, probes
and grace period. Worked out once from the artifact's manifest (targets.py only arranges it).

Refusals happen here, before anything is written: an artifact the remote does not hold, one
the named instance type and SDK would compile again, a server that cannot load it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuronctl.checks import Check
from neuronctl.errors import NeuronctlError, NotFoundError, UsageError
from neuronctl.fleet.instances import Instance
from neuronctl.store.manifest import Manifest
from neuronctl.store.signing import TRUSTED_KEYS_ENV

if TYPE_CHECKING:
    from neuronctl.store.remote.client import RemoteStore
    from neuronctl.store.remote.oci import OciStore

# KServe's storage initializer writes to /mnt/models (its DefaultModelLocalMountPath); every
# target uses the same directory so one install image and one command line serve them all.
MOUNT = "/mnt/models"
VOLUME = "artifact"
PORT = 8000
PORT_NAME = "http"
GIB = 2**30
NEURON_DEVICE = "aws.amazon.com/neuron"  # whole devices: every core of each
NEURON_CORE = "aws.amazon.com/neuroncore"  # single cores (the scheduler extension keeps them
# contiguous)
KEYS_VOLUME = "trusted-keys"
KEYS_MOUNT = "/etc/neuronctl/trusted-keys"
NEURON_TAINT = "aws.amazon.com/neuron"  # EKS Neuron node groups are commonly tainted with it
INSTANCE_LABEL = "node.kubernetes.io/instance-type"
SERVERS = ("vllm", "neuronctl")
# Start-up budget: the process, then the weights read from the node's disk and put on the
# devices. Generous per GiB: a startup probe that gives up restarts a healthy load.
STARTUP_BASE_S = 300
STARTUP_PER_GIB_S = 20
GRACE_MARGIN_S = 30  # beyond the drain: the last responses written, the process exited
LIVENESS_GRACE_S = 30  # a wedged engine is killed this fast, whatever the drain allows
HOST_OVERHEAD = 2 * GIB  # interpreter, torch, tokenizer, HTTP server
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


@dataclass
class Workload:
    """One model server over one artifact, as every target writes it."""

    name: str
    manifest: Manifest
    source_uri: str  # what `neuronctl install` pulls
    image: str  # the server's image
    install_image: str  # the image `neuronctl install` runs in
    server: str  # vllm | neuronctl
    argv: list[str]
    env: dict[str, str]
    served_model_name: str
    neuron: dict[str, int]  # Neuron resource -> count
    instance: Instance | None
    replicas: int = 1
    namespace: str | None = None
    keys_secret: str | None = None  # a Secret of public keys the install trusts
    vllm_args: dict[str, Any] = field(default_factory=dict)  # the engine arguments (vllm)
    notes: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)

    @property
    def dirname(self) -> str:
        return self.manifest.keys.dirname

    @property
    def size(self) -> int:
        return self.manifest.total_size()

    # -- sizes -----------------------------------------------------------------------------

    def memory_bytes(self) -> int:
        """Host memory the server needs: the weights pass through host memory on their way to
        the devices (Neuron) or stay mapped there (torch, with its KV cache), plus overhead."""
        return self.size + kv_cache_bytes(self.manifest) + HOST_OVERHEAD

    def disk_bytes(self) -> int:
        """The install volume: the artifact and a margin for the install's partial files."""
        return int(self.size * 1.1) + GIB

    def startup_failures(self, period: int) -> int:
        budget = STARTUP_BASE_S + STARTUP_PER_GIB_S * math.ceil(self.size / GIB)
        return math.ceil(budget / period)

    def grace_seconds(self) -> int:
        from neuronctl.server.run import DRAIN_SECONDS  # the server module pulls in uvicorn

        return DRAIN_SECONDS + GRACE_MARGIN_S

    # -- Kubernetes objects ----------------------------------------------------------------

    def labels(self) -> dict[str, str]:
        return {
            "app.kubernetes.io/name": self.name,
            "app.kubernetes.io/managed-by": "neuronctl",
            "neuronctl.dev/artifact": self.dirname,
        }

    def annotations(self) -> dict[str, str]:
        return {
            "neuronctl.dev/artifact-key": self.manifest.artifact_key,
            "neuronctl.dev/source": self.source_uri,
            "neuronctl.dev/server": self.server,
        }

    def metadata(self, name: str | None = None, labels: bool = True) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name or self.name}
        if self.namespace:
            meta["namespace"] = self.namespace
        if labels:
            meta["labels"] = self.labels()
        meta["annotations"] = self.annotations()
        return meta

    def resources(self) -> dict[str, Any]:
        """Requests and limits: Neuron resources are extended resources, so request = limit;
        memory is a request (the load's peak) and the same limit, so the pod is not the first
        one evicted while it holds devices."""
        memory = f"{math.ceil(self.memory_bytes() / GIB)}Gi"
        requests: dict[str, Any] = {"memory": memory, "ephemeral-storage": self.disk_quantity()}
        limits: dict[str, Any] = {"memory": memory}
        if self.manifest.backend == "torch":
            requests["cpu"] = str(self.manifest.spec.tp_degree)
        for resource, count in self.neuron.items():
            requests[resource] = count
            limits[resource] = count
        return {"requests": requests, "limits": limits}

    def install_resources(self) -> dict[str, Any]:
        """The install step sees the same Neuron devices (it checks this node's cores the way
        validate does); a pod's request is the larger of init and app containers, not both."""
        requests: dict[str, Any] = {"memory": "1Gi"}
        limits: dict[str, Any] = {"memory": "2Gi"}
        for resource, count in self.neuron.items():
            requests[resource] = count
            limits[resource] = count
        return {"requests": requests, "limits": limits}

    def disk_quantity(self) -> str:
        return f"{math.ceil(self.disk_bytes() / GIB)}Gi"

    def probes(self) -> dict[str, Any]:
        """/health answers before the weights are loaded (and 503 while draining), so only
        /v1/models says the model is up: the startup probe waits on it. Liveness probes stop
        when a pod terminates, so a draining server is not killed by its own 503."""
        startup_period = 10
        return {
            "startupProbe": {
                "httpGet": {"path": "/v1/models", "port": PORT_NAME},
                "periodSeconds": startup_period,
                "timeoutSeconds": 5,
                "failureThreshold": self.startup_failures(startup_period),
            },
            "readinessProbe": {
                "httpGet": {"path": "/health", "port": PORT_NAME},
                "periodSeconds": 5,
                "timeoutSeconds": 5,
                "failureThreshold": 2,
            },
            "livenessProbe": {
                "httpGet": {"path": "/health", "port": PORT_NAME},
                "periodSeconds": 10,
                "timeoutSeconds": 5,
                "failureThreshold": 3,
                "terminationGracePeriodSeconds": LIVENESS_GRACE_S,
            },
        }

    def env_list(self) -> list[dict[str, str]]:
        return [{"name": k, "value": v} for k, v in sorted(self.env.items())]

    def install_container(self, with_args: bool = True) -> dict[str, Any]:
        container: dict[str, Any] = {
            "name": "install",
            "image": self.install_image,
            "command": ["neuronctl", "install"],
            "resources": self.install_resources(),
            "volumeMounts": [{"name": VOLUME, "mountPath": MOUNT}, *self.keys_mounts()],
        }
        if self.keys_secret:
            container["env"] = [{"name": TRUSTED_KEYS_ENV, "value": KEYS_MOUNT}]
        if with_args:
            container["args"] = [self.source_uri, MOUNT]
        return container

    def keys_mounts(self) -> list[dict[str, Any]]:
        if not self.keys_secret:
            return []
        return [{"name": KEYS_VOLUME, "mountPath": KEYS_MOUNT, "readOnly": True}]

    def volumes(self) -> list[dict[str, Any]]:
        """The install volume, and the trusted keys' Secret when one is named."""
        out = [self.volume()]
        if self.keys_secret:
            out.append({"name": KEYS_VOLUME, "secret": {"secretName": self.keys_secret}})
        return out

    def server_container(self, name: str = "server") -> dict[str, Any]:
        return {
            "name": name,
            "image": self.image,
            "command": self.argv,
            "env": self.env_list(),
            "ports": [{"name": PORT_NAME, "containerPort": PORT, "protocol": "TCP"}],
            "resources": self.resources(),
            # Read-only: the server loads what the install verified, nobody rewrites it.
            "volumeMounts": [{"name": VOLUME, "mountPath": MOUNT, "readOnly": True}],
            **self.probes(),
        }

    def volume(self) -> dict[str, Any]:
        return {"name": VOLUME, "emptyDir": {"sizeLimit": self.disk_quantity()}}

    def scheduling(self) -> dict[str, Any]:
        spec: dict[str, Any] = {}
        if self.instance is not None:
            spec["nodeSelector"] = {INSTANCE_LABEL: self.instance.name}
        if self.neuron:
            spec["tolerations"] = [
                {"key": NEURON_TAINT, "operator": "Exists", "effect": "NoSchedule"}
            ]
        return spec

    def pod_spec(self) -> dict[str, Any]:
        return {
            "initContainers": [self.install_container()],
            "containers": [self.server_container()],
            "volumes": self.volumes(),
            "terminationGracePeriodSeconds": self.grace_seconds(),
            **self.scheduling(),
        }

    def pod_template(self) -> dict[str, Any]:
        return {
            "metadata": {"labels": self.labels(), "annotations": self.annotations()},
            "spec": self.pod_spec(),
        }

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "artifact": self.manifest.artifact_key,
            "source": self.source_uri,
            "server": self.server,
            "argv": self.argv,
            "env": self.env,
            "neuron": self.neuron,
            "instance_type": self.instance.name if self.instance else None,
            "memory": self.resources()["requests"]["memory"],
            "grace_seconds": self.grace_seconds(),
            "checks": [{"name": c.name, "ok": c.ok, "reason": c.reason} for c in self.checks],
            "notes": self.notes,
        }


def kv_cache_bytes(manifest: Manifest) -> int:
    """The torch backend's KV cache in host memory (Neuron backends keep theirs on device)."""
    if manifest.backend != "torch":
        return 0
    arch, spec = manifest.architecture, manifest.spec
    layers = int(arch.get("num_hidden_layers") or 0)
    heads = int(arch.get("num_attention_heads") or 1)
    head_dim = int(arch.get("head_dim") or int(arch.get("hidden_size") or 0) // heads)
    kv_heads = int(arch.get("num_key_value_heads") or heads)
    width = DTYPE_BYTES.get(str(spec.dtype), 4)
    return 2 * layers * kv_heads * head_dim * spec.batch_size * spec.seq_len * width


def neuron_resources(manifest: Manifest, where: Instance | None) -> dict[str, int]:
    """Whole devices when the tp degree fills them (the device plugin then hands out every
    core of each, adjacent), single cores otherwise; none for the torch backend."""
    if manifest.backend == "torch":
        return {}
    tp = manifest.spec.tp_degree
    if where is not None and tp % where.cores_per_device == 0:
        return {NEURON_DEVICE: tp // where.cores_per_device}
    return {NEURON_CORE: tp}


def dns_name(text: str) -> str:
    """A Kubernetes object name (an RFC 1123 label) from a model name."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:63].strip("-")
    if not DNS_LABEL.fullmatch(name or ""):
        raise UsageError(f"--name: cannot make a Kubernetes name of {text!r}", "pass --name")
    return name


def published_uri(remote: RemoteStore | OciStore, manifest: Manifest) -> str:
    """The URI the install step pulls, once the remote is known to hold this very artifact."""
    dirname = manifest.keys.dirname
    if not remote.has(dirname):
        raise NotFoundError(
            f"artifact {dirname} is not published at {remote.url}: a pod could not install it",
            f"push it first: neuronctl artifacts push {dirname} {remote.url}",
        )
    return remote.artifact_url(dirname)


def server_launch(
    manifest: Manifest, server: str, served_model_name: str, vllm_target: str | None
) -> tuple[list[str], dict[str, str], dict[str, Any], list[str]]:
    """The server's argv, variables, engine arguments and notes, for the artifact at MOUNT."""
    if server == "neuronctl":
        argv = ["neuronctl", "serve", MOUNT, "--host", "0.0.0.0", "--port", str(PORT),
                "--served-model-name", served_model_name]  # fmt: skip
        return argv, {}, {}, []
    from neuronctl.vllm.launch import cli_target, serve_launch
    from neuronctl.vllm.rules import plan_launch

    target = cli_target(manifest, vllm_target)
    launch = serve_launch(Path(MOUNT), manifest, host="0.0.0.0", port=PORT,
                          served_model_name=served_model_name, target=target)  # fmt: skip
    # The launcher names this host's interpreter; the image has its own.
    argv = ["python3", *launch.argv[1:]]
    args = plan_launch(Path(MOUNT), manifest, target).args
    notes = [f"vLLM target {target.describe()}", *launch.notes]
    return argv, dict(launch.env), args, notes


def default_server(manifest: Manifest) -> str:
    return "neuronctl" if manifest.backend == "torch" else "vllm"


def check_server(manifest: Manifest, server: str) -> None:
    if server not in SERVERS:
        raise UsageError(f"--server: unknown server {server!r}", "use vllm or neuronctl")
    if server == "vllm" and manifest.backend == "torch":
        raise NeuronctlError(
            "vLLM cannot load a torch-backend artifact", "use --server neuronctl"
        )


@dataclass
class DeployOptions:
    """What the user names for a deploy; everything else comes from the artifact."""

    image: str
    install_image: str | None = None  # default: the server's image
    name: str | None = None
    namespace: str | None = None
    server: str | None = None  # default: vllm for Neuron artifacts, neuronctl for torch
    vllm_target: str | None = None
    instance_type: str | None = None
    neuron_sdk: str | None = None
    sdk_versions: dict[str, str] = field(default_factory=dict)
    replicas: int = 1
    served_model_name: str | None = None
    keys_secret: str | None = None


class NotLoadableError(NeuronctlError):
    """The named instance type or SDK would compile the artifact again."""


def plan_workload(
    manifest: Manifest, remote: RemoteStore | OciStore, options: DeployOptions
) -> Workload:
    """The workload for `manifest` from `remote`, or the reason a pod could not load it as
    compiled (nothing is written then)."""
    from neuronctl.fleet.instances import instance, load_checks, parse_sdk_release

    spec = manifest.spec
    where = instance(options.instance_type, spec) if options.instance_type else None
    sdk = parse_sdk_release(options.neuron_sdk) if options.neuron_sdk else None
    server = options.server or default_server(manifest)
    check_server(manifest, server)
    checks = load_checks(manifest, where, sdk, options.sdk_versions)
    failed = [c for c in checks if not c.ok]
    if failed:
        reasons = "; ".join(f"{c.name}: {c.reason}" for c in failed)
        raise NotLoadableError(
            f"pods would not load artifact {manifest.keys.dirname} as compiled: {reasons}",
            "neuronctl writes no manifest whose pods would compile",
        )
    source = published_uri(remote, manifest)
    model = manifest.source.model or manifest.source.path or manifest.keys.dirname
    served = options.served_model_name or model
    name = dns_name(options.name or model.rstrip("/").rsplit("/", 1)[-1])
    argv, env, args, notes = server_launch(manifest, server, served, options.vllm_target)
    if where is None and manifest.backend != "torch":
        notes.append("no --instance-type: Neuron cores requested one by one and no node "
                     "selector; name the instance type to get whole devices")
    if not options.keys_secret:
        notes.append("no --trusted-keys-secret: the install step trusts only the keys its "
                     f"image carries ({TRUSTED_KEYS_ENV} or ~/.config/neuronctl/trusted-keys)")
    if sdk is None and not options.sdk_versions and manifest.backend != "torch":
        versions = ", ".join(f"{k}=={v}" for k, v in sorted(manifest.backend_versions.items()))
        notes.append(f"the image must have exactly {versions} (name --neuron-sdk or "
                     "--sdk-version to have that checked)")
    return Workload(
        name=name,
        manifest=manifest,
        source_uri=source,
        image=options.image,
        install_image=options.install_image or options.image,
        server=server,
        argv=argv,
        env=env,
        served_model_name=served,
        neuron=neuron_resources(manifest, where),
        instance=where,
        replicas=options.replicas,
        namespace=options.namespace,
        keys_secret=options.keys_secret,
        vllm_args=args,
        notes=notes,
        checks=checks,
    )
