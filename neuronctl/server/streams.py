"""Engine events as API responses: one Run per request (its engine requests, their events on
the event loop), shaped by CompletionStream into whole OpenAI completion or chat-completion
objects, or into the chunks of a server-sent event stream."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from functools import partial
from typing import Any, Literal, Protocol

from fastapi import Request
from fastapi.responses import StreamingResponse

from neuronctl.engine.engine import Engine, RequestHandle
from neuronctl.engine.request import Event, RequestOutput, Sink
from neuronctl.engine.sampling import SamplingParams, TokenLogprob
from neuronctl.server.errors import ApiError
from neuronctl.server.metrics import Metrics
from neuronctl.server.protocol import (
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
    TopLogprob,
    Usage,
    error_body,
)


class TokenStrings(Protocol):
    """What a stream needs from the model (routes.TextModel has it): one token's text."""

    def token_str(self, token_id: int) -> str: ...


class Run:
    """One API request's engine requests (one per choice); events arrive on the event loop.

    With `stream`, every event does; without, only each request's last (its output), since a
    whole answer needs nothing else. Each event handed over wakes the event loop from the
    engine thread, and the woken loop thread takes the GIL and a core from the engine's
    next step: per token, one request's wake-ups slowed every other request in the batch."""

    def __init__(
        self,
        engine: Engine,
        jobs: Sequence[tuple[Sequence[int], SamplingParams]],
        metrics: Metrics,
        prompts: Sequence[Sequence[int]],
        *,
        stream: bool,
        client: str | None = None,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self.metrics = metrics
        self.prompts = prompts
        self.stream = stream
        self.handles: list[RequestHandle] = []
        try:
            for i, (prompt, params) in enumerate(jobs):
                sink = self._sink(i)
                self.handles.append(engine.submit(prompt, params, sink, client, group=self))
        except Exception:
            self.cancel()
            raise

    def _sink(self, index: int) -> Sink:
        return partial(self._deliver if self.stream else self._deliver_last, index)

    def _deliver(self, index: int, event: Event) -> None:
        """Engine thread: queue the event on the loop (raises once the loop has closed)."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))

    def _deliver_last(self, index: int, event: Event) -> None:
        """Engine thread: deliver only the last event; before it, only check that the loop
        is open. The engine stops a request whose sink raises, as `_deliver` raises at every
        token once the loop has closed."""
        if event.output is not None:
            self._deliver(index, event)
        elif self.loop.is_closed():
            raise RuntimeError("the event loop is closed")

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
        model: TokenStrings,
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
            index=index, message=AssistantMessage(content=self._echoed(index) + out.text),
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
            if self.chat and self._echoed(i):  # chat echo: the last message, after the role
                opening = ChatChunkChoice(
                    index=i, delta=Delta(content=self._echoed(i)), finish_reason=None
                )
                yield self._chunk([opening]).model_dump_json()
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
        if self.chat or self.echo is None or not self.logprobs or index in self.offsets:
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
