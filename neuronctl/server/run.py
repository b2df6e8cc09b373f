"""Run the API with uvicorn around a started engine, and shut down gracefully.

The port is bound before anything says "serving on", so a busy port is one error line.
SIGTERM (or Ctrl-C once): the server drains. /health answers 503 and new /v1 requests get
503 while the requests already in flight finish (streams included); once none is left (or
after DRAIN_SECONDS) uvicorn stops accepting connections, the engine stops and the process
exits 0. A second signal skips the wait for in-flight requests; a third Ctrl-C forces.
"""

from __future__ import annotations

import ipaddress
import signal
import socket
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from neuronctl import process
from neuronctl.engine.engine import EXIT_JOIN_SECONDS, Engine
from neuronctl.errors import NeuronctlError
from neuronctl.server.app import Limits, create_app
from neuronctl.server.routes import TextModel

DRAIN_SECONDS = 300  # longest wait for in-flight requests at shutdown


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: Any, engine: Engine) -> None:
        super().__init__(config)
        self._app, self._engine = app, engine
        self._drain_until: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_until is None:  # the first signal: drain, keep answering /health
            self._app.state.draining = True
            self._drain_until = time.monotonic() + DRAIN_SECONDS
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self._drain_until is not None and not self.should_exit:
            stats = self._engine.stats()
            idle = not (stats["waiting"] or stats["running"] or self._app.state.in_flight)
            dead = self._engine.watchdog() is not None  # nothing it holds will finish
            if idle or dead or time.monotonic() > self._drain_until:
                self.should_exit = True
        return await super().on_tick(counter)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """Listen on host:port now, so a busy port fails before anything is announced."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        raise NeuronctlError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}",
            "is another process using the port? pick another with --port",
        ) from None
    sock.set_inheritable(True)
    return sock


def run_server(
    engine: Engine,
    model: TextModel,
    *,
    served_model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_model_len: int | None = None,
    log_level: str = "info",
    limits: Limits = Limits(),
    on_ready: Callable[[], None] | None = None,
) -> None:
    sock = bind(host, port)
    if api_key is None and not is_loopback(host):
        print(
            f"warning: serving on {host} without an API key: anyone who can reach this port "
            "can use it (set --api-key or NEURONCTL_API_KEY)",
            file=sys.stderr,
        )
    app = create_app(engine, model, served_model_name, api_key, max_model_len, limits)
    config = uvicorn.Config(
        app,
        log_level=log_level,
        timeout_graceful_shutdown=DRAIN_SECONDS,
        access_log=True,  # one line per request at the default level, as vLLM's server
    )
    server = _DrainingServer(config, app, engine)
    # uvicorn re-raises the signal that stopped it once it is done; with this handler in place
    # that re-raise is a no-op, so a graceful SIGTERM exits 0 instead of dying from the signal.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    engine.start()
    process.freeze_startup_heap()
    if on_ready is not None:
        on_ready()
    try:
        server.run(sockets=[sock])
    finally:
        dead = engine.watchdog() is not None  # its thread may be stuck for good
        engine.stop(drain=not dead, timeout=EXIT_JOIN_SECONDS if dead else DRAIN_SECONDS)
        signal.signal(signal.SIGTERM, previous)
        sock.close()
