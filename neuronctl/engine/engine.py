"""The continuous-batching engine: one thread drives a Runner, many threads submit.

Each step the scheduler says what to run (`SchedulerOutput`: which requests context-encode,
which decode, which were cancelled) and the engine applies it:
  1. context-encode the newly admitted prompts, in one `prefill_batch` call when the runner
     has one, and sample each first token (the TTFT);
  2. decode every request that already held a slot, one token each, in one runner call;
  3. finish a sequence at EOS, a stop string or max_tokens, freeing its slot for the next step.
Each request has its own seeded generator, so sampling never depends on what shares the batch,
and its own incremental detokenizer, so text costs O(1) per token.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Any

import torch

from neuronctl import process
from neuronctl.backends.base import Runner
from neuronctl.engine.errors import EngineDeadError, EngineStoppedError, RequestError
from neuronctl.engine.request import Event, FinishReason, Request, RequestOutput, Sink
from neuronctl.engine.sampling import (
    Pick,
    SamplingParams,
    resolve_params,
    sample_step,
    token_logprobs,
)
from neuronctl.engine.scheduler import Scheduler, SchedulerOutput
from neuronctl.engine.text import NewDecoder
from neuronctl.spec import DEFAULT_GLOBAL_TOPK

logger = logging.getLogger(__name__)


def same_intra_op_threads(count: int) -> None:
    """Give this (new) thread the intra-op thread count its starter had.

    OpenMP keeps the count per thread: a new thread starts with the process default
    (OMP_NUM_THREADS, else every core), not what `torch.set_num_threads` set elsewhere, until
    torch's first parallel op on it copies torch's count over. The backend's own OpenMP
    kernels (backends/torch/gemv.cpp, attention.cpp) read the thread's count directly, so the
    engine thread's first steps could run them with a team of another size than the Runner
    measured alone. Setting it first makes every step run with the caller's count."""
    if count > 0:
        process.set_torch_threads(count)


class EventQueue:
    """A request's events (the sink `submit` gives a request without one of its own), and
    whether its last one has come.

    `RequestHandle.result` waits for the last event only. Waiting on the queue instead woke
    the caller's thread at every token, and that thread took the GIL and a core from the
    engine's step: on the 2-core AMD EPYC host under load, waking it cost the engine thread
    2.4 ms a step (cProfile of bf16 batch-8 `Engine.generate`)."""

    def __init__(self) -> None:
        self.events: queue.Queue[Event] = queue.Queue()
        self.ended = threading.Event()

    def __call__(self, event: Event) -> None:
        self.events.put(event)
        if event.finish_reason is not None:
            self.ended.set()


class RequestHandle:
    """What `submit` returns: the request id, cancel, and (without a custom sink) its events."""

    def __init__(self, engine: Engine, request: Request, events: EventQueue | None):
        self._engine = engine
        self._request = request
        self._events = events
        self.request_id = request.request_id
        self.prompt_tokens = len(request.prompt_ids)

    def cancel(self) -> None:
        self._engine.cancel(self._request)

    def __iter__(self) -> Iterator[Event]:
        events = self._queue().events
        while True:
            event = events.get()
            yield event
            if event.finish_reason is not None:
                return

    def result(self) -> RequestOutput:
        """The request's output: sleeps until its last event, not woken at each token."""
        self._queue().ended.wait()
        for event in self:  # every event is queued by now: this never blocks
            if event.output is not None:
                return event.output
        raise AssertionError("a request always ends with an output")

    def follow(self, on_event: Callable[[Event], None]) -> RequestOutput:
        """The request's output, after `on_event` has seen each of its events as it came."""
        output = None
        for event in self:
            on_event(event)
            output = event.output or output
        if output is None:
            raise AssertionError("a request always ends with an output")
        return output

    def _queue(self) -> EventQueue:
        if self._events is None:
            raise TypeError("this request was submitted with its own sink")
        return self._events


# A step running longer than this counts as stuck: /health answers 503 and new requests are
# refused (a step is a few graph calls; a first-use graph load takes seconds, not minutes).
STALL_SECONDS = 120.0
# How long exit waits for a stopped engine's thread: a step stuck in a system call never
# returns, and the process must end anyway.
EXIT_JOIN_SECONDS = 10.0

# The engines whose thread has started, for `stop_started` at exit; weak, so an engine that
# was stopped and dropped goes as before (a running thread holds its engine itself).
_started: weakref.WeakSet[Engine] = weakref.WeakSet()


def stop_started() -> None:
    """Stop every started engine and wait for its thread: the interpreter's exit must not
    find one running.

    The engine thread is a daemon, so a process whose main thread ends without `stop` (a
    library user, a test, an exception escaping between start and stop) does not wait for
    it, and Python finalizes while the thread is inside a torch op with the GIL released.
    When the op returns and asks for the GIL back, CPython ends the thread with pthread_exit
    (take_gil in Python/ceval_gil.h, on `_PyThreadState_MustExit`), and the forced unwind
    that does it stops at the torch binding that asked (`THPVariable_matmul`,
    `THPVariable_clear` in the core dumps of such exits): std::terminate, "terminate called
    without an active exception", SIGABRT, exit code 134. Only a thread that takes the GIL
    back does this: torch's OpenMP workers never hold it, and an idle engine thread sleeps
    in its wait until the process is gone. One that ran on into exit also found the
    operators torch.library defined already dropped ("Could not find schema for
    neuronctl::linear_blocked" loading a graph): weakref.finalize drops them at exit.

    atexit runs this after Python has joined the non-daemon threads (which may still use an
    engine) and before it finalizes, while the engine thread can still take the GIL and end
    cleanly. What is in flight is aborted, not finished: the process is ending. The wait is
    for the step in progress, at most EXIT_JOIN_SECONDS: a step stuck for good (a read that
    never returns) must not keep the process alive after SIGTERM."""
    for engine in list(_started):
        engine.stop(drain=False, timeout=EXIT_JOIN_SECONDS)
        if engine.running_thread():
            logger.warning("the engine thread is stuck in a step; exiting without it")


# What `Engine.generate` calls for each request in prompt order: its index and handle in, its
# output out.
Consume = Callable[[int, RequestHandle], RequestOutput]


class Engine:
    def __init__(
        self,
        runner: Runner,
        new_decoder: NewDecoder,
        eos_ids: Iterable[int] = (),
        global_topk: int = DEFAULT_GLOBAL_TOPK,
        max_queue: int | None = None,
        scheduler: Scheduler | None = None,
        stall_seconds: float = STALL_SECONDS,
    ) -> None:
        self.runner = runner
        self.new_decoder = new_decoder
        # Optional on a Runner (backends/base.py): several prompts in one graph call.
        self._prefill_batch = getattr(runner, "prefill_batch", None)
        self.eos_ids = frozenset(eos_ids)
        self.global_topk = global_topk
        # Another policy (preemption, prefill limits, ...) is another Scheduler.schedule().
        self.scheduler = scheduler or Scheduler(runner.batch_size, max_queue)
        self.max_prompt = min(runner.max_context_length, max(runner.context_buckets))
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._drain = True
        self.death: str | None = None  # why the engine thread failed; None while it is alive
        self._step: SchedulerOutput | None = None  # the step being applied
        self._step_started: float | None = None  # monotonic time the step began; None: idle
        self.stall_seconds = stall_seconds
        self.steps = 0  # decode steps run, for tests and metrics
        self._threads = 0  # the starting thread's intra-op thread count (start())

    # -- public API, any thread ---------------------------------------------------------------

    def start(self) -> Engine:
        if self._thread is None:
            self._threads = torch.get_num_threads()
            self._thread = threading.Thread(target=self._loop, name="neuronctl-engine", daemon=True)
            self._thread.start()
            _started.add(self)
            # Before every exit handler registered until now, weakref.finalize's among them,
            # which drops torch.library's operators (the graphs call them until it stops).
            process.first_at_exit(stop_started)
        return self

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting; with drain, finish what was submitted first, else abort it."""
        with self._cond:
            self._stopping = True
            self._drain = drain
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        sink: Sink | None = None,
        client: str | None = None,
        group: object = None,
    ) -> RequestHandle:
        """Queue a request; raise RequestError, QueueFullError or EngineStoppedError.
        `client` and `group` are whose it is, for the scheduler's fair shares."""
        resolved = resolve_params(params, self.global_topk)
        max_tokens = self._check_lengths(prompt_ids, resolved)
        events: EventQueue | None = None
        if sink is None:
            sink = events = EventQueue()
        request = Request(list(prompt_ids), resolved, max_tokens, sink, self.new_decoder(),
                          client=client, group=group)  # fmt: skip
        self.watchdog()
        with self._cond:
            self.check_health()
            if self._stopping:
                raise EngineStoppedError("the engine is shutting down")
            self.scheduler.add(request)
            self._cond.notify_all()
        return RequestHandle(self, request, events)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        consume: Consume | None = None,
    ) -> list[RequestOutput]:
        """Run prompts through the batch together; outputs in prompt order. `consume(index,
        handle)` takes each request's output in turn (default: `handle.result()`) while the
        later ones keep generating: `generate` prints them as they come."""
        per = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        handles = [self.submit(p, sp) for p, sp in zip(prompts, per, strict=True)]
        take = consume or (lambda _, handle: handle.result())
        return [take(index, handle) for index, handle in enumerate(handles)]

    def cancel(self, request: Request) -> None:
        with self._cond:
            request.cancelled = True
            self._cond.notify_all()

    def check_health(self) -> None:
        """Raise EngineDeadError once the engine thread has failed or is stuck in a step."""
        if self.death is not None:
            raise EngineDeadError(
                f"the engine failed and serves nothing more ({self.death})",
                "restart the server; the log has the failure's traceback",
            )

    def watchdog(self) -> str | None:
        """Why the engine is dead, after declaring it so if its step has run past
        stall_seconds: what it held is failed (their clients get an answer, a drain can end)
        and nothing new is taken. /health, each submit and the drain call this."""
        started = self._step_started
        if self.death is None and started is not None:
            seconds = time.monotonic() - started
            if seconds > self.stall_seconds:
                logger.error("the engine thread is stuck in a step for %.0f s", seconds)
                self._die(f"one step ran for over {self.stall_seconds:.0f} s without finishing")
        return self.death

    def running_thread(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {
                "waiting": len(self.scheduler.waiting),
                "running": len(self.scheduler.running()),
                "batch_size": self.scheduler.batch_size,
            }

    def limits(self) -> dict[str, int]:
        return {"max_prompt_tokens": self.max_prompt, "seq_len": self.runner.seq_len}

    def _check_lengths(self, prompt_ids: Sequence[int], params: SamplingParams) -> int:
        n, seq_len = len(prompt_ids), self.runner.seq_len
        if n == 0:
            raise RequestError("the prompt is empty", param="prompt")
        if n > self.max_prompt:
            raise RequestError(
                f"the prompt has {n} tokens; this artifact accepts at most {self.max_prompt} "
                f"(its largest context bucket)",
                param="prompt",
                code="context_length_exceeded",
            )
        bad = [t for t in prompt_ids if not 0 <= t < self.runner.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary", param="prompt")
        self._check_bias(params)
        max_tokens = params.max_tokens if params.max_tokens is not None else seq_len - n
        if n + max_tokens > seq_len:
            raise RequestError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} is over "
                f"this artifact's sequence length {seq_len}",
                param="max_tokens",
                hint=f"use max_tokens <= {seq_len - n}",
                code="context_length_exceeded",
            )
        if max_tokens < 1 and params.max_tokens != 0:  # 0 only as asked (prompt logprobs)
            raise RequestError(
                f"the prompt ({n} tokens) leaves no room to generate in sequence length {seq_len}",
                param="prompt",
                code="context_length_exceeded",
            )
        return max_tokens

    def _check_bias(self, params: SamplingParams) -> None:
        named = {
            "logit_bias": [t for t, _ in params.logit_bias],
            "allowed_token_ids": list(params.allowed_token_ids or ()),
            "stop_token_ids": list(params.stop_token_ids),
        }
        for name, ids in named.items():
            bad = [t for t in ids if not 0 <= t < self.runner.vocab_size]
            if bad:
                raise RequestError(
                    f"{name} names token id {bad[0]}, outside the vocabulary "
                    f"(0..{self.runner.vocab_size - 1})",
                    param=name,
                )

    # -- the engine thread --------------------------------------------------------------------

    def _loop(self) -> None:
        """Run steps until stopped; an exception that escapes a step kills the engine, and
        everything it held is failed, so no request waits forever for a thread that is gone."""
        try:
            same_intra_op_threads(self._threads)
            self._steps()
        except BaseException as exc:
            logger.exception("the engine thread failed; failing every request it held")
            self._die(f"{type(exc).__name__}: {exc}")
            return
        self._abort_all()

    def _steps(self) -> None:
        while True:
            with self._cond:
                while not self.scheduler.has_work() and not self._stopping:
                    self._cond.wait()
                if self._stopping and not (self._drain and self.scheduler.has_work()):
                    break
                step = self.scheduler.schedule()
            self._step = step  # its aborted requests have left the scheduler already
            self._step_started = time.monotonic()
            self.apply(step)
            self._step_started = None

    def apply(self, step: SchedulerOutput) -> None:
        """Run one scheduled step on the runner and hand each request its new token."""
        for request in step.aborted:
            self._emit_end(request, "abort")
        if step.prefill:
            self._prefill(step.prefill)
        if step.decode:
            self._decode(step.decode)

    def _prefill(self, requests: list[Request]) -> None:
        now = time.perf_counter()
        for r in requests:
            r.scheduled = now
        if self._prefill_batch is not None and len(requests) > 1:
            slots = [r.slot for r in requests]
            try:
                logits = self._prefill_batch(slots, [r.prefill_ids() for r in requests])
            except Exception:  # one bad prompt must not fail its neighbours: one at a time
                logger.warning(
                    "batched prefill of %d prompts failed; encoding them one at a time",
                    len(requests),
                    exc_info=True,
                )
            else:
                self._run(requests, lambda: logits, rows=list(range(len(requests))))
                return
        for r in requests:
            self._run([r], partial(self._prefill_one, r), [0])

    def _prefill_one(self, request: Request) -> Any:
        assert request.slot is not None
        return self.runner.prefill(request.slot, request.prefill_ids()).unsqueeze(0)

    def _decode(self, running: list[Request]) -> None:
        batch = self.scheduler.batch_size
        tokens, positions = [0] * batch, [-1] * batch
        rows = []
        for r in running:
            slot = r.slot
            assert slot is not None
            tokens[slot], positions[slot] = r.next_input()
            rows.append(slot)
        self._run(running, lambda: self.runner.decode(tokens, positions), rows)
        self.steps += 1

    def _run(self, requests: list[Request], call: Any, rows: list[int]) -> None:
        """Call the runner, sample row `rows[i]` for `requests[i]`; a failure ends only the
        requests it touched (a runner error: all of them; a sampling error: its row)."""
        try:
            logits = call()
        except Exception as exc:  # the runner failed: end these requests, keep serving
            for r in requests:
                self._finish(r, "error", f"{type(exc).__name__}: {exc}")
            return
        requests, rows = self._score_prompts(logits, requests, rows)
        picked = sample_step(logits, rows, requests, self.eos_ids)
        for r, pick in zip(requests, picked, strict=True):
            if isinstance(pick, Exception):
                self._finish(r, "error", f"sampling failed: {type(pick).__name__}: {pick}")
            else:
                self._append(r, pick)

    def _score_prompts(
        self, logits: Any, requests: list[Request], rows: list[int]
    ) -> tuple[list[Request], list[int]]:
        """Record the prompt logprobs of the rows that predict a prompt token (one batched
        log_softmax); finish those whose prompt was all they asked for (max_tokens 0).
        Returns the requests and rows left to sample."""
        scoring = [i for i, r in enumerate(requests) if r.scoring_prompt]
        if scoring:
            found = token_logprobs(
                logits[[rows[i] for i in scoring]],
                [requests[i].prompt_ids[requests[i].fed] for i in scoring],
                [requests[i].params.prompt_logprobs or 0 for i in scoring],
            )
            for i, logprob in zip(scoring, found, strict=True):
                requests[i].prompt_logprobs.append(logprob)
        keep = [i for i, r in enumerate(requests) if not r.scoring_prompt]
        done = [i for i in keep if requests[i].max_tokens == 0]
        for i in done:
            self._finish(requests[i], "length")
        keep = [i for i in keep if requests[i].max_tokens > 0]
        return [requests[i] for i in keep], [rows[i] for i in keep]

    def _append(self, request: Request, pick: Pick) -> None:
        token = pick.token_id
        if pick.logprob is not None:
            request.logprobs.append(pick.logprob)
        request.output_ids.append(token)
        now = time.perf_counter()
        request.token_times.append(now)
        params = request.params
        stop_token = token in params.stop_token_ids or (
            token in self.eos_ids and not params.ignore_eos
        )
        # vLLM looks for stop strings only past min_tokens (its detokenizer's check), and
        # leaves a stop token's text out unless include_stop_str_in_output (vllm/v1/engine/
        # detokenizer.py, BaseIncrementalDetokenizer.update: skipped_stop_token_id).
        past_min = len(request.output_ids) > params.min_tokens
        delta, hit_stop = "", False
        if not stop_token or params.include_stop_str_in_output:
            delta, hit_stop = request.text.update(token, check_stop=past_min)
        reason: FinishReason | None = None
        if hit_stop or stop_token:
            reason = "stop"
        elif len(request.output_ids) >= request.max_tokens:
            reason = "length"
        if reason is None:
            event = Event(request.request_id, token, delta, now, logprob=pick.logprob,
                          prompt_logprobs=self._scored_prompt(request))  # fmt: skip
            self._send(request, event)
            return
        with self._cond:
            self.scheduler.release(request)
        delta += request.text.flush()
        output = request.output(reason)
        event = Event(request.request_id, token, delta, now, reason, output, logprob=pick.logprob,
                      prompt_logprobs=self._scored_prompt(request))  # fmt: skip
        self._send(request, event)

    def _scored_prompt(self, request: Request) -> list[Any] | None:
        """The prompt's logprobs, on the first token's event (a stream sends them first)."""
        if request.params.prompt_logprobs is None or len(request.output_ids) != 1:
            return None
        return list(request.prompt_logprobs)

    def _finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        with self._cond:
            self.scheduler.release(request)
        self._emit_end(request, reason, error)

    def _emit_end(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        text = request.text.flush()
        output = request.output(reason, error)
        event = Event(request.request_id, None, text, time.perf_counter(), reason, output, error)
        self._send(request, event)

    def _send(self, request: Request, event: Event) -> None:
        if event.finish_reason is not None:
            request.ended = True
        try:
            request.sink(event)
        except Exception:  # the consumer is gone (e.g. its event loop closed): stop its work
            request.cancelled = True

    def _die(self, reason: str) -> None:
        with self._cond:
            if self.death is not None:  # the watchdog and the thread itself may both come
                return
            self.death, self._stopping = reason, True
            leftover = self.scheduler.drain_all()
        step = self._step or SchedulerOutput()
        for request in step.aborted + step.prefill + step.decode:
            if request not in leftover:
                leftover.append(request)
        error = f"the engine failed: {reason}"
        for request in [r for r in leftover if not r.ended]:
            output = request.output("error", error)  # no detokenizer call: it may have failed
            self._send(request, Event(request.request_id, None, "", time.perf_counter(),
                                      "error", output, error))  # fmt: skip

    def _abort_all(self) -> None:
        with self._cond:
            leftover = self.scheduler.drain_all()
        for request in leftover:
            self._emit_end(request, "abort", "the engine stopped")
