"""One function per orchestrator: the workload (workload.py) arranged as that project's
objects. Each returns the documents in the order they are applied."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from typing import Any

import yaml

from neuronctl.errors import NeuronctlError
from neuronctl.fleet.workload import KEYS_MOUNT, MOUNT, PORT, PORT_NAME, VOLUME, Workload

# KServe: the container its webhook treats as the model server, and the variable that makes
# it add the storage initializer to a custom container (pkg/constants/constants.go).
KSERVE_CONTAINER = "kserve-container"
KSERVE_STORAGE_URI = "STORAGE_URI"
# The URIs neuronctl's install takes from KServe: a remote store's artifact directory. Only
# these, so the ClusterStorageContainer never takes another model's s3:// URI from KServe's
# own initializer; oci:// never reaches a storage container (kserve_oci).
INSTALL_URI_REGEXES = (r"^(s3|s3a|hf|file|gs|az)://.+/neuron-compiled-artifacts/[0-9a-f]{20}$",)
OCI_PREFIX = "oci://"
RAY_VERSION = "2.49.0"
RAY_NEURON_RESOURCE = "neuron_cores"  # what Ray calls a NeuronCore (aws-neuron-core type)
RAY_APP_IMPORT = "neuronctl.fleet.rayserve:app"


def k8s(w: Workload) -> list[dict[str, Any]]:
    """A Deployment and the ClusterIP Service in front of it."""
    selector = {"app.kubernetes.io/name": w.name}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": w.metadata(),
        "spec": {
            "replicas": w.replicas,
            "selector": {"matchLabels": selector},
            # A new pod must be up before an old one goes: devices are scarce, so surge 1.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "progressDeadlineSeconds": w.startup_failures(10) * 10 + 600,
            "template": w.pod_template(),
        },
    }
    return [deployment, service(w, selector)]


def service(w: Workload, selector: dict[str, str], name: str | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": w.metadata(name),
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [
                {"name": PORT_NAME, "port": PORT, "targetPort": PORT_NAME, "protocol": "TCP"}
            ],
        },
    }


def kserve(w: Workload) -> list[dict[str, Any]]:
    """A ClusterStorageContainer that runs `neuronctl install URI /mnt/models` for neuronctl's
    URIs (KServe appends the URI and the directory as arguments), and an InferenceService whose
    custom container names the artifact in STORAGE_URI. Raw deployment: Knative refuses
    startup probes. A registry artifact goes by an init container instead (kserve_oci)."""
    if w.source_uri.startswith(OCI_PREFIX):
        return [kserve_oci(w)]
    install = w.install_container(with_args=False)
    install["name"] = "storage-initializer"
    del install["volumeMounts"]  # KServe mounts /mnt/models itself
    # One ClusterStorageContainer serves every InferenceService of the cluster whose URI it
    # matches, whatever its tp degree: it asks for no Neuron devices of its own.
    install["resources"] = {"requests": {"memory": "1Gi"}, "limits": {"memory": "2Gi"}}
    if w.keys_secret:
        raise NeuronctlError(
            "KServe's storage container cannot mount a Secret: the install image must carry "
            "the trusted keys (NEURONCTL_TRUSTED_KEYS or ~/.config/neuronctl/trusted-keys)",
            "drop --trusted-keys-secret for the kserve target",
        )
    storage = {
        "apiVersion": "serving.kserve.io/v1alpha1",
        "kind": "ClusterStorageContainer",
        "metadata": {"name": "neuronctl-install"},
        "spec": {
            "container": install,
            "supportedUriFormats": [{"regex": r} for r in INSTALL_URI_REGEXES],
            "workloadType": "initContainer",
        },
    }
    container = w.server_container(KSERVE_CONTAINER)
    del container["volumeMounts"]  # KServe mounts the storage initializer's volume
    container["env"] = [*container["env"], {"name": KSERVE_STORAGE_URI, "value": w.source_uri}]
    predictor: dict[str, Any] = {
        "minReplicas": w.replicas,
        "containers": [container],
        "terminationGracePeriodSeconds": w.grace_seconds(),
        **w.scheduling(),
    }
    return [storage, inference_service(w, predictor)]


def kserve_oci(w: Workload) -> dict[str, Any]:
    """KServe takes every oci:// URI in STORAGE_URI or storageUri for its own OCI support
    (a modelcar, an image volume or its fetch; on by default) and never hands it to a
    storage container, and a neuronctl artifact is not a model image. So the predictor's pod
    carries the install as its own init container into an emptyDir, as the k8s target does,
    and names no storage URI: KServe's webhook then injects nothing."""
    container = w.server_container(KSERVE_CONTAINER)
    predictor: dict[str, Any] = {
        "minReplicas": w.replicas,
        "initContainers": [w.install_container()],
        "containers": [container],
        "volumes": w.volumes(),
        "terminationGracePeriodSeconds": w.grace_seconds(),
        **w.scheduling(),
    }
    return inference_service(w, predictor)


def inference_service(w: Workload, predictor: dict[str, Any]) -> dict[str, Any]:
    meta = w.metadata()
    meta["annotations"]["serving.kserve.io/deploymentMode"] = "RawDeployment"
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": meta,
        "spec": {"predictor": predictor},
    }


def production_stack(w: Workload) -> list[dict[str, Any]]:
    """Values for vLLM's production-stack chart (helm/values.yaml): one modelSpec entry.

    The chart runs `vllm serve MODEL_URL` and adds --enable-prefix-caching or its --no- form
    itself, so those two are taken out of the launcher's flags; it has no grace period
    setting (pods get Kubernetes' 30 s)."""
    if w.server != "vllm":
        raise NeuronctlError(
            "the production-stack chart runs vLLM only", "use --server vllm, or the k8s target"
        )
    if "enable_prefix_caching" not in w.vllm_args:
        raise NeuronctlError(
            "the production-stack chart passes --[no-]enable-prefix-caching, which this vLLM "
            "generation's launch does not take (the chart needs vllm serve of vLLM 0.10.2+)",
            "use --vllm-target plugin@VERSION, or the k8s target",
        )
    repository, tag = split_image(w.image)
    probes = w.probes()
    for probe in probes.values():
        probe["httpGet"]["port"] = PORT
        probe.pop("terminationGracePeriodSeconds", None)
        probe["initialDelaySeconds"] = 0  # the chart's default is 15
    install = w.install_container()
    install["extraVolumeMounts"] = install.pop("volumeMounts")
    model_spec: dict[str, Any] = {
        "name": w.name,
        "repository": repository,
        "tag": tag,
        "modelURL": MOUNT,
        "replicaCount": w.replicas,
        "resources": w.resources(),
        "env": w.env_list(),
        "initContainer": install,
        "extraVolumes": w.volumes(),
        "extraVolumeMounts": [{"name": VOLUME, "mountPath": MOUNT, "readOnly": True}],
        "vllmConfig": {
            "enablePrefixCaching": bool(w.vllm_args["enable_prefix_caching"]),
            "extraArgs": chart_args(w.argv),
        },
    }
    scheduling = w.scheduling()
    if "nodeSelector" in scheduling:
        key, value = next(iter(scheduling["nodeSelector"].items()))
        model_spec["nodeSelectorTerms"] = [
            {"matchExpressions": [{"key": key, "operator": "In", "values": [value]}]}
        ]
    engine: dict[str, Any] = {
        "enableEngine": True,
        "containerPort": PORT,
        "startupProbe": probes["startupProbe"],
        "readinessProbe": probes["readinessProbe"],
        "livenessProbe": probes["livenessProbe"],
        "modelSpec": [model_spec],
    }
    if "tolerations" in scheduling:
        engine["tolerations"] = scheduling["tolerations"]
    return [{"servingEngineSpec": engine}]


def chart_args(argv: list[str]) -> list[str]:
    """The launcher's flags as `vllm serve` extra arguments: no interpreter and module (the
    chart runs `vllm serve`), no --model (the chart's positional MODEL_URL), no host and
    port (the chart's), no prefix-caching flag (the chart's own)."""
    dropped = {"--model", "--host", "--port"}
    flags = argv[argv.index("vllm.entrypoints.openai.api_server") + 1 :]
    out, i = [], 0
    while i < len(flags):
        flag = flags[i]
        if flag in dropped:
            i += 2
            continue
        if flag in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
            i += 1
            continue
        out.append(flag)
        i += 1
    return out


def split_image(image: str) -> tuple[str, str]:
    """`repo[:tag]` -> (repo, tag); a port in the registry host is not a tag."""
    name, _, digest = image.partition("@")
    if digest:
        raise NeuronctlError(
            f"--image {image}: the production-stack chart takes repository:tag, not a digest"
        )
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        return name[:colon], name[colon + 1 :]
    return name, "latest"


def lws(w: Workload) -> list[dict[str, Any]]:
    """A LeaderWorkerSet: each replica is a group of pods started and replaced together. The
    artifact's tp degree fits one node (multi-node launches are not something neuronctl's
    launcher writes), so a group is its leader; the group gets LWS's rolling update and
    restart-as-a-unit all the same."""
    nodes = nodes_needed(w)
    if nodes > 1 and w.instance is not None:
        raise NeuronctlError(
            f"tp degree {w.manifest.spec.tp_degree} needs {nodes} {w.instance.name} nodes: "
            "neuronctl writes no multi-node launch",
            "compile with a tp degree one instance holds, or name a larger --instance-type",
        )
    selector = {"app.kubernetes.io/name": w.name}
    group = {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": w.metadata(),
        "spec": {
            "replicas": w.replicas,
            "startupPolicy": "LeaderReady",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "leaderWorkerTemplate": {
                "size": nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": w.pod_template(),
            },
        },
    }
    return [group, service(w, selector)]


def nodes_needed(w: Workload) -> int:
    if w.instance is None or not w.neuron:
        return 1
    return math.ceil(w.manifest.spec.tp_degree / w.instance.cores)


def rayservice(w: Workload) -> list[dict[str, Any]]:
    """A KubeRay RayService: a head pod and a worker group whose pods hold the Neuron cores,
    and the Serve application (neuronctl.fleet.rayserve) whose replicas each install the
    artifact and run the server, asking Ray for the tp degree in neuron_cores."""
    tp = w.manifest.spec.tp_degree
    actor: dict[str, Any] = {"num_cpus": 1}
    if w.neuron:
        actor["resources"] = {RAY_NEURON_RESOURCE: tp}
    application = {
        "name": w.name,
        "route_prefix": "/",
        "import_path": RAY_APP_IMPORT,
        "args": {
            "source_uri": w.source_uri,
            "argv": w.argv,
            "env": w.env,
            "served_model_name": w.served_model_name,
            "num_replicas": w.replicas,
            "neuron_cores": tp if w.neuron else 0,
        },
        "deployments": [
            {
                "name": "NeuronctlServer",
                "num_replicas": w.replicas,
                "ray_actor_options": actor,
                "health_check_period_s": 10,
                "health_check_timeout_s": 30,
                "graceful_shutdown_timeout_s": w.grace_seconds(),
            }
        ],
    }
    serve_config = yaml.safe_dump({"applications": [application]}, sort_keys=False)
    head = ray_container(w, "ray-head", head=True)
    worker = ray_container(w, "ray-worker", head=False)
    worker_pod: dict[str, Any] = {
        "containers": [worker],
        "volumes": w.volumes(),
        "terminationGracePeriodSeconds": w.grace_seconds(),
        **w.scheduling(),
    }
    worker_params: dict[str, str] = {}
    if w.neuron:
        # KubeRay derives neuron_cores from aws.amazon.com/neuroncore limits only, not from
        # whole devices: say it, in the quoted form KubeRay writes itself.
        worker_params["resources"] = "'" + json.dumps({RAY_NEURON_RESOURCE: tp}) + "'"
    return [
        {
            "apiVersion": "ray.io/v1",
            "kind": "RayService",
            "metadata": w.metadata(),
            "spec": {
                "serveConfigV2": serve_config,
                "rayClusterConfig": {
                    "rayVersion": RAY_VERSION,
                    "headGroupSpec": {
                        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},
                        "template": {"spec": {"containers": [head]}},
                    },
                    "workerGroupSpecs": [
                        {
                            "groupName": "neuron",
                            "replicas": w.replicas,
                            "minReplicas": w.replicas,
                            "maxReplicas": w.replicas,
                            "rayStartParams": worker_params,
                            "template": {
                                "metadata": {"labels": w.labels()},
                                "spec": worker_pod,
                            },
                        }
                    ],
                },
            },
        }
    ]


def ray_container(w: Workload, name: str, head: bool) -> dict[str, Any]:
    container: dict[str, Any] = {"name": name, "image": w.image}
    if head:
        container["resources"] = {"requests": {"cpu": "1", "memory": "4Gi"},
                                  "limits": {"memory": "4Gi"}}  # fmt: skip
        container["ports"] = [
            {"name": "gcs", "containerPort": 6379},
            {"name": "dashboard", "containerPort": 8265},
            {"name": "serve", "containerPort": 8000},
        ]
        return container
    container["resources"] = copy.deepcopy(w.resources())
    container["volumeMounts"] = [{"name": VOLUME, "mountPath": MOUNT}, *w.keys_mounts()]
    if w.keys_secret:
        container["env"] = [{"name": "NEURONCTL_TRUSTED_KEYS", "value": KEYS_MOUNT}]
    return container


TARGETS: dict[str, Callable[[Workload], list[dict[str, Any]]]] = {
    "k8s": k8s,
    "kserve": kserve,
    "production-stack": production_stack,
    "lws": lws,
    "rayservice": rayservice,
}
