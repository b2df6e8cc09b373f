"""A request's lifecycle: waiting -> running in a slot -> finished, and what it reports.

The engine thread owns every Request; consumers only see the immutable events it sends to the
request's sink (a thread-safe callable), so no state is shared across threads.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from neuronctl.engine.sampling import SamplingParams, TokenLogprob, make_generator
from neuronctl.engine.text import TextStream, TokenDecoder

# "stop": EOS or a stop string; "length": max_tokens or the end of the sequence;
# "abort": cancelled by the caller; "error": the runner failed.
FinishReason = Literal["stop", "length", "abort", "error"]

_ids = itertools.count()


@dataclass(frozen=True)
class Timings:
    arrival: float
    scheduled: float | None  # when it got a slot (prefill started)
    first_token: float | None
    finished: float | None

    def as_dict(self) -> dict[str, float | None]:
        def ms(end: float | None, start: float | None) -> float | None:
            return None if end is None or start is None else round((end - start) * 1000, 3)

        return {
            "queue_ms": ms(self.scheduled, self.arrival),
            "ttft_ms": ms(self.first_token, self.arrival),
            "e2e_ms": ms(self.finished, self.arrival),
        }


@dataclass(frozen=True)
class Event:
    """New output of one request: one token (or none, at an abort/error), and maybe the end."""

    request_id: str
    token_id: int | None
    text: str  # text that became final with this event
    time: float
    finish_reason: FinishReason | None = None
    output: RequestOutput | None = None  # set on the last event
    error: str | None = None
    logprob: TokenLogprob | None = None  # the token's, when the request asked for logprobs
    # On a request's first token event, when it asked for its prompt's logprobs (echo).
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    timings: Timings
    token_times: list[float]  # wall time at which each output token was produced
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per output token, when asked for
    # One per prompt token, when asked for (echo); the first has no context: None.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs or ())

    def as_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_tokens": len(self.prompt_token_ids),
            "completion_tokens": len(self.token_ids),
            "finish_reason": self.finish_reason,
            "timings": {**self.timings.as_dict(), "tpot_ms": self.tpot_ms()},
            **({"error": self.error} if self.error else {}),
        }

    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first."""
        if len(self.token_times) < 2:
            return None
        span = self.token_times[-1] - self.token_times[0]
        return round(span / (len(self.token_times) - 1) * 1000, 3)


Sink = Callable[[Event], None]


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams  # resolved
    max_tokens: int  # resolved against the sequence length
    sink: Sink
    decoder: TokenDecoder  # this request's own incremental detokenizer
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    arrival: float = field(default_factory=time.perf_counter)
    slot: int | None = None
    # Who asked: `client` (the peer's address) shares the waiting queue with its other
    # requests, `group` (one API request's sequences) shares the slots (scheduler.py).
    client: str | None = None
    group: object = None
    output_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    scheduled: float | None = None
    cancelled: bool = False
    ended: bool = False  # its last event (the one with a finish reason) was sent
    generator: torch.Generator = field(init=False)
    text: TextStream = field(init=False)
    fed: int = 0  # prompt tokens written to the KV cache so far
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert self.params.seed is not None, "params must be resolved"
        self.generator = make_generator(self.params.seed)
        self.text = TextStream(
            self.decoder, self.params.stop, keep_stop=self.params.include_stop_str_in_output
        )

    @property
    def next_position(self) -> int:
        """Where the last sampled token is written by the next decode step."""
        return len(self.prompt_ids) + len(self.output_ids) - 1

    # Prompt logprobs (echo) need the logits at every prompt position, and a context-encoding
    # graph returns only the last one's. So such a request context-encodes its first token
    # alone and feeds the rest through the batch's decode steps, one a step, each step's row
    # scoring the next prompt token: no other graph, on every backend, and its neighbours'
    # steps are shared, not added to.

    def prefill_ids(self) -> list[int]:
        """The tokens its context encoding writes (and counts them as fed)."""
        ids = self.prompt_ids[:1] if self.params.prompt_logprobs is not None else self.prompt_ids
        self.fed = len(ids)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        return ids

    def next_input(self) -> tuple[int, int]:
        """(token, position) the next decode step writes into this request's slot."""
        if self.fed < len(self.prompt_ids):
            self.fed += 1
            return self.prompt_ids[self.fed - 1], self.fed - 1
        return self.output_ids[-1], self.next_position

    @property
    def scoring_prompt(self) -> bool:
        """Whether the latest logits predict a prompt token (scored, not sampled)."""
        return self.fed < len(self.prompt_ids)

    def output(self, reason: FinishReason, error: str | None = None) -> RequestOutput:
        first = self.token_times[0] if self.token_times else None
        end = self.token_times[-1] if self.token_times else time.perf_counter()
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_ids),
            token_ids=list(self.output_ids),
            text=self.text.text,
            finish_reason=reason,
            timings=Timings(self.arrival, self.scheduled, first, end),
            token_times=list(self.token_times),
            error=error,
            logprobs=list(self.logprobs) if self.params.logprobs is not None else None,
            prompt_logprobs=(
                list(self.prompt_logprobs) if self.params.prompt_logprobs is not None else None
            ),
        )
