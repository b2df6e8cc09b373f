"""The guard in front of the model: before any body is read, refuse work while draining
(503), check the API key (401), cap one client's requests in flight (429) and the body's size
(413), so an unauthenticated, surplus or huge body costs nothing. It also counts every request
for /metrics.

A client is the peer's address (`client_of`). uvicorn puts the address X-Forwarded-For names
there only when the peer is a trusted proxy (its `forwarded_allow_ips`, `$FORWARDED_ALLOW_IPS`,
127.0.0.1 and ::1 by default): anyone else's X-Forwarded-For is ignored, since a client
could name a new address in every request and so never reach its own limit."""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

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
# The whitespace JSON allows between a key and its colon, dropped before counting: a regular
# expression for `"\s*:` took 4-8 ms of the event loop per 400 KB, most of what each refusal
# of a flood cost; dropping the bytes and counting `":` takes 0.8 ms.
_JSON_SPACE = b" \t\r\n"


def json_keys(chunk: bytes) -> int:
    """Object keys in `chunk` of a JSON body, at most: a quote, JSON whitespace, a colon (an
    escaped quote in a string so followed counts too)."""
    return chunk.translate(None, _JSON_SPACE).count(b'":')


# /v1, /tokenize and /detokenize requests one client may have in flight; beyond it 429,
# before the body is read: a client with a thousand connections holds as many parsed
# bodies, prompts and waiting places as it has connections. Well above what one honest
# client reads at once (an evaluation harness or a load test runs 32-64 streams).
MAX_CLIENT_REQUESTS = 64


# A client's refused requests (any 4xx) may take this share of the server's time, after a
# burst of REFUSAL_BURST seconds of them; past it, its next requests wait, unread, one at a
# time, until its share is back. A flood of requests the server refuses costs the server
# each time (the body read, parsed, checked): one client repeating 259-prompt completions on
# 4 connections drew 2,000 refusals a second from the event loop, which shares the core with
# the engine; and its 4 connections, let through together after each wait, came as a burst.
# An honest client's rare refusal never waits long; nothing is refused for pacing.
REFUSAL_SHARE = 0.02
REFUSAL_BURST = 0.25
# Within the burst too, a client's refusals may take this share of the server's time at any
# moment: after a refusal, its next request waits nine times as long as that one took. The
# server's event loop and its engine thread share the cores given to it: answered back to
# back, a burst of 250 refusals took the core from the engine (decode steps of 0.6 ms took
# 5-6 ms; a shorter GIL switch interval changed nothing), and the bystander's p99 was 1.5-1.7x
# its solo p99 where the burst fell in; at half the time 1.8-2.3x for large bodies, at a
# quarter up to 2.3x, at a tenth 0.8-1.6x.
REFUSAL_PEAK_SHARE = 0.1
# What each refusal is charged at least: the HTTP work around the guard (the request parsed,
# the answer written, a new connection after a close) is about this much and the guard does
# not see it; 430 tiny refusals a second charged only their own time still took 28 % of the
# server's core at a 0.1 share.
MIN_REFUSAL_CHARGE = 0.001
# A wait for a piece of the body longer than this is the client's link, not the server's work,
# and is not charged: a slow link's refused upload of 2 s was charged 2 s, and its client then
# waited 90 s. Shorter waits are charged: reading a piece the kernel already holds is the
# server's own work (uvicorn's parser), and charging none of the wait let a flood's refusals
# run a third more often (p99 2.5-2.8x where it was 1.5-1.6x).
LINK_WAIT = 0.005
# Past this many clients remembered, those whose debt has leaked away are forgotten, then the
# longest unrefused, so an attacker with many addresses cannot grow the table.
MAX_PACED_CLIENTS = 4096


_UNREFUSED = (0.0, 0.0, 0.0)  # a client's (debt, as of, when it may run) before any refusal


@dataclass
class _Gate:
    """One paced client's requests, let through one at a time."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class RefusalPacer:
    """Per client, the seconds its refused requests took, leaking at `share` per second, and
    when its last refusals let its next request run (at `peak` share of the time)."""

    def __init__(
        self,
        share: float = REFUSAL_SHARE,
        burst: float = REFUSAL_BURST,
        clock: Callable[[], float] = time.monotonic,
        peak: float = REFUSAL_PEAK_SHARE,
    ) -> None:
        self.share, self.burst, self.clock, self.peak = share, burst, clock, peak
        # client -> (debt, as of, when its next request may run)
        self.debts: dict[str | None, tuple[float, float, float]] = {}
        self.gates: dict[str | None, _Gate] = {}  # clients with paced requests waiting

    def debt(self, client: str | None) -> float:
        debt, at, _ = self.debts.get(client, _UNREFUSED)
        return max(0.0, debt - self.share * (self.clock() - at))

    def charge(self, client: str | None, seconds: float) -> None:
        now = self.clock()
        debt = self.debt(client) + seconds
        pause = seconds * (1 / self.peak - 1)  # so the refusal is `peak` of its time and pause
        ready = max(now, self.debts.get(client, _UNREFUSED)[2]) + pause
        self.debts.pop(client, None)  # the table stays in the order of the last refusal
        if len(self.debts) >= MAX_PACED_CLIENTS:
            owing = [(c, v) for c, v in self.debts.items() if self.wait(c) or self.debt(c)]
            self.debts = dict(owing[-MAX_PACED_CLIENTS // 2 :])
        self.debts[client] = (debt, now, ready)

    def wait(self, client: str | None) -> float:
        """Seconds `client`'s next request waits before it is read: after its last refusals
        until they are `peak` of the time, and past its burst until its share is back."""
        ready = self.debts.get(client, _UNREFUSED)[2] - self.clock()
        return max(0.0, ready, (self.debt(client) - self.burst) / self.share)

    @asynccontextmanager
    async def turn(self, client: str | None) -> AsyncIterator[None]:
        """`client`'s request may run: at once when it need not wait; else one at a time
        (the turn lasts until the request ends), each once its wait is over."""
        if self.wait(client) == 0 and client not in self.gates:
            yield
            return
        gate = self.gates.setdefault(client, _Gate())
        gate.users += 1
        try:
            async with gate.lock:
                while (wait := self.wait(client)) > 0:
                    await asyncio.sleep(wait)
                yield
        finally:
            gate.users -= 1
            if not gate.users:
                del self.gates[client]


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
        pacer: RefusalPacer | None = None,
    ) -> None:
        self.app, self.app_ref, self.metrics = app, app_ref, metrics
        self.pacer = pacer or RefusalPacer()
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
        client = client_of(scope)
        async with self.pacer.turn(client):
            started, waited = time.monotonic(), [0.0]

            async def timed_receive() -> Message:
                before = time.monotonic()
                try:
                    return await receive()
                finally:
                    waited[0] += max(0.0, time.monotonic() - before - LINK_WAIT)

            status = await self._guarded(scope, timed_receive, send, endpoint, client)
            if 400 <= status < 500:
                took = time.monotonic() - started - waited[0]
                self.pacer.charge(client, max(MIN_REFUSAL_CHARGE, took))

    async def _guarded(
        self, scope: Scope, receive: Receive, send: Send, endpoint: str, client: str | None
    ) -> int:
        refusal = self._refusal(scope)
        if refusal is None and self.per_client.get(client, 0) >= self.max_client:
            refusal = self._too_many_requests()
        if refusal is not None:
            self.metrics.count_request(endpoint, refusal.status_code)
            await refusal(scope, receive, send)
            return refusal.status_code
        self.per_client[client] = self.per_client.get(client, 0) + 1
        try:
            return await self._run(scope, receive, send, endpoint)
        finally:
            self.per_client[client] -= 1
            if not self.per_client[client]:
                del self.per_client[client]

    async def _run(self, scope: Scope, receive: Receive, send: Send, endpoint: str) -> int:
        """Runs the app under the body limits; the response's status."""
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
                keys += json_keys(body)
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
        return status

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
