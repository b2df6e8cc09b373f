"""The endpoints: OpenAI's /v1 (models, completions, chat completions), vLLM's /version,
/tokenize and /detokenize, and /health, /ping and /metrics. A route checks its request,
tokenizes in a worker thread and submits to the engine; streams.py shapes what comes back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, Protocol

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from neuronctl import __version__
from neuronctl.engine.engine import Engine
from neuronctl.engine.errors import RequestError
from neuronctl.engine.sampling import SamplingParams
from neuronctl.server.errors import ApiError
from neuronctl.server.guard import client_of
from neuronctl.server.metrics import CONTENT_TYPE, Metrics
from neuronctl.server.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    refuse_fields,
    template_chars,
)
from neuronctl.server.streams import CompletionStream, Run, sse


class TextModel(Protocol):
    """What the API needs from a loaded artifact (engine.loader.LoadedArtifact)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, Any]], **options: Any) -> list[int]: ...

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def token_str(self, token_id: int) -> str: ...


class ClientWork:
    """Tokenizing and chat templating, in a worker thread, one at a time per client.

    Both are Python holding the GIL (a 1,024-message template is tens of milliseconds): a
    client with many requests in flight ran as many at once, and took the GIL from the
    engine's step and every other client's parse. One at a time, a client costs at most one
    worker's share of the CPU, whatever it sends."""

    def __init__(self) -> None:
        self._locks: dict[str | None, asyncio.Lock] = {}
        self._users: dict[str | None, int] = {}

    async def run(self, client: str | None, fn: Callable[..., Any], *args: Any) -> Any:
        lock = self._locks.setdefault(client, asyncio.Lock())
        self._users[client] = self._users.get(client, 0) + 1
        try:
            async with lock:
                return await run_in_threadpool(fn, *args)
        finally:
            self._users[client] -= 1
            if not self._users[client]:  # nobody waits on it: forget the client
                del self._users[client], self._locks[client]


def add_routes(
    app: FastAPI,
    engine: Engine,
    model: TextModel,
    served_model_name: str,
    max_model_len: int | None,
    max_chars: int,
    metrics: Metrics,
) -> None:
    """Every endpoint; `max_chars` caps a prompt's characters before it is tokenized."""
    card = ModelCard(id=served_model_name, created=int(time.time()), max_model_len=max_model_len)
    work = ClientWork()

    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            raise ApiError(
                404,
                f"model {name!r} does not exist; this server serves {served_model_name!r}",
                "model",
                "model_not_found",
            )

    def check_chars(n: int, param: str) -> None:
        if n > max_chars:
            raise RequestError(
                f"the prompt has {n} characters; this server accepts at most {max_chars}",
                param=param,
                hint="start the server with a larger --max-prompt-chars",
            )

    def check_sequences(n: int) -> None:
        """A request never holds more than the waiting places one client may (plus the
        slots): more could never be queued whole."""
        share = engine.scheduler.client_share()
        most = None if share is None else share + engine.runner.batch_size
        if most is not None and n > most:
            raise RequestError(
                f"the request asks for {n} sequences (prompts x best_of); this server queues "
                f"at most {most} for one client",
                param="prompt",
                hint="send the prompts in several smaller requests",
            )

    def capacity() -> int | None:
        """How many sequences the engine holds at once: its slots and waiting places."""
        queue = engine.scheduler.max_queue
        return None if queue is None else engine.runner.batch_size + queue

    def longest() -> int:
        """The longest prompt truncate_prompt_tokens=-1 keeps: one position left to generate."""
        return min(engine.max_prompt, engine.runner.seq_len - 1)

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
        texts = body.prompts()
        per_prompt = body.sequences_within(len(texts), capacity())
        check_sequences(len(texts) * per_prompt)
        check_chars(body.prompt_chars(), "prompt")
        special = body.add_special_tokens is not False
        tokenize = partial(model.encode, add_special_tokens=special)
        encode = partial(work.run, client_of(request.scope), tokenize)
        prompts = [await _encode(encode, p) if isinstance(p, str) else p for p in texts]
        prompts = [body.truncate(p, longest()) for p in prompts]
        if per_prompt > body.choices_per_prompt and params.logprobs is None:
            params = replace(params, logprobs=0)  # best_of ranks by cumulative logprob
        run = Run(engine, jobs(prompts, params, per_prompt), metrics, prompts,
                  stream=body.streaming, client=client_of(request.scope))  # fmt: skip
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
        per_prompt = body.sequences_within(1, capacity())
        check_chars(body.prompt_chars(), "messages")
        messages = [m.as_template_message() for m in body.messages]
        options = body.template_options()
        template = partial(model.encode_chat, messages, **options)
        prompt = await work.run(client_of(request.scope), template)
        prompt = body.truncate(prompt, longest())
        run = Run(engine, jobs([prompt], params, per_prompt), metrics, [prompt],
                  stream=body.streaming, client=client_of(request.scope))  # fmt: skip
        stream = CompletionStream(run, served_model_name, body, model, chat_echo(body, messages))
        if body.streaming:
            return sse(stream.chunks())
        return typed(await stream.whole(request))

    app.include_router(v1)
    add_vllm_routes(
        app, model, check_model, check_chars, max_model_len or engine.runner.seq_len,
        engine.runner.vocab_size, work,
    )  # fmt: skip

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.watchdog() is not None:  # vLLM: EngineDeadError -> 503; a stuck step too
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


def add_vllm_routes(
    app: FastAPI,
    model: TextModel,
    check_model: Callable[[str | None], None],
    check_chars: Callable[[int, str], None],
    max_model_len: int,
    vocab_size: int,
    work: ClientWork,
) -> None:
    """vLLM's /version, /tokenize and /detokenize, with its request and response shapes."""

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> Response:
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("send either prompt or messages", param="prompt")
        refuse_fields(body)
        if body.messages is not None:
            messages = [m.as_template_message() for m in body.messages]
            check_chars(template_chars(messages), "messages")
            options = body.template_options()
            template = partial(model.encode_chat, messages, **options)
            ids = await work.run(client_of(request.scope), template)
        else:
            check_chars(len(body.prompt or ""), "prompt")
            special = body.add_special_tokens is not False
            client = client_of(request.scope)
            ids = await work.run(client, model.tokenize, body.prompt or "", special)
        strs = [model.token_str(t) for t in ids] if body.return_token_strs else None
        return typed(TokenizeResponse(
            count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs
        ))  # fmt: skip

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
        check_model(body.model)
        bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab_size), None)
        if bad is not None:  # the tokenizer's Rust side fails on them: a 500, not an answer
            raise RequestError(
                f"tokens[{bad}] = {body.tokens[bad]} is not a token id of this model "
                f"(0..{vocab_size - 1})",
                param="tokens",
            )
        text = await work.run(client_of(request.scope), model.decode, body.tokens)
        return typed(DetokenizeResponse(prompt=text))


def chat_echo(body: ChatRequest, messages: list[dict[str, Any]]) -> list[str] | None:
    """Chat echo: the last message's content opens each answer when that message is the
    answer's own role, assistant (vllm/entrypoints/openai/chat_completion/serving.py: "echo
    the input portion of the last message"); else nothing is echoed."""
    if not body.echo:
        return None
    last = messages[-1]
    return [last["content"] if last["role"] == "assistant" else ""]


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
    ids: list[int] = await encode(text)
    if not ids:
        raise RequestError("the prompt is empty", param="prompt")
    return ids


def typed(obj: Any) -> Response:
    return Response(obj.model_dump_json(), media_type="application/json")
