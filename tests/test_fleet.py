"""deploy: manifests for Kubernetes, KServe, production-stack, LeaderWorkerSet and KubeRay from
a compiled artifact and its remote, checked against the real schemas.

Upstream facts pinned here (repository, path, line at the commits in
neuronctl/fleet/schemas/README.md):

- KServe's webhook adds the storage initializer to a custom container named
  `kserve-container` whose STORAGE_URI names the model, and mounts /mnt/models
  (kserve/kserve pkg/constants/constants.go:335, :496, :511), with the URI and the directory
  as the init container's arguments (pkg/webhook/admission/pod/storage_initializer_injector.go
  :495, :555).
- KubeRay turns `aws.amazon.com/neuroncore` limits, and only those, into Ray's
  `neuron_cores` resource (ray-project/kuberay ray-operator/controllers/ray/common/pod.go:40-47,
  :1461-1471), written as a quoted JSON map.
- production-stack runs `vllm serve MODEL_URL` and always adds --enable-prefix-caching or
  --no-enable-prefix-caching (vllm-project/production-stack
  helm/templates/deployment-vllm-multi.yaml:127-161).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from neuronctl.errors import NeuronctlError, NotFoundError
from neuronctl.fleet.instances import INF2, instance
from neuronctl.fleet.schemacheck import SchemaError, check_documents
from neuronctl.fleet.targets import TARGETS, chart_args
from neuronctl.fleet.workload import (
    MOUNT,
    NEURON_CORE,
    NEURON_DEVICE,
    DeployOptions,
    NotLoadableError,
    plan_workload,
)
from neuronctl.store.local import Store
from neuronctl.store.manifest import Manifest
from neuronctl.store.remote.client import open_remote
from tests.helpers import cli_in_process
from tests.test_vllm import make_manifest

SDK_2_24 = {
    "neuronx-cc": "2.19.8089.0",
    "neuronx-distributed-inference": "0.4.7422",  # 0.4 ships with SDK 2.24
    "torch-neuronx": "2.6.0.2.8.6734",
}
C41 = "plugin@0.4.1"
K8S = "1.33"
WEIGHTS_BYTES = 3 * 2**20


def nxdi_manifest(**fields: Any) -> Manifest:
    fields.setdefault("cc_flags", "")
    manifest = make_manifest("nxdi", **fields)
    return manifest.model_copy(update={"backend_versions": dict(SDK_2_24)})


def publish(store: Store, manifest: Manifest, weights: int = WEIGHTS_BYTES) -> Path:
    def build(staging: Path) -> Manifest:
        (staging / "weights").mkdir()
        with open(staging / "weights" / "tp0_sharded_checkpoint.safetensors", "wb") as f:
            f.truncate(weights)  # sparse: its size is what the manifest records
        (staging / "model.pt").write_bytes(b"graph")
        return manifest

    return store.publish(manifest.keys.dirname, build).path


@pytest.fixture
def shop(tmp_path: Path) -> tuple[Store, Any, Manifest]:
    """A published nxdi artifact (tp 4, SDK 2.24) in a local store and a file:// remote."""
    store = Store(tmp_path / "store")
    path = publish(store, nxdi_manifest())
    remote = open_remote((tmp_path / "remote").as_uri())
    remote.push(path)
    from neuronctl.store.manifest import read_manifest

    return store, remote, read_manifest(path)


def options(**kw: Any) -> DeployOptions:
    values: dict[str, Any] = {
        "image": "registry.local/vllm-neuron:2.24",
        "vllm_target": C41,
        "instance_type": "inf2.24xlarge",
        "neuron_sdk": "2.24",
    }
    values.update(kw)
    return DeployOptions(**values)


# --- every target validates, and a wrong field does not ------------------------------------


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_target_validates_against_its_schemas(shop, target: str) -> None:
    _store, remote, manifest = shop
    documents = TARGETS[target](plan_workload(manifest, remote, options()))
    checked = check_documents(documents, K8S)
    assert len(checked) == len(documents)


BREAKS = {
    # target -> (document index, path to a field, an invalid value)
    "k8s": (0, ["spec", "replicas"], "two"),
    "kserve": (1, ["spec", "predictor", "containers", 0, "ports", 0, "containerPort"], "http"),
    "production-stack": (0, ["servingEngineSpec", "modelSpec", 0, "replicaCount"], "one"),
    "lws": (0, ["spec", "leaderWorkerTemplate", "size"], "one"),
    "rayservice": (0, ["spec", "rayClusterConfig", "workerGroupSpecs", 0, "replicas"], "x"),
}


@pytest.mark.parametrize("target", sorted(BREAKS))
def test_an_invalid_field_fails_the_check(shop, target: str) -> None:
    _store, remote, manifest = shop
    documents = TARGETS[target](plan_workload(manifest, remote, options()))
    index, path, value = BREAKS[target]
    broken = copy.deepcopy(documents)
    node = broken[index]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(SchemaError, match=str(path[-1])):
        check_documents(broken, K8S)


def test_an_unknown_field_fails_as_strict_field_validation_does(shop) -> None:
    """A CRD schema prunes unknown fields silently; the check refuses them (a typo in a
    field name would otherwise deploy without that setting)."""
    _store, remote, manifest = shop
    documents = TARGETS["kserve"](plan_workload(manifest, remote, options()))
    documents[1]["spec"]["predictor"]["minReplica"] = 2
    with pytest.raises(SchemaError, match="minReplica"):
        check_documents(documents, K8S)
    k8s = TARGETS["k8s"](plan_workload(manifest, remote, options()))
    k8s[0]["spec"]["template"]["spec"]["containers"][0]["startupProbes"] = {}
    with pytest.raises(SchemaError, match="startupProbes"):
        check_documents(k8s, K8S)


def test_the_kubernetes_version_named_is_the_one_checked(shop) -> None:
    """A field newer than the named cluster fails: probe-level terminationGracePeriodSeconds
    is in the 1.25 schemas, and an unknown version is a usage error."""
    _store, remote, manifest = shop
    documents = TARGETS["k8s"](plan_workload(manifest, remote, options()))
    assert "Kubernetes 1.25" in check_documents(documents, "1.25")[0]
    with pytest.raises(NeuronctlError, match="no schemas"):
        check_documents(documents, "1.99")


# --- what the pods run ------------------------------------------------------------------------


def test_the_server_is_the_launchers_command_and_variables(shop) -> None:
    """vLLM gets exactly what `serve --engine vllm` would run, for the installed directory."""
    from neuronctl.vllm.launch import serve_launch

    _store, remote, manifest = shop
    w = plan_workload(manifest, remote, options())
    launch = serve_launch(Path(MOUNT), manifest, host="0.0.0.0", port=8000,
                          served_model_name="org/model", target=C41)  # fmt: skip
    assert w.argv == ["python3", *launch.argv[1:]]
    assert w.env == launch.env and w.env["NEURON_COMPILED_ARTIFACTS"] == MOUNT
    container = TARGETS["k8s"](w)[0]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == w.argv
    assert {e["name"]: e["value"] for e in container["env"]} == launch.env


def test_install_is_the_init_step_and_the_server_mount_is_read_only(shop) -> None:
    _store, remote, manifest = shop
    w = plan_workload(manifest, remote, options())
    pod = TARGETS["k8s"](w)[0]["spec"]["template"]["spec"]
    init = pod["initContainers"][0]
    assert init["command"] + init["args"] == [
        "neuronctl", "install", remote.artifact_url(manifest.keys.dirname), MOUNT,
    ]  # fmt: skip
    assert pod["containers"][0]["volumeMounts"][0]["readOnly"] is True
    assert pod["terminationGracePeriodSeconds"] >= 300  # server.run.DRAIN_SECONDS
    probes = pod["containers"][0]
    assert probes["startupProbe"]["httpGet"]["path"] == "/v1/models"
    assert probes["readinessProbe"]["httpGet"]["path"] == "/health"


def test_kserve_storage_container_takes_only_neuronctl_uris(shop) -> None:
    """The ClusterStorageContainer must match this artifact's URI and not another model's
    s3:// or oci:// URI that KServe's own initializer serves."""
    import re

    _store, remote, manifest = shop
    storage, isvc = TARGETS["kserve"](plan_workload(manifest, remote, options()))
    regexes = [f["regex"] for f in storage["spec"]["supportedUriFormats"]]
    uri = remote.artifact_url(manifest.keys.dirname)
    assert any(re.search(r, uri) for r in regexes)
    for other in ("s3://bucket/models/llama", "oci://registry/models/llama:v1",
                  "gs://bucket/neuron-compiled-artifacts/x"):  # fmt: skip
        assert not any(re.search(r, other) for r in regexes)
    assert not any(re.search(r, "oci://reg.local/neuron:" + manifest.keys.dirname) for r in regexes)
    container = isvc["spec"]["predictor"]["containers"][0]
    assert container["name"] == "kserve-container"
    assert {"name": "STORAGE_URI", "value": uri} in container["env"]
    assert storage["spec"]["container"]["command"] == ["neuronctl", "install"]


def test_kserve_installs_a_registry_artifact_in_its_own_init_container(shop) -> None:
    """KServe serves any oci:// STORAGE_URI with its own OCI support, on by default, and never
    calls a storage container for it (kserve/kserve pkg/webhook/admission/pod/
    storage_initializer_injector.go, CommonStorageInitialization: the `ParseOciScheme` branch
    returns before the ClusterStorageContainer lookup; config/configmap/inferenceservice.yaml
    "enableModelcar": true). A registry artifact therefore goes through the predictor's own
    init container, with no storage URI for the webhook to act on."""
    import dataclasses

    _store, remote, manifest = shop
    w = plan_workload(manifest, remote, options(keys_secret="fleet-keys"))
    uri = f"oci://reg.local/neuron:{manifest.keys.dirname}"
    documents = TARGETS["kserve"](dataclasses.replace(w, source_uri=uri))
    assert [d["kind"] for d in documents] == ["InferenceService"]
    check_documents(documents, K8S)
    predictor = documents[0]["spec"]["predictor"]
    init = predictor["initContainers"][0]
    assert init["command"] + init["args"] == ["neuronctl", "install", uri, MOUNT]
    server = predictor["containers"][0]
    assert server["name"] == "kserve-container"
    assert all(e["name"] != "STORAGE_URI" for e in server["env"])
    assert server["volumeMounts"][0] == {"name": "artifact", "mountPath": MOUNT, "readOnly": True}
    assert {v["name"] for v in predictor["volumes"]} == {"artifact", "trusted-keys"}
    assert "storageUri" not in json.dumps(documents)


def test_production_stack_leaves_the_charts_own_flags_to_it(shop) -> None:
    _store, remote, manifest = shop
    w = plan_workload(manifest, remote, options())
    spec = TARGETS["production-stack"](w)[0]["servingEngineSpec"]["modelSpec"][0]
    extra = spec["vllmConfig"]["extraArgs"]
    assert spec["modelURL"] == MOUNT
    for flag in ("--model", "--host", "--port", "--no-enable-prefix-caching"):
        assert flag not in extra
    assert extra[extra.index("--tensor-parallel-size") + 1] == "4"
    assert spec["vllmConfig"]["enablePrefixCaching"] is False
    assert chart_args(["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m",
                       "--enable-prefix-caching", "--dtype", "float16"]) == ["--dtype", "float16"]


def test_production_stack_refuses_a_vllm_whose_cli_lacks_the_charts_flags(shop) -> None:
    _store, remote, manifest = shop
    w = plan_workload(manifest, remote, options(vllm_target="v0@0.9.2"))
    with pytest.raises(NeuronctlError, match="prefix-caching"):
        TARGETS["production-stack"](w)


def test_rayservice_asks_ray_for_the_tp_degree_in_neuron_cores(shop) -> None:
    import yaml

    _store, remote, manifest = shop
    w = plan_workload(manifest, remote, options())
    ray = TARGETS["rayservice"](w)[0]["spec"]
    app = yaml.safe_load(ray["serveConfigV2"])["applications"][0]
    assert app["deployments"][0]["ray_actor_options"]["resources"] == {"neuron_cores": 4}
    params = ray["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParams"]
    assert json.loads(params["resources"].strip("'")) == {"neuron_cores": 4}
    assert app["args"]["source_uri"] == w.source_uri
    assert app["args"]["num_replicas"] == w.replicas and app["args"]["neuron_cores"] == 4
    assert app["import_path"] == "neuronctl.fleet.rayserve:app"


# --- Neuron resources, memory -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("instance_type", "tp", "lnc", "wanted"),
    [
        ("inf2.24xlarge", 4, None, {NEURON_DEVICE: 2}),  # 2 cores per Inferentia2 device
        ("inf2.24xlarge", 1, None, {NEURON_CORE: 1}),  # not a whole device: one core
        ("trn2.48xlarge", 8, None, {NEURON_DEVICE: 2}),  # LNC 2: 4 logical cores a device
        ("trn2.48xlarge", 8, 1, {NEURON_DEVICE: 1}),  # LNC 1: 8 cores a device
        (None, 4, None, {NEURON_CORE: 4}),
    ],
)
def test_neuron_resources_from_the_tp_degree(tmp_path, instance_type, tp, lnc, wanted) -> None:
    override = {"logical_nc_config": lnc} if lnc else {}
    manifest = nxdi_manifest(tp_degree=tp, override_neuron_config=override)
    store = Store(tmp_path / "s")
    publish(store, manifest)
    remote = open_remote((tmp_path / "r").as_uri())
    remote.push(store.find(manifest.keys.dirname))
    w = plan_workload(manifest, remote, options(instance_type=instance_type, neuron_sdk=None))
    assert w.neuron == wanted
    assert w.resources()["limits"] == {"memory": w.resources()["requests"]["memory"], **wanted}


def test_memory_follows_the_artifacts_size(shop) -> None:
    from neuronctl.store.manifest import FileEntry

    _store, remote, manifest = shop
    sizes = {}
    for weights in (1 * 2**30, 9 * 2**30):
        files = {"weights/tp0_sharded_checkpoint.safetensors": FileEntry(size=weights, sha256="0")}
        sized = manifest.model_copy(update={"files": files})
        sizes[weights] = plan_workload(sized, remote, options()).resources()["requests"]
    assert sizes[1 * 2**30]["memory"] == "3Gi"  # 1 GiB of weights + 2 GiB overhead
    assert sizes[9 * 2**30]["memory"] == "11Gi"
    assert sizes[9 * 2**30]["ephemeral-storage"] == "11Gi"  # 9.9 GiB + 1 GiB, rounded up


def test_a_torch_artifact_is_served_by_neuronctl_without_neuron_resources(tmp_path) -> None:
    from tests.helpers import publish_stub_artifact

    store = Store(tmp_path / "s")
    spec = {"backend": "torch", "tp_degree": 1}
    keys = {"graph_key": "g", "weights_key": "w", "artifact_key": "b" * 64}
    path = publish_stub_artifact(store, "b" * 20, "org/tiny", spec, keys)
    remote = open_remote((tmp_path / "r").as_uri())
    remote.push(path)
    from neuronctl.store.manifest import read_manifest

    manifest = read_manifest(path)
    w = plan_workload(manifest, remote, DeployOptions(image="registry.local/neuronctl:1"))
    assert w.server == "neuronctl" and w.neuron == {}
    assert w.argv[:3] == ["neuronctl", "serve", MOUNT]
    pod = TARGETS["k8s"](w)[0]["spec"]["template"]["spec"]
    assert "tolerations" not in pod and "nodeSelector" not in pod
    assert pod["containers"][0]["resources"]["requests"]["cpu"] == "1"
    check_documents(TARGETS["k8s"](w), K8S)
    with pytest.raises(NeuronctlError, match="vLLM cannot load"):
        plan_workload(manifest, remote, DeployOptions(image="x", server="vllm"))


# --- refusals ---------------------------------------------------------------------------------


def test_an_artifact_the_remote_does_not_hold_is_refused(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    manifest = nxdi_manifest()
    publish(store, manifest)
    remote = open_remote((tmp_path / "empty").as_uri())
    with pytest.raises(NotFoundError, match="not published at"):
        plan_workload(manifest, remote, options())


@pytest.mark.parametrize(
    ("fields", "opts", "reason"),
    [
        ({}, {"instance_type": "inf2.xlarge"}, "needs 4 NeuronCores, inf2.xlarge has 2"),
        ({}, {"neuron_sdk": "2.25"}, "compiled with SDK 2.24"),
        ({"cc_flags": "--target=trn2"}, {}, "compiled with --target trn2"),
        ({}, {"sdk_versions": {"neuronx-cc": "2.20.0.0"}}, "neuronx-cc compiled with 2.19"),
        ({}, {"instance_type": "inf2.48xlarge", "neuron_sdk": "2.29"}, "Trn2 and newer"),
    ],
)
def test_what_the_named_host_would_compile_is_refused(tmp_path, fields, opts, reason) -> None:
    manifest = nxdi_manifest(**fields)
    if opts.get("neuron_sdk") == "2.29":
        versions = {**SDK_2_24, "neuronx-distributed-inference": "0.9.0"}
        manifest = manifest.model_copy(update={"backend_versions": versions})
    store = Store(tmp_path / "s")
    publish(store, manifest)
    remote = open_remote((tmp_path / "r").as_uri())
    remote.push(store.find(manifest.keys.dirname))
    with pytest.raises(NotLoadableError, match=reason):
        plan_workload(manifest, remote, options(**opts))


def test_a_tnx_artifact_is_refused_on_an_sdk_without_transformers_neuronx(tmp_path) -> None:
    manifest = make_manifest("tnx", cc_flags="")
    store = Store(tmp_path / "s")
    publish(store, manifest)
    remote = open_remote((tmp_path / "r").as_uri())
    remote.push(store.find(manifest.keys.dirname))
    with pytest.raises(NotLoadableError, match="no Transformers NeuronX"):
        plan_workload(manifest, remote, options(neuron_sdk="2.26", vllm_target="v0@0.9.2"))


def test_instance_lnc_follows_the_compile() -> None:
    spec = nxdi_manifest(cc_flags="--logical-nc-config 1").spec
    assert instance("trn2.48xlarge", spec).cores == 128
    assert instance("inf2.48xlarge", spec).family is INF2
    with pytest.raises(NeuronctlError, match="unknown Neuron instance type"):
        instance("p5.48xlarge", spec)


# --- the command ------------------------------------------------------------------------------


def test_deploy_command_json_and_errors(shop) -> None:
    store, remote, manifest = shop
    args = ["--store", str(store.root), "--remote", remote.url, "--image", "r/vllm:1",
            "--vllm-target", C41, "--instance-type", "inf2.24xlarge"]  # fmt: skip
    done = cli_in_process("deploy", "k8s", manifest.keys.dirname, *args, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [d["kind"] for d in report["documents"]] == ["Deployment", "Service"]
    assert report["checked"] and report["workload"]["neuron"] == {NEURON_DEVICE: 2}
    text = cli_in_process("deploy", "lws", manifest.keys.dirname, *args)
    assert text.returncode == 0 and "kind: LeaderWorkerSet" in text.stdout
    unknown = cli_in_process("deploy", "nomad", manifest.keys.dirname, *args)
    assert unknown.returncode == 2 and "unknown target" in unknown.stderr
    small = cli_in_process("deploy", "k8s", manifest.keys.dirname, *args[:-1], "inf2.xlarge")
    assert small.returncode == 1 and "Traceback" not in small.stderr
    assert "needs 4 NeuronCores" in small.stderr


def test_trusted_keys_secret_reaches_the_install_step(shop) -> None:
    """The install verifies signatures against the keys it trusts: a named Secret is mounted
    for it and named in NEURONCTL_TRUSTED_KEYS (store/signing.py TrustPolicy.load reads the
    variable's paths); every target that can mount it still validates."""
    _store, remote, manifest = shop
    w = plan_workload(manifest, remote, options(keys_secret="neuron-publishers"))
    pod = TARGETS["k8s"](w)[0]["spec"]["template"]["spec"]
    init = pod["initContainers"][0]
    assert {"name": "NEURONCTL_TRUSTED_KEYS", "value": "/etc/neuronctl/trusted-keys"} in init["env"]
    assert {"name": "trusted-keys", "secret": {"secretName": "neuron-publishers"}} in pod["volumes"]
    assert any(m["name"] == "trusted-keys" for m in init["volumeMounts"])
    for target in ("k8s", "production-stack", "lws", "rayservice"):
        check_documents(TARGETS[target](w), K8S)
    with pytest.raises(NeuronctlError, match="cannot mount a Secret"):
        TARGETS["kserve"](w)
    plain = plan_workload(manifest, remote, options())
    assert any("no --trusted-keys-secret" in note for note in plain.notes)
