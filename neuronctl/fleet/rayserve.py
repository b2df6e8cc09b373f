"""A Ray Serve application that serves an artifact (the RayService target's import path,
`neuronctl.fleet.rayserve:app`): each replica installs the artifact with `neuronctl install`
into a directory of its own, starts the server deploy would run (vLLM or `neuronctl serve`)
on a loopback port, and answers every request Ray Serve's HTTP proxy hands it by forwarding
it there, streams included. Its health check is the server's: a dead process or a /health
that is not 200 (an engine that died answers 503) makes Ray report the replica unhealthy and
replace it.

Ray Serve is imported here only: `pip install "ray[serve]"` where this runs.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
from ray import serve
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from neuronctl.fleet.workload import MOUNT  # where the argv deploy wrote expects the artifact

INSTALL_ARGV = ("neuronctl", "install")
START_TIMEOUT_S = 1800.0
HOP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def local_argv(argv: Sequence[str], directory: str, port: int) -> list[str]:
    """The server's argv for this replica: its own artifact directory, loopback, its port."""
    out = [directory if a == MOUNT else a for a in argv]
    for flag, value in (("--host", "127.0.0.1"), ("--port", str(port))):
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


@serve.deployment(name="NeuronctlServer", health_check_period_s=5, health_check_timeout_s=30)
class NeuronctlServer:
    def __init__(
        self,
        source_uri: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        served_model_name: str = "",
        install: Sequence[str] = INSTALL_ARGV,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        self.directory = tempfile.mkdtemp(prefix="neuronctl-replica-")
        # The KServe storage-initializer contract: non-zero on any failure, and then this
        # replica fails to start and Ray says why.
        subprocess.run([*install, source_uri, self.directory], check=True)
        self.port = free_port()
        variables = {k: (self.directory if v == MOUNT else v) for k, v in (env or {}).items()}
        self.process = subprocess.Popen(
            local_argv(argv, self.directory, self.port), env={**os.environ, **variables}
        )
        self.base = f"http://127.0.0.1:{self.port}"
        self._wait_until_loaded(start_timeout_s)
        self.client = httpx.AsyncClient(base_url=self.base, timeout=None)

    def _wait_until_loaded(self, timeout: float) -> None:
        """Up when /v1/models answers: /health can answer before the weights are loaded."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}")
            try:
                if httpx.get(self.base + "/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.process.kill()
        raise RuntimeError(f"the server did not load the model within {timeout:.0f} s")

    async def __call__(self, request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        upstream = self.client.build_request(
            request.method,
            request.url.path,
            params=str(request.query_params),
            headers=headers,
            content=await request.body(),
        )
        answer = await self.client.send(upstream, stream=True)
        passed = {k: v for k, v in answer.headers.items() if k.lower() not in HOP_HEADERS}
        return StreamingResponse(
            _relay(answer), status_code=answer.status_code, headers=passed
        )

    def server_port(self) -> int:
        """The replica's own server (the bench compares it with the proxy's path)."""
        return self.port

    async def check_health(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"the server exited with {self.process.returncode}")
        answer = await self.client.get("/health", timeout=10)
        if answer.status_code != 200:
            raise RuntimeError(f"/health answered {answer.status_code}: {answer.text[:200]}")

    def __del__(self) -> None:
        process = getattr(self, "process", None)
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        shutil.rmtree(getattr(self, "directory", ""), ignore_errors=True)


async def _relay(answer: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for chunk in answer.aiter_raw():
            yield chunk
    finally:
        await answer.aclose()


def app(args: dict[str, Any]) -> Any:
    """The application builder serveConfigV2 names: the RayService target's `args`. Each
    replica asks Ray for the artifact's tp degree in neuron_cores (none for torch)."""
    actor: dict[str, Any] = {"num_cpus": 1}
    if int(args.get("neuron_cores") or 0):
        actor["resources"] = {"neuron_cores": int(args["neuron_cores"])}
    deployment = NeuronctlServer.options(  # type: ignore[attr-defined]  # serve.deployment's
        num_replicas=int(args.get("num_replicas") or 1), ray_actor_options=actor
    )
    return deployment.bind(
        args["source_uri"],
        list(args["argv"]),
        dict(args.get("env") or {}),
        str(args.get("served_model_name") or ""),
        tuple(args.get("install") or INSTALL_ARGV),
    )
