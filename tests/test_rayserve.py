"""Ray Serve for real: the RayService target's application (neuronctl.fleet.rayserve) on a
local Ray cluster bound to 127.0.0.1, two replicas each installing the artifact and serving
it, driven with the openai client through Ray Serve's HTTP proxy; one replica's engine killed
and reported unhealthy by Ray. Slow (Ray and two model servers start); skipped without
`ray[serve]`."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason='pip install "ray[serve]"')
pytestmark = pytest.mark.slow

NEURONCTL = [sys.executable, "-m", "neuronctl.cli.main"]


def install_argv() -> list[str]:
    """`neuronctl install` where this neuronctl has it; else a plain copy of the shared
    mount's artifact directory stands in for it (the install command is its own test's)."""
    probe = subprocess.run([*NEURONCTL, "install", "--help"], capture_output=True)
    if probe.returncode == 0:
        return [*NEURONCTL, "install", "--allow-unsigned"]
    copy = "import shutil, sys; shutil.copytree(sys.argv[1][7:], sys.argv[2], dirs_exist_ok=True)"
    return [sys.executable, "-c", copy]


def server_processes(marker: str) -> list[int]:
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "serve" in cmdline and any(marker in part for part in cmdline):
            found.append(proc.info["pid"])
    return found


def test_two_replicas_serve_chat_and_completions_and_a_dead_engine_is_unhealthy(
    compiled_artifact: Path, tmp_path: Path
) -> None:
    import openai
    import ray
    from ray import serve
    from ray.serve.schema import DeploymentStatus, DeploymentStatusTrigger

    from neuronctl.fleet.rayserve import app, free_port
    from neuronctl.fleet.workload import DeployOptions, plan_workload
    from neuronctl.store.manifest import read_manifest
    from neuronctl.store.remote.client import open_remote

    remote = open_remote((tmp_path / "remote").as_uri())
    remote.push(compiled_artifact)
    manifest = read_manifest(compiled_artifact)
    workload = plan_workload(manifest, remote, DeployOptions(image="unused", replicas=2))
    # The argv deploy wrote, run by this interpreter, trusting the unsigned local build.
    argv = [*NEURONCTL, *workload.argv[1:], "--allow-unsigned"]
    port = free_port()
    ray.init(address="local", num_cpus=4, include_dashboard=False,
             _node_ip_address="127.0.0.1")  # fmt: skip
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        built = app({
            "source_uri": workload.source_uri, "argv": argv, "env": workload.env,
            "served_model_name": workload.served_model_name, "install": install_argv(),
            "num_replicas": 2, "neuron_cores": 0,
        })
        serve.run(built, name="model", route_prefix="/")
        status = serve.status().applications["model"].deployments["NeuronctlServer"]
        assert status.replica_states.get("RUNNING") == 2

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        name = workload.served_model_name
        chat = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.choices[0].message.content is not None
        text = client.completions.create(model=name, prompt="hello", max_tokens=4)
        assert text.usage is not None and text.usage.completion_tokens > 0
        streamed = list(client.completions.create(model=name, prompt="a", max_tokens=3,
                                                  stream=True))  # fmt: skip
        assert streamed

        servers = server_processes("neuronctl-replica-")
        assert len(servers) == 2
        import psutil

        psutil.Process(servers[0]).kill()
        seen = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            d = serve.status().applications["model"].deployments["NeuronctlServer"]
            seen.append((d.status, d.status_trigger))
            if (d.status is DeploymentStatus.UNHEALTHY
                    or d.status_trigger is DeploymentStatusTrigger.HEALTH_CHECK_FAILED):
                break
            time.sleep(0.2)
        assert seen[-1][0] is DeploymentStatus.UNHEALTHY or seen[-1][1] is (
            DeploymentStatusTrigger.HEALTH_CHECK_FAILED
        ), seen[-5:]
        # The other replica still answers while Ray replaces the dead one.
        again = client.completions.create(model=name, prompt="hello", max_tokens=2)
        assert again.choices
    finally:
        serve.shutdown()
        ray.shutdown()
