"""The OpenAI-compatible HTTP API, a thin layer over the engine: it parses, tokenizes (in a
worker thread), submits, and turns engine events into typed JSON or server-sent events. It
never touches tensors.

create_app puts it together: the endpoints (routes.py), which answer through streams.py, the
error handlers (errors.py) and, in front of them all, the guard (guard.py) that refuses work
while draining, without the API key or over the body limit before any /v1 body is read.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI

from neuronctl import __version__
from neuronctl.engine.engine import Engine
from neuronctl.server.errors import install_error_handlers
from neuronctl.server.guard import (
    MAX_CLIENT_REQUESTS,
    REFUSAL_BURST,
    REFUSAL_SHARE,
    Guard,
    RefusalPacer,
)
from neuronctl.server.metrics import Metrics
from neuronctl.server.routes import TextModel, add_routes

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# Without a limit given: this many characters per prompt token the artifact accepts (a longer
# text cannot fit, and tokenizing it would only cost time), and never fewer than the floor.
CHARS_PER_TOKEN, MIN_PROMPT_CHARS = 32, 65536


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_chars: int | None = None  # None: from the engine's longest prompt
    max_client_requests: int = MAX_CLIENT_REQUESTS  # one client's requests in flight
    refusal_share: float = REFUSAL_SHARE  # of the time one client's refused requests may take
    refusal_burst: float = REFUSAL_BURST  # seconds of them before its requests wait

    def prompt_chars(self, max_prompt_tokens: int) -> int:
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return max(CHARS_PER_TOKEN * max_prompt_tokens, MIN_PROMPT_CHARS)


def create_app(
    engine: Engine,
    model: TextModel,
    served_model_name: str,
    api_key: str | None = None,
    max_model_len: int | None = None,
    limits: Limits = Limits(),
) -> FastAPI:
    app = FastAPI(title="neuronctl", version=__version__, redoc_url=None)  # /docs, /openapi.json
    app.state.draining = False
    metrics = Metrics(engine.stats, served_model_name, max_model_len or engine.runner.seq_len)
    app.state.metrics = metrics
    max_chars = limits.prompt_chars(engine.max_prompt)
    add_routes(app, engine, model, served_model_name, max_model_len, max_chars, metrics)
    install_error_handlers(app)
    app.state.pacer = RefusalPacer(limits.refusal_share, limits.refusal_burst)
    app.add_middleware(
        Guard,  # type: ignore[arg-type]
        app_ref=app,
        metrics=metrics,
        api_key=api_key,
        max_body_bytes=limits.max_body_bytes,
        max_client_requests=limits.max_client_requests,
        pacer=app.state.pacer,
    )
    return app
