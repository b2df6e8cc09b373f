"""The OpenAI-compatible HTTP API, a thin layer over the engine: it parses, tokenizes, submits,
and turns engine events into JSON or server-sent events. It never touches tensors.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from neuronctl.engine.engine import Engine, RequestHandle
from neuronctl.engine.errors import EngineStoppedError, QueueFullError, RequestError
from neuronctl.engine.request import Event, RequestOutput
from neuronctl.engine.sampling import SamplingParams
from neuronctl.errors import UsageError
from neuronctl.server.metrics import Metrics
from neuronctl.server.protocol import ERROR_TYPES, ChatRequest, CompletionRequest, error_body

ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")


class TextModel(Protocol):
    """What the API needs from a loaded artifact (engine.loader.LoadedArtifact)."""

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]: ...


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
) -> FastAPI:
    app = FastAPI(title="neuronctl", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.draining = False
    metrics = Metrics(engine.stats)
    created = int(time.time())

    async def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'")

    def check_model(name: str) -> None:
        if name != served_model_name:
            raise ApiError(
                404,
                f"model {name!r} does not exist; this server serves {served_model_name!r}",
                "model",
                "model_not_found",
            )

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @v1.get("/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{name:path}")
    async def get_model(name: str) -> dict[str, Any]:
        check_model(name)
        return model_card()

    def model_card() -> dict[str, Any]:
        card = {"id": served_model_name, "object": "model", "created": created}
        return {**card, "owned_by": "neuronctl", "max_model_len": max_model_len}

    @v1.post("/completions")
    async def completions(body: CompletionRequest) -> Any:
        check_model(body.model)
        params = body.sampling(body.max_tokens)
        prompts = [model.encode(p) if isinstance(p, str) else p for p in body.prompts()]
        run = Run(engine, prompts, params, metrics)
        stream = CompletionStream(run, served_model_name, "text_completion", body)
        if body.stream:
            return sse(stream.chunks())
        return await stream.whole()

    @v1.post("/chat/completions")
    async def chat(body: ChatRequest) -> Any:
        check_model(body.model)
        params = body.sampling(body.max_new_tokens())
        prompt = model.encode_chat([m.as_template_message() for m in body.messages])
        run = Run(engine, [prompt], params, metrics)
        stream = CompletionStream(run, served_model_name, "chat.completion", body)
        if body.stream:
            return sse(stream.chunks())
        return await stream.whole()

    app.include_router(v1)

    @app.get("/health")
    async def health() -> JSONResponse:
        if app.state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok", **engine.stats()})

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    install_error_handlers(app)
    app.add_middleware(Gate, app_ref=app, metrics=metrics)  # type: ignore[arg-type]
    return app


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


class Gate:
    """ASGI middleware: count requests for /metrics, and refuse new work while draining."""

    def __init__(self, app: ASGIApp, app_ref: FastAPI, metrics: Metrics) -> None:
        self.app, self.app_ref, self.metrics = app, app_ref, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "other"
        if self.app_ref.state.draining and path.startswith("/v1"):
            self.metrics.count_request(endpoint, 503)
            await error_response(503, "the server is shutting down")(scope, receive, send)
            return
        status = 500

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.count_request(endpoint, status)


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

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
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


class CompletionStream:
    """Shapes engine events as OpenAI completion or chat-completion objects."""

    def __init__(self, run: Run, model: str, kind: str, body: CompletionRequest | ChatRequest):
        self.run, self.model, self.kind = run, model, kind
        self.include_usage = body.include_usage
        self.token_ids = body.return_token_ids
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"

    def usage(self, completion_tokens: int) -> dict[str, int]:
        prompt = self.run.prompt_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
        }

    async def whole(self) -> dict[str, Any]:
        outputs: dict[int, RequestOutput] = {}
        async for index, event in self.run.events():
            if event.output is not None:
                outputs[index] = event.output
        failed = [o for o in outputs.values() if o.finish_reason == "error"]
        if failed:
            raise ApiError(500, f"generation failed: {failed[0].error}")
        choices = [self._choice(i, outputs[i]) for i in sorted(outputs)]
        completion = sum(len(o.token_ids) for o in outputs.values())
        return {**self._head(self.kind), "choices": choices, "usage": self.usage(completion)}

    def _choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": out.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice["text"] = out.text
        if self.token_ids:
            choice["token_ids"] = out.token_ids
        return {**choice, "logprobs": None}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        extra = {"usage": None} if self.include_usage else {}
        if self.chat:
            for i in range(len(self.run.handles)):
                yield {**self._head(obj), "choices": [self._delta(i, "", None, True)], **extra}
        completion = 0
        async for index, event in self.run.events():
            if event.token_id is not None:
                completion += 1
            if event.finish_reason == "error":
                yield error_body(f"generation failed: {event.error}", "internal_error")
                return
            if event.text or event.finish_reason or self.token_ids:
                choice = self._delta(index, event.text, event.finish_reason, False)
                if self.token_ids:
                    choice["token_ids"] = [] if event.token_id is None else [event.token_id]
                yield {**self._head(obj), "choices": [choice], **extra}
        if self.include_usage:
            yield {**self._head(obj), "choices": [], "usage": self.usage(completion)}

    def _delta(self, index: int, text: str, finish: str | None, first: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": None}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text
        return choice


def sse(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
        yield "data: [DONE]\n\n"

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)
