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
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from neuronctl import __version__
from neuronctl.engine.engine import Engine, RequestHandle
from neuronctl.engine.errors import EngineStoppedError, QueueFullError, RequestError
from neuronctl.engine.request import Event, RequestOutput
from neuronctl.engine.sampling import SamplingParams, TokenLogprob
from neuronctl.errors import UsageError
from neuronctl.server.metrics import CONTENT_TYPE, Metrics
from neuronctl.server.protocol import (
    ERROR_TYPES,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatLogprobs,
    ChatRequest,
    ChatTokenLogprob,
    Chunk,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    Delta,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    Usage,
    error_body,
)

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
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# Without a limit given: this many characters per prompt token the artifact accepts (a longer
# text cannot fit, and tokenizing it would only cost time), and never fewer than the floor.
CHARS_PER_TOKEN, MIN_PROMPT_CHARS = 32, 65536


class TextModel(Protocol):
    """What the API needs from a loaded artifact (engine.loader.LoadedArtifact)."""

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]: ...

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def token_str(self, token_id: int) -> str: ...


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
    app = FastAPI(title="neuronctl", version=__version__, redoc_url=None)  # /docs, /openapi.json
    app.state.draining = False
    metrics = Metrics(engine.stats, served_model_name, max_model_len or engine.runner.seq_len)
    app.state.metrics = metrics
    created = int(time.time())
    card = ModelCard(id=served_model_name, created=created, max_model_len=max_model_len)

    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
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
        params = body.sampling(body.max_new_tokens)
        per_prompt = body.sequences_within(engine.runner.batch_size)
        texts = body.prompts()
        check_chars(body.prompt_chars(), "prompt")
        prompts = [await _encode(model.encode, p) if isinstance(p, str) else p for p in texts]
        if per_prompt > body.choices_per_prompt and params.logprobs is None:
            params = replace(params, logprobs=0)  # best_of ranks by cumulative logprob
        run = Run(engine, jobs(prompts, params, per_prompt), metrics, prompts)
        echo = [p if isinstance(p, str) else model.decode(p) for p in texts] if body.echo else None
        stream = CompletionStream(run, served_model_name, body, model, echo)
        if body.streaming:
            return sse(stream.chunks())
        return typed(await stream.whole(request))

    @v1.post("/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        check_model(body.model)
        body.check_messages()
        params = body.sampling(body.max_new_tokens())
        per_prompt = body.sequences_within(engine.runner.batch_size)
        check_chars(body.prompt_chars(), "messages")
        messages = [m.as_template_message() for m in body.messages]
        prompt = await run_in_threadpool(model.encode_chat, messages)
        run = Run(engine, jobs([prompt], params, per_prompt), metrics, [prompt])
        stream = CompletionStream(run, served_model_name, body, model)
        if body.streaming:
            return sse(stream.chunks())
        return typed(await stream.whole(request))

    app.include_router(v1)
    add_vllm_routes(app, model, check_model, check_chars, max_model_len or engine.runner.seq_len)

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

    app.add_api_route("/ping", health, methods=["GET", "POST"])  # vLLM's liveness probe

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


def add_vllm_routes(
    app: FastAPI,
    model: TextModel,
    check_model: Callable[[str | None], None],
    check_chars: Callable[[int, str], None],
    max_model_len: int,
) -> None:
    """vLLM's /version, /tokenize and /detokenize, with its request and response shapes."""

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("send either prompt or messages", param="prompt")
        if body.messages is not None:
            messages = [m.as_template_message() for m in body.messages]
            check_chars(sum(len(m["content"]) for m in messages), "messages")
            ids = await run_in_threadpool(model.encode_chat, messages)
        else:
            check_chars(len(body.prompt or ""), "prompt")
            special = body.add_special_tokens is not False
            ids = await run_in_threadpool(model.tokenize, body.prompt or "", special)
        strs = [model.token_str(t) for t in ids] if body.return_token_strs else None
        return typed(TokenizeResponse(
            count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs
        ))  # fmt: skip

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        check_model(body.model)
        return typed(DetokenizeResponse(prompt=await run_in_threadpool(model.decode, body.tokens)))


def jobs(
    prompts: Sequence[Sequence[int]], params: SamplingParams, per_prompt: int
) -> list[tuple[Sequence[int], SamplingParams]]:
    """One engine request per choice: `per_prompt` for each prompt, in choice order. The
    sequences of one prompt differ by seed (seed + j, as vLLM seeds parallel samples)."""
    out = []
    for prompt in prompts:
        for j in range(per_prompt):
            seed = None if params.seed is None else params.seed + j
            out.append((prompt, replace(params, seed=seed) if j else params))
    return out


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
        param = ".".join(loc[:1] if loc[:1] != ["messages"] else loc[:3]) or None
        return error_response(400, f"{where}: {err.get('msg')}", param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))


def guarded(path: str) -> bool:
    """The paths that run the model or its tokenizer: the API key and size limits apply
    (vLLM leaves /tokenize open; here it costs tokenizer time, so it takes the key too)."""
    return path.startswith("/v1") or path in ("/tokenize", "/detokenize")


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
        refusal = self._refusal(scope) if guarded(path) else None
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
    """One API request's engine requests (one per choice); events arrive on the event loop."""

    def __init__(
        self,
        engine: Engine,
        jobs: Sequence[tuple[Sequence[int], SamplingParams]],
        metrics: Metrics,
        prompts: Sequence[Sequence[int]],
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self.metrics = metrics
        self.prompts = prompts
        self.handles: list[RequestHandle] = []
        try:
            for i, (prompt, params) in enumerate(jobs):
                self.handles.append(engine.submit(prompt, params, sink=self._sink(i)))
        except Exception:
            self.cancel()
            raise

    def _sink(self, index: int) -> Any:
        return lambda event: self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))

    @property
    def prompt_tokens(self) -> int:
        """Each prompt counts once, however many choices it has (as vLLM counts)."""
        return sum(len(p) for p in self.prompts)

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
    """Shapes engine events as typed OpenAI completion or chat-completion objects.

    Engine request k is choice k, except with best_of > n (completions, never streamed): then
    each prompt's n sequences of highest cumulative logprob are its choices."""

    def __init__(
        self,
        run: Run,
        model_name: str,
        body: CompletionRequest | ChatRequest,
        model: TextModel,
        echo: list[str] | None = None,
    ) -> None:
        self.run, self.model_name, self.model = run, model_name, model
        self.chat = isinstance(body, ChatRequest)
        self.include_usage = body.include_usage
        self.token_ids = body.return_ids
        self.logprobs = body.logprobs_k() is not None  # reported (best_of may compute them)
        self.n = body.choices_per_prompt
        self.per_prompt = len(run.handles) // max(len(run.prompts), 1)
        self.echo = echo
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.offsets: dict[int, int] = {}  # a streamed choice's text_offset so far

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
        chosen = self._best(outputs)
        if self.chat:
            choices = [self._chat_choice(i, out) for i, out in enumerate(chosen)]
            return ChatCompletion(
                id=self.id, created=self.created, model=self.model_name, choices=choices,
                usage=usage,
            )  # fmt: skip
        texts = [self._text_choice(i, out) for i, out in enumerate(chosen)]
        return Completion(
            id=self.id, created=self.created, model=self.model_name, choices=texts, usage=usage
        )

    def _best(self, outputs: dict[int, RequestOutput]) -> list[RequestOutput]:
        """The choices in order: per prompt, its n sequences (best_of: highest cumulative
        logprob first)."""
        if self.per_prompt == self.n:
            return [outputs[k] for k in sorted(outputs)]
        chosen = []
        for start in range(0, len(outputs), self.per_prompt):
            group = [outputs[k] for k in range(start, start + self.per_prompt)]
            group.sort(key=lambda o: o.cumulative_logprob, reverse=True)
            chosen += group[: self.n]
        return chosen

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

    def _echoed(self, index: int) -> str:
        return self.echo[index // self.per_prompt] if self.echo is not None else ""

    def _text_choice(self, index: int, out: RequestOutput) -> CompletionChoice:
        return CompletionChoice(
            index=index, text=self._echoed(index) + out.text, finish_reason=out.finish_reason,
            token_ids=self._ids(out.token_ids), logprobs=self._completion_logprobs(out),
        )  # fmt: skip

    def _chat_choice(self, index: int, out: RequestOutput) -> ChatChoice:
        logprobs = ChatLogprobs(content=self._chat_entries(out.logprobs or [])) if (
            self.logprobs) else None  # fmt: skip
        return ChatChoice(
            index=index, message=AssistantMessage(content=out.text),
            finish_reason=out.finish_reason, token_ids=self._ids(out.token_ids),
            logprobs=logprobs,
        )  # fmt: skip

    # -- logprobs, in the two OpenAI shapes ------------------------------------------------

    def _completion_logprobs(
        self, out: RequestOutput, offset: int = 0
    ) -> CompletionLogprobs | None:
        if not self.logprobs:
            return None
        entries: list[tuple[int, TokenLogprob | None]] = []
        if self.echo is not None and out.prompt_logprobs is not None:
            entries += zip(out.prompt_token_ids, out.prompt_logprobs, strict=True)
        entries += [(lp.token_id, lp) for lp in out.logprobs or []]
        return self._legacy(entries, offset)

    def _legacy(
        self, entries: Sequence[tuple[int, TokenLogprob | None]], offset: int
    ) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for token_id, lp in entries:
            text = self.model.token_str(token_id)
            result.tokens.append(text)
            result.text_offset.append(offset)
            offset += len(text)
            if lp is None:  # an echoed prompt's first token: nothing precedes it
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(lp.logprob)
            # The chosen token is always listed, as in vLLM. Tokens that read the same (bytes
            # that are no character alone) share a key: it keeps the most likely's value.
            top: dict[str, float] = {}
            for t, v in (*lp.top, (token_id, lp.logprob)):
                top.setdefault(self.model.token_str(t), v)
            result.top_logprobs.append(top)
        return result

    def _chat_entries(self, logprobs: Sequence[TokenLogprob]) -> list[ChatTokenLogprob]:
        def entry(token_id: int, value: float) -> TopLogprob:
            text = self.model.token_str(token_id)
            return TopLogprob(token=text, logprob=value, bytes=list(text.encode()))

        out = []
        for lp in logprobs:
            head = entry(lp.token_id, lp.logprob)
            top = [entry(t, v) for t, v in lp.top]
            out.append(ChatTokenLogprob(**head.model_dump(), top_logprobs=top))
        return out

    # -- streaming -------------------------------------------------------------------------

    def _chunk(self, choices: list[Any], usage: Usage | None = None) -> Chunk:
        obj: Literal["chat.completion.chunk", "text_completion"] = (
            "chat.completion.chunk" if self.chat else "text_completion"
        )
        return Chunk(
            id=self.id, object=obj, created=self.created, model=self.model_name,
            choices=choices, usage=usage, with_usage=self.include_usage,
        )  # fmt: skip

    async def chunks(self) -> AsyncIterator[str]:
        for i in range(len(self.run.handles)):
            first = self._first(i)
            if first is not None:
                yield self._chunk([first]).model_dump_json()
        completion = 0
        async for index, event in self.run.events():
            echoed = self._echo_with_logprobs(index, event)
            if echoed is not None:
                yield self._chunk([echoed]).model_dump_json()
            if event.token_id is not None:
                completion += 1
            if event.finish_reason == "error":
                body = error_body(f"generation failed: {event.error}", "internal_error")
                yield json.dumps(body, separators=(",", ":"))
                return
            if event.text or event.finish_reason or self.token_ids or self.logprobs:
                yield self._chunk([self._delta(index, event)]).model_dump_json()
        if self.include_usage:
            yield self._chunk([], self.usage(completion)).model_dump_json()

    def _first(self, index: int) -> Any:
        """Chat streams open with the assistant role; an echo opens with the prompt."""
        if self.chat:
            delta = Delta(role="assistant", content="")
            return ChatChunkChoice(index=index, delta=delta, finish_reason=None)
        if self.echo is not None and not self.logprobs:
            return CompletionChoice(index=index, text=self._echoed(index), finish_reason=None)
        return None

    def _echo_with_logprobs(self, index: int, event: Event) -> CompletionChoice | None:
        """An echo with logprobs opens with the prompt once its logprobs are known: on the
        choice's first event (its first token, or its end with max_tokens 0)."""
        if self.echo is None or not self.logprobs or index in self.offsets:
            return None
        scored = event.prompt_logprobs
        if scored is None and event.output is not None:
            scored = event.output.prompt_logprobs
        ids = self.run.prompts[index // self.per_prompt]
        legacy = self._legacy(list(zip(ids, scored or [None] * len(ids), strict=True)), 0)
        self.offsets[index] = sum(len(t) for t in legacy.tokens)
        return CompletionChoice(
            index=index, text=self._echoed(index), finish_reason=None, logprobs=legacy
        )

    def _delta(self, index: int, event: Event) -> Any:
        ids = None
        if self.token_ids:
            ids = [] if event.token_id is None else [event.token_id]
        logprobs = [event.logprob] if event.logprob is not None and self.logprobs else []
        if self.chat:
            delta = Delta(content=event.text or None)
            chat_lp = ChatLogprobs(content=self._chat_entries(logprobs)) if logprobs else None
            return ChatChunkChoice(index=index, delta=delta, finish_reason=event.finish_reason,
                                   token_ids=ids, logprobs=chat_lp)  # fmt: skip
        legacy = None
        if logprobs:
            offset = self.offsets.get(index, 0)
            legacy = self._legacy([(lp.token_id, lp) for lp in logprobs], offset)
            self.offsets[index] = offset + len(legacy.tokens[0])
        return CompletionChoice(index=index, text=event.text, finish_reason=event.finish_reason,
                                token_ids=ids, logprobs=legacy)  # fmt: skip


def sse(chunks: AsyncIterator[str]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        async for chunk in chunks:
            yield f"data: {chunk}\n\n"
        yield "data: [DONE]\n\n"

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)
