"""Run the API with uvicorn around a started engine, and shut down gracefully.

SIGTERM (or Ctrl-C once): /health turns 503, new /v1 requests get 503, uvicorn stops
accepting connections and waits for in-flight responses (streams included) to finish, then
the engine drains and stops, and the process exits 0.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

import uvicorn

from neuronctl.engine.engine import Engine
from neuronctl.errors import NeuronctlError
from neuronctl.server.app import TextModel, create_app

DRAIN_SECONDS = 300  # longest wait for in-flight requests at shutdown


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: Any) -> None:
        super().__init__(config)
        self._app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._app.state.draining = True
        super().handle_exit(sig, frame)


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
) -> None:
    app = create_app(engine, model, served_model_name, api_key, max_model_len)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=DRAIN_SECONDS,
        access_log=False,
    )
    server = _DrainingServer(config, app)
    # uvicorn re-raises the signal that stopped it once it is done; with this handler in place
    # that re-raise is a no-op, so a graceful SIGTERM exits 0 instead of dying from the signal.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    engine.start()
    try:
        server.run()
    except SystemExit as exc:  # uvicorn exits 1 when it cannot bind
        if exc.code:
            raise NeuronctlError(
                f"could not start the server on {host}:{port} (see the log above)",
                "is another process using the port? pick another with --port",
            ) from None
    finally:
        engine.stop(drain=True, timeout=DRAIN_SECONDS)
        signal.signal(signal.SIGTERM, previous)
