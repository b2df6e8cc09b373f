"""The guard in front of the model: before any body is read, refuse work while draining
(503), check the API key (401), cap one client's requests in flight (429) and the body's size
(413), so an unauthenticated, surplus or huge body costs nothing. It also counts every request
for /metrics.

A client is the peer's address (`client_of`). uvicorn puts the address X-Forwarded-For names
there only when the peer is a trusted proxy (its `forwarded_allow_ips`, `$FORWARDED_ALLOW_IPS`,
127.0.0.1 and ::1 by default): anyone else's X-Forwarded-For is ignored, since a client
could name a new address in every request and so never reach its own limit."""

from __future__ import annotations

import hmac
import re

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from neuronctl.server.errors import error_response
from neuronctl.server.metrics import Metrics

# Paths /metrics counts by name; every other path counts as "other".
ENDPOINTS = (
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/health",
    "/metrics",
    "/ping",
    "/version",
    "/tokenize",
    "/detokenize",
)


# FastAPI's interactive docs and the schema they read: they describe every endpoint and
# field, so with a key set they take it too.
DOCS_PATHS = ("/docs", "/docs/oauth2-redirect", "/openapi.json")


# JSON object keys a body may hold, counted in the raw bytes as they arrive (a quote, then a
# colon): parsing is what costs, and it runs on the event loop every request shares. 450,000
# logit_bias keys in 6.6 MB took 0.9 s of json.loads each, and two senders starved a
# bystander. What a request may hold (1,024 messages of a few keys, 1,024 logit_bias
# entries, the other fields) stays far below this.
MAX_JSON_KEYS = 16384
_KEY_END = re.compile(rb'"\s*:')


# /v1, /tokenize and /detokenize requests one client may have in flight; beyond it 429,
# before the body is read: a client with a thousand connections holds as many parsed
# bodies, prompts and waiting places as it has connections. Well above what one honest
# client reads at once (an evaluation harness or a load test runs 32-64 streams).
MAX_CLIENT_REQUESTS = 64


def client_of(scope: Scope) -> str | None:
    """Whose a request is, for its share: the peer's host (see the module's docstring)."""
    peer = scope.get("client")
    return str(peer[0]) if peer else None


def guarded(path: str) -> bool:
    """The paths that run the model or its tokenizer, or describe the API: the API key and
    size limits apply (vLLM leaves /tokenize open; here it costs tokenizer time, so it takes
    the key too)."""
    return path.startswith("/v1") or path in ("/tokenize", "/detokenize", *DOCS_PATHS)


class Guard:
    """ASGI middleware, before any body is read: draining (503), the API key on /v1 (401), the
    body size (413, from Content-Length or while it streams in). Counts every request for
    /metrics and how many /v1 requests are in flight (the drain waits for them)."""

    def __init__(
        self,
        app: ASGIApp,
        app_ref: FastAPI,
        metrics: Metrics,
        api_key: str | None,
        max_body_bytes: int,
        max_client_requests: int = MAX_CLIENT_REQUESTS,
    ) -> None:
        self.app, self.app_ref, self.metrics = app, app_ref, metrics
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.max_body = max_body_bytes
        self.max_client = max_client_requests
        self.per_client: dict[str | None, int] = {}  # guarded requests in flight, by client
        app_ref.state.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "other"
        if not guarded(path):
            await self._run(scope, receive, send, endpoint)
            return
        refusal = self._refusal(scope)
        client = client_of(scope)
        if refusal is None and self.per_client.get(client, 0) >= self.max_client:
            refusal = self._too_many_requests()
        if refusal is not None:
            self.metrics.count_request(endpoint, refusal.status_code)
            await refusal(scope, receive, send)
            return
        self.per_client[client] = self.per_client.get(client, 0) + 1
        try:
            await self._run(scope, receive, send, endpoint)
        finally:
            self.per_client[client] -= 1
            if not self.per_client[client]:
                del self.per_client[client]

    async def _run(self, scope: Scope, receive: Receive, send: Send, endpoint: str) -> None:
        status, started, too_large = 500, False, False

        async def send_and_note(message: Message) -> None:
            nonlocal status, started
            if too_large:  # the 413 went out already; the app's own answer goes nowhere
                return
            if message["type"] == "http.response.start":
                status, started = message["status"], True
            await send(message)

        seen = keys = 0

        async def capped_receive() -> Message:
            nonlocal seen, keys, too_large, status
            message = await receive()
            if message["type"] == "http.request" and not too_large:
                body = message.get("body", b"")
                seen += len(body)
                keys += len(_KEY_END.findall(body))
                refusal = self._too_large() if seen > self.max_body else None
                if refusal is None and keys > MAX_JSON_KEYS:
                    refusal = self._too_many_keys()
                if refusal is not None:  # answer now; the app sees the client gone
                    too_large, status = True, refusal.status_code
                    await refusal(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        state = self.app_ref.state
        state.in_flight += 1
        try:
            await self.app(scope, capped_receive, send_and_note)
        finally:
            state.in_flight -= 1
            self.metrics.count_request(endpoint, status)

    def _refusal(self, scope: Scope) -> JSONResponse | None:
        if self.app_ref.state.draining:
            return error_response(503, "the server is shutting down")
        headers = dict(scope["headers"])
        if self.expected is not None:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                return error_response(
                    401, "missing or wrong API key: send 'Authorization: Bearer KEY'"
                )
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body:
            return self._too_large()
        return None

    def _too_many_requests(self) -> JSONResponse:
        return error_response(
            429,
            f"this client has {self.max_client} requests in flight, the most one client may "
            "have; wait for an answer before sending more",
            code="too_many_requests",
            close=True,
        )

    def _too_many_keys(self) -> JSONResponse:
        return error_response(
            400,
            f"the request body has over {MAX_JSON_KEYS} JSON object keys; no request needs "
            "that many (logit_bias takes 1024 entries, messages 1024)",
            code="too_many_keys",
            close=True,
        )

    def _too_large(self) -> JSONResponse:
        return error_response(
            413,
            f"the request body is over this server's limit of {self.max_body} bytes",
            code="body_too_large",
            close=True,
        )
