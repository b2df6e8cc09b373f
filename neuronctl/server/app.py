"""The OpenAI-compatible HTTP API, a thin layer over the engine: it parses, tokenizes (in a
worker thread), submits, and turns engine events into typed JSON or server-sent events. It
never touches tensors.

Before any /v1 body is read, `Guard` refuses work while draining (503), checks the API key
(401) and caps the body's size (413), so an unauthenticated or huge body costs nothing.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from neuronctl.engine.engine import Engine, RequestHandle
from neuronctl.engine.errors import EngineStoppedError, QueueFullError, RequestError
from neuronctl.engine.request import Event, RequestOutput
from neuronctl.engine.sampling import SamplingParams
from neuronctl.errors import UsageError
from neuronctl.server.metrics import CONTENT_TYPE, Metrics
from neuronctl.server.protocol import (
    ERROR_TYPES,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatRequest,
    Chunk,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Delta,
    ModelCard,
    ModelList,
    Usage,
    error_body,
)

ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# Without a limit given: this many characters per prompt token the artifact accepts (a longer
# text cannot fit, and tokenizing it would only cost time), and never fewer than the floor.
CHARS_PER_TOKEN, MIN_PROMPT_CHARS = 32, 65536


class TextModel(Protocol):
    """What the API needs from a loaded artifact (engine.loader.LoadedArtifact)."""

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]: ...


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_chars: int | None = None  # None: from the engine's longest prompt

    def prompt_chars(self, max_prompt_tokens: int) -> int:
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return max(CHARS_PER_TOKEN * max_prompt_tokens, MIN_PROMPT_CHARS)


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    body = error_body(message, ERROR_TYPES.get(status, "invalid_request_error"), param, code)
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return JSONResponse(body, status_code=status, headers=headers)


def create_app(
    engine: Engine,
    model: TextModel,
    served_model_name: str,
    api_key: str | None = None,
    max_model_len: int | None = None,
    limits: Limits = Limits(),
) -> FastAPI:
    app = FastAPI(title="neuronctl", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.draining = False
    metrics = Metrics(engine.stats)
    app.state.metrics = metrics
    created = int(time.time())
    card = ModelCard(id=served_model_name, created=created, max_model_len=max_model_len)

    def check_model(name: str) -> None:
        if name != served_model_name:
            raise ApiError(
                404,
                f"model {name!r} does not exist; this server serves {served_model_name!r}",
                "model",
                "model_not_found",
            )

    max_chars = limits.prompt_chars(engine.max_prompt)

    def check_chars(n: int, param: str) -> None:
        if n > max_chars:
            raise RequestError(
                f"the prompt has {n} characters; this server accepts at most {max_chars}",
                param=param,
                hint="start the server with a larger --max-prompt-chars",
            )

    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def list_models() -> Response:
        return typed(ModelList(data=[card]))

    @v1.get("/models/{name:path}")
    async def get_model(name: str) -> Response:
        check_model(name)
        return typed(card)

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        params = body.sampling(body.max_tokens)
        texts = body.prompts()
        check_chars(body.prompt_chars(), "prompt")
        prompts = [await _encode(model.encode, p) if isinstance(p, str) else p for p in texts]
        run = Run(engine, prompts, params, metrics)
        stream = CompletionStream(run, served_model_name, chat=False, body=body)
        if body.stream:
            return sse(stream.chunks())
        return typed(await stream.whole(request))

    @v1.post("/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        check_model(body.model)
        params = body.sampling(body.max_new_tokens())
        check_chars(body.prompt_chars(), "messages")
        messages = [m.as_template_message() for m in body.messages]
        prompt = await run_in_threadpool(model.encode_chat, messages)
        run = Run(engine, [prompt], params, metrics)
        stream = CompletionStream(run, served_model_name, chat=True, body=body)
        if body.stream:
            return sse(stream.chunks())
        return typed(await stream.whole(request))

    app.include_router(v1)

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.death is not None:  # vLLM: EngineDeadError -> 503
            return JSONResponse(
                {"status": "engine failed", "error": engine.death, **engine.stats()},
                status_code=503,
            )
        if app.state.draining:
            return JSONResponse({"status": "draining", **engine.stats()}, status_code=503)
        return JSONResponse({"status": "ok", **engine.stats()})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    install_error_handlers(app)
    app.add_middleware(
        Guard,  # type: ignore[arg-type]
        app_ref=app,
        metrics=metrics,
        api_key=api_key,
        max_body_bytes=limits.max_body_bytes,
    )
    return app


async def _encode(encode: Any, text: str) -> list[int]:
    """Tokenize in a worker thread: a long prompt never stalls the event loop."""
    ids: list[int] = await run_in_threadpool(encode, text)
    if not ids:
        raise RequestError("the prompt is empty", param="prompt")
    return ids


def typed(obj: Any) -> Response:
    return Response(obj.model_dump_json(), media_type="application/json")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestError)
    async def _bad(_: Request, exc: RequestError) -> JSONResponse:
        return error_response(400, str(exc), exc.param, exc.code)

    @app.exception_handler(UsageError)
    async def _usage(_: Request, exc: UsageError) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(QueueFullError)
    async def _full(_: Request, exc: QueueFullError) -> JSONResponse:
        return error_response(429, str(exc), code="queue_full")

    @app.exception_handler(EngineStoppedError)
    async def _stopped(_: Request, exc: EngineStoppedError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        where = ".".join(loc) or "body"
        return error_response(422, f"{where}: {err.get('msg')}", where, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))


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
    ) -> None:
        self.app, self.app_ref, self.metrics = app, app_ref, metrics
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.max_body = max_body_bytes
        app_ref.state.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "other"
        refusal = self._refusal(scope) if path.startswith("/v1") else None
        if refusal is not None:
            self.metrics.count_request(endpoint, refusal.status_code)
            await refusal(scope, receive, send)
            return
        status, started, too_large = 500, False, False

        async def send_and_note(message: Message) -> None:
            nonlocal status, started
            if too_large:  # the 413 went out already; the app's own answer goes nowhere
                return
            if message["type"] == "http.response.start":
                status, started = message["status"], True
            await send(message)

        seen = 0

        async def capped_receive() -> Message:
            nonlocal seen, too_large, status
            message = await receive()
            if message["type"] == "http.request" and not too_large:
                seen += len(message.get("body", b""))
                if seen > self.max_body:  # answer now; the app sees the client gone
                    too_large, status = True, 413
                    await self._too_large()(scope, receive, send)
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

    def _too_large(self) -> JSONResponse:
        return error_response(
            413,
            f"the request body is over this server's limit of {self.max_body} bytes",
            code="body_too_large",
        )


class Run:
    """One API request's engine requests (one per prompt); events arrive on the event loop."""

    def __init__(
        self,
        engine: Engine,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        metrics: Metrics,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self.metrics = metrics
        self.handles: list[RequestHandle] = []
        try:
            for i, prompt in enumerate(prompts):
                self.handles.append(engine.submit(prompt, params, sink=self._sink(i)))
        except Exception:
            self.cancel()
            raise

    def _sink(self, index: int) -> Any:
        return lambda event: self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))

    @property
    def prompt_tokens(self) -> int:
        return sum(h.prompt_tokens for h in self.handles)

    async def events(self) -> AsyncGenerator[tuple[int, Event], None]:
        remaining = len(self.handles)
        try:
            while remaining:
                index, event = await self.queue.get()
                if event.output is not None:
                    remaining -= 1
                    self.metrics.observe(event.output)
                yield index, event
        finally:
            if remaining:  # the client went away: free the slots
                self.cancel()

    def cancel(self) -> None:
        for handle in self.handles:
            handle.cancel()


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (the body was read already: the next message is the
    disconnect, or nothing until the response is sent)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class CompletionStream:
    """Shapes engine events as typed OpenAI completion or chat-completion objects."""

    def __init__(
        self, run: Run, model: str, chat: bool, body: CompletionRequest | ChatRequest
    ) -> None:
        self.run, self.model, self.chat = run, model, chat
        self.include_usage = body.include_usage
        self.token_ids = body.return_token_ids
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def usage(self, completion_tokens: int) -> Usage:
        prompt = self.run.prompt_tokens
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion_tokens,
            total_tokens=prompt + completion_tokens,
        )

    async def whole(self, request: Request) -> Completion | ChatCompletion:
        """Collect every output; a client that disconnects first cancels its requests."""
        collect = asyncio.ensure_future(self._collect())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():
                collect.cancel()  # closes the event stream, which cancels the engine work
        if collect.cancelled() or not collect.done():
            # cancel() only asks: wait for the task to end before reading it (reading a
            # task still pending raised InvalidStateError, an ASGI traceback and a 500).
            await asyncio.gather(collect, return_exceptions=True)
            raise ApiError(499, "the client closed the request")
        outputs = collect.result()
        failed = [o for o in outputs.values() if o.finish_reason == "error"]
        if failed:
            raise ApiError(500, f"generation failed: {failed[0].error}")
        completion = sum(len(o.token_ids) for o in outputs.values())
        usage = self.usage(completion)
        if self.chat:
            choices = [self._chat_choice(i, outputs[i]) for i in sorted(outputs)]
            return ChatCompletion(
                id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
            )
        texts = [self._text_choice(i, outputs[i]) for i in sorted(outputs)]
        return Completion(
            id=self.id, created=self.created, model=self.model, choices=texts, usage=usage
        )

    async def _collect(self) -> dict[int, RequestOutput]:
        outputs: dict[int, RequestOutput] = {}
        events = self.run.events()
        try:
            async for index, event in events:
                if event.output is not None:
                    outputs[index] = event.output
        finally:
            await events.aclose()
        return outputs

    def _ids(self, ids: list[int]) -> list[int] | None:
        return ids if self.token_ids else None

    def _text_choice(self, index: int, out: RequestOutput) -> CompletionChoice:
        return CompletionChoice(
            index=index, text=out.text, finish_reason=out.finish_reason,
            token_ids=self._ids(out.token_ids),
        )  # fmt: skip

    def _chat_choice(self, index: int, out: RequestOutput) -> ChatChoice:
        return ChatChoice(
            index=index, message=AssistantMessage(content=out.text),
            finish_reason=out.finish_reason, token_ids=self._ids(out.token_ids),
        )  # fmt: skip

    def _chunk(self, choices: list[Any], usage: Usage | None = None) -> Chunk:
        obj: Literal["chat.completion.chunk", "text_completion"] = (
            "chat.completion.chunk" if self.chat else "text_completion"
        )
        return Chunk(
            id=self.id, object=obj, created=self.created, model=self.model,
            choices=choices, usage=usage, with_usage=self.include_usage,
        )  # fmt: skip

    async def chunks(self) -> AsyncIterator[str]:
        if self.chat:
            for i in range(len(self.run.handles)):
                first = ChatChunkChoice(
                    index=i, delta=Delta(role="assistant", content=""), finish_reason=None
                )
                yield self._chunk([first]).model_dump_json()
        completion = 0
        async for index, event in self.run.events():
            if event.token_id is not None:
                completion += 1
            if event.finish_reason == "error":
                body = error_body(f"generation failed: {event.error}", "internal_error")
                yield json.dumps(body, separators=(",", ":"))
                return
            if event.text or event.finish_reason or self.token_ids:
                ids = None
                if self.token_ids:
                    ids = [] if event.token_id is None else [event.token_id]
                choice = self._delta(index, event.text, event.finish_reason, ids)
                yield self._chunk([choice]).model_dump_json()
        if self.include_usage:
            yield self._chunk([], self.usage(completion)).model_dump_json()

    def _delta(self, index: int, text: str, finish: Any, ids: list[int] | None) -> Any:
        if self.chat:
            delta = Delta(content=text or None)
            return ChatChunkChoice(index=index, delta=delta, finish_reason=finish, token_ids=ids)
        return CompletionChoice(index=index, text=text, finish_reason=finish, token_ids=ids)


def sse(chunks: AsyncIterator[str]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        async for chunk in chunks:
            yield f"data: {chunk}\n\n"
        yield "data: [DONE]\n\n"

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)
