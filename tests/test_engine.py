from __future__ import annotations

import random
import threading
from typing import Any

import pytest

from neuronctl.engine.engine import Engine
from neuronctl.engine.errors import EngineStoppedError, QueueFullError, RequestError
from neuronctl.engine.request import RequestOutput
from neuronctl.engine.sampling import SamplingParams
from neuronctl.engine.scheduler import Scheduler, SchedulerOutput
from tests.fake_runner import EOS_ID, FakeRunner, byte_decoder, byte_detokenize
from tests.helpers import wait_until

GREEDY = SamplingParams(temperature=0)


def make_engine(runner: FakeRunner, **kw: object) -> Engine:
    return Engine(runner, byte_decoder, eos_ids=[EOS_ID], **kw).start()  # type: ignore[arg-type]


@pytest.fixture
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(256) for _ in range(rng.randint(1, 20))] for _ in range(13)]


def run_alone(prompt: list[int], params: SamplingParams, **runner_kw: object) -> list[int]:
    engine = make_engine(FakeRunner(batch_size=1, **runner_kw))  # type: ignore[arg-type]
    try:
        return engine.generate([prompt], params)[0].token_ids
    finally:
        engine.stop()


def test_continuous_batching_gives_the_same_tokens_as_one_at_a_time(prompts) -> None:
    # batch 3 for 13 prompts with EOS at random points: slots are freed and refilled mid-run.
    runner = FakeRunner(batch_size=3, eos_every=9)
    engine = make_engine(runner)
    params = [SamplingParams(temperature=0, max_tokens=5 + i % 7) for i in range(len(prompts))]
    outputs = engine.generate(prompts, params)
    engine.stop()
    for prompt, p, out in zip(prompts, params, outputs, strict=True):
        assert out.token_ids == run_alone(prompt, p, eos_every=9)
    assert runner.prefills == len(prompts)
    assert runner.max_live == 3
    assert {o.finish_reason for o in outputs} == {"stop", "length"}


def test_seeded_sampling_does_not_depend_on_the_batch(prompts) -> None:
    engine = make_engine(FakeRunner(batch_size=4))
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=8) for i in range(6)]
    batched = engine.generate(prompts[:6], params)
    again = engine.generate(prompts[:6], params)
    engine.stop()
    for prompt, p, out, out2 in zip(prompts, params, batched, again, strict=False):
        assert out.token_ids == out2.token_ids == run_alone(prompt, p)


def test_eos_ends_with_stop_unless_ignored() -> None:
    runner = FakeRunner(batch_size=2, eos_every=3)
    engine = make_engine(runner)
    prompt = [1, 2, 3]
    stopped = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0]
    ignored = engine.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    )[0]
    engine.stop()
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == EOS_ID
    assert EOS_ID not in stopped.token_ids[:-1]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 40
    assert ignored.token_ids[: len(stopped.token_ids)] == stopped.token_ids


def test_stop_string_cuts_the_text_and_frees_the_slot() -> None:
    engine = make_engine(FakeRunner(batch_size=1))
    full = engine.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=20))[0]
    stop = full.text[6:8]  # a stop string the greedy output is known to contain
    cut = engine.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=20, stop=(stop,)))[0]
    engine.stop()
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert len(cut.token_ids) < 20


def test_streamed_text_adds_up_to_the_final_text() -> None:
    engine = make_engine(FakeRunner(batch_size=2))
    handle = engine.submit([9, 9, 9], SamplingParams(temperature=0.7, seed=3, max_tokens=12))
    events = list(handle)
    engine.stop()
    assert [e.token_id for e in events] == events[-1].output.token_ids  # type: ignore[union-attr]
    assert "".join(e.text for e in events) == events[-1].output.text  # type: ignore[union-attr]
    assert events[-1].finish_reason == "length"
    assert all(e.finish_reason is None for e in events[:-1])


def test_too_long_prompt_and_too_many_tokens_are_refused_with_limits() -> None:
    engine = make_engine(FakeRunner(batch_size=1, seq_len=32, max_context_length=16))
    with pytest.raises(RequestError, match="17 tokens.*at most 16"):
        engine.submit([1] * 17, GREEDY)
    with pytest.raises(RequestError, match=r"10 tokens\) \+ max_tokens \(30\) = 40.*32") as exc:
        engine.submit([1] * 10, SamplingParams(max_tokens=30))
    assert exc.value.hint == "use max_tokens <= 22"
    with pytest.raises(RequestError, match="empty"):
        engine.submit([], GREEDY)
    with pytest.raises(RequestError, match="top_k"):
        engine.submit([1], SamplingParams(top_k=1000))
    # Without max_tokens a request may run to the end of the sequence.
    out = engine.generate([[1] * 10], SamplingParams(temperature=0, ignore_eos=True))[0]
    engine.stop()
    assert len(out.token_ids) == 22 and out.finish_reason == "length"


def test_result_sleeps_until_the_last_event_and_iteration_still_gets_every_one() -> None:
    """result() leaves the events queued until the last one has come (the caller is not woken
    at each token, which took the GIL and a core from the engine's step); its output is the
    one the events end with, and a handle iterated instead still sees each token."""
    engine = Engine(FakeRunner(batch_size=2), byte_decoder)  # stepped by hand: no thread
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    waited, iterated = engine.submit([7, 8], params), engine.submit([7, 8], params)
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(waited.result()))
    waiter.start()
    for _ in range(2):  # the prefill's token, then a decode step's
        engine.apply(engine.scheduler.schedule())
    waiter.join(timeout=0.5)
    assert waiter.is_alive() and waited._events is not None
    assert waited._events.events.qsize() == 2  # not taken one at a time
    while engine.scheduler.has_work():
        engine.apply(engine.scheduler.schedule())
    waiter.join(timeout=10)
    events = list(iterated)
    assert [e.token_id for e in events] == events[-1].output.token_ids  # type: ignore[union-attr]
    last = events[-1].output
    assert last is not None and len(got) == 1
    out = got[0]
    assert isinstance(out, RequestOutput) and out.request_id == waited.request_id
    assert (out.token_ids, out.text, out.finish_reason) == (last.token_ids, last.text, "length")
    assert len(out.token_ids) == 4


def test_full_queue_is_refused_immediately() -> None:
    runner = FakeRunner(batch_size=1, step_delay=0.02)
    engine = make_engine(runner, max_queue=2)
    first = engine.submit([1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    wait_until(lambda: engine.stats()["running"] == 1, 30, "the first request running")
    queued = [engine.submit([2], GREEDY) for _ in range(2)]
    with pytest.raises(QueueFullError, match="queue is full"):
        engine.submit([3], GREEDY)
    first.cancel()
    assert first.result().finish_reason == "abort"
    assert [q.result().finish_reason in ("stop", "length") for q in queued] == [True, True]
    engine.stop()


def test_cancel_frees_the_slot_for_a_waiting_request() -> None:
    runner = FakeRunner(batch_size=1, step_delay=0.005)
    engine = make_engine(runner)
    long = engine.submit([1], SamplingParams(temperature=0, ignore_eos=True))
    short = engine.submit([2], SamplingParams(temperature=0, max_tokens=3))
    next(iter(long))  # the long request is running
    long.cancel()
    out = long.result()
    assert out.finish_reason == "abort" and len(out.token_ids) < 63
    assert short.result().finish_reason in ("stop", "length")
    engine.stop()


def test_runner_failure_ends_only_that_request() -> None:
    engine = make_engine(FakeRunner(batch_size=2, fail_prefill_on=99))
    bad = engine.submit([99, 1], GREEDY)
    good = engine.submit([1, 2], SamplingParams(temperature=0, max_tokens=4))
    bad_out, good_out = bad.result(), good.result()
    engine.stop()
    assert bad_out.finish_reason == "error" and "injected" in (bad_out.error or "")
    assert good_out.finish_reason in ("stop", "length")


def test_stop_drains_in_flight_then_refuses() -> None:
    engine = make_engine(FakeRunner(batch_size=2, step_delay=0.002))
    handles = [engine.submit([i], SamplingParams(temperature=0, max_tokens=10)) for i in range(5)]
    engine.stop(drain=True)
    assert all(h.result().finish_reason in ("stop", "length") for h in handles)
    with pytest.raises(EngineStoppedError):
        engine.submit([1], GREEDY)


def test_stop_without_drain_aborts_the_rest() -> None:
    engine = make_engine(FakeRunner(batch_size=1, step_delay=0.01))
    handles = [engine.submit([i], SamplingParams(temperature=0, ignore_eos=True)) for i in range(3)]
    engine.stop(drain=False)
    assert "abort" in {h.result().finish_reason for h in handles}


def test_submit_is_thread_safe() -> None:
    engine = make_engine(FakeRunner(batch_size=4))
    results: dict[int, list[int]] = {}

    def worker(i: int) -> None:
        results[i] = engine.generate([[i, i + 1]], SamplingParams(temperature=0, max_tokens=6))[
            0
        ].token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.stop()
    for i in range(16):
        assert results[i] == run_alone([i, i + 1], SamplingParams(temperature=0, max_tokens=6))


def test_latency_stats_use_nxdi_field_names_and_interpolate() -> None:
    from neuronctl.engine.bench import latency_stats

    stats = latency_stats([float(v) for v in range(1, 101)])
    assert stats["latency_ms_p50"] == 50.5 and stats["latency_ms_p100"] == 100
    assert stats["latency_ms_p90"] == 90.1 and stats["latency_ms_avg"] == 50.5
    assert set(stats) == {f"latency_ms_p{p}" for p in (50, 90, 95, 99, 100)} | {"latency_ms_avg"}


def test_bench_keeps_concurrency_in_flight_and_counts_tokens() -> None:
    from neuronctl.engine.bench import bench_engine

    # Slow steps give the client threads time to keep 3 requests in flight on a loaded host.
    runner = FakeRunner(batch_size=4, step_delay=0.02)
    engine = make_engine(runner)
    result = bench_engine(
        engine, 320, concurrency=3, requests=9, prompt_len=5, max_tokens=4, warmup=1
    )
    engine.stop()
    assert result["requests"] == 9 and result["failed"] == 0
    assert result["output_tokens"] == 36  # ignore_eos: exactly max_tokens each
    assert runner.max_live == 3  # never more than the concurrency, though 4 slots exist
    assert result["ttft"]["latency_ms_p50"] > 0 and result["tpot"]["latency_ms_p50"] > 0
    assert result["e2e_model"]["throughput"] == result["output_tokens_per_s"]


# -- the scheduler / engine seam ----------------------------------------------------------------


def test_schedule_says_what_to_prefill_decode_and_drop() -> None:
    from neuronctl.engine.request import Request
    from neuronctl.engine.sampling import resolve_params

    scheduler = Scheduler(batch_size=2)
    params = resolve_params(GREEDY)
    a, b, c = (Request([i], params, 4, lambda e: None, byte_decoder()) for i in range(3))
    for r in (a, b, c):
        scheduler.add(r)
    first = scheduler.schedule()
    assert (first.prefill, first.decode, first.aborted) == ([a, b], [], [])
    assert (a.slot, b.slot, c.slot) == (0, 1, None)
    a.cancelled = True
    second = scheduler.schedule()
    assert (second.prefill, second.decode, second.aborted) == ([c], [b], [a])
    assert c.slot == 0


class OnePrefillPerStep(Scheduler):
    """A different policy: admit at most one prompt per step."""

    def schedule(self) -> SchedulerOutput:
        step = super().schedule()
        for late in reversed(step.prefill[1:]):  # give the slots back, keep FIFO order
            self.release(late)
            late.slot = None
            self.waiting.appendleft(late)
        return SchedulerOutput(step.prefill[:1], step.decode, step.aborted)


def test_a_new_scheduling_policy_needs_no_change_to_the_engine(prompts) -> None:
    runner = FakeRunner(batch_size=4)
    engine = Engine(runner, byte_decoder, eos_ids=[EOS_ID], scheduler=OnePrefillPerStep(4)).start()
    params = SamplingParams(temperature=0, max_tokens=6)
    outputs = engine.generate(prompts[:6], params)
    engine.stop()
    assert runner.prefill_calls == [1] * 6
    assert [o.token_ids for o in outputs] == [run_alone(p, params) for p in prompts[:6]]


def test_waiting_prompts_are_encoded_in_one_batched_prefill(prompts) -> None:
    runner = FakeRunner(batch_size=4)
    engine = Engine(runner, byte_decoder, eos_ids=[EOS_ID])
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=5) for i in range(6)]
    handles = [engine.submit(p, sp) for p, sp in zip(prompts, params, strict=False)]
    engine.start()  # six waiting, four slots: one call for four, later calls for the rest
    outputs = [h.result() for h in handles]
    engine.stop()
    assert runner.prefill_calls[0] == 4 and sum(runner.prefill_calls) == 6
    for prompt, p, out in zip(prompts, params, outputs, strict=False):
        assert out.token_ids == run_alone(prompt, p, batched_prefill=False)


def test_a_row_that_fails_to_sample_ends_only_its_request() -> None:
    # NaN logits for the sampled request (prompt starting 99), beside three greedy ones.
    runner = FakeRunner(batch_size=4, nan_on=99)
    engine = make_engine(runner)
    greedy = SamplingParams(temperature=0, max_tokens=6)
    others = [[1, 2], [3], [4, 5, 6]]
    bad = engine.submit([99, 1], SamplingParams(temperature=0.7, max_tokens=6))
    good = [engine.submit(p, greedy) for p in others]
    bad_out, good_out = bad.result(), [h.result() for h in good]
    engine.stop()
    assert bad_out.finish_reason == "error" and "sampling failed" in (bad_out.error or "")
    assert [o.token_ids for o in good_out] == [run_alone(p, greedy) for p in others]
    assert all(len(o.token_ids) == 6 for o in good_out)


def test_a_4000_token_output_is_detokenized_with_constant_work_per_token() -> None:
    from neuronctl.engine.text import WindowDecoder

    decoded_ids = 0

    def counting(ids) -> str:  # type: ignore[no-untyped-def]
        nonlocal decoded_ids
        decoded_ids += len(ids)
        return byte_detokenize(ids)

    runner = FakeRunner(batch_size=1, seq_len=4100)
    engine = Engine(runner, lambda: WindowDecoder(counting), eos_ids=[EOS_ID]).start()
    handle = engine.submit([1], SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True))
    events = list(handle)
    engine.stop()
    out = events[-1].output
    assert out is not None and len(out.token_ids) == 4000
    assert "".join(e.text for e in events) == out.text == byte_detokenize(out.token_ids)
    assert decoded_ids <= 4 * 4000  # re-decoding all ids each step: ~8 million


def test_artifacts_load_without_an_openmp_team_on_the_loading_thread(
    compiled_artifact, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    """The engine runs the model on its own thread; a team the main thread starts while
    loading takes cores from it (2.5x slower decode on 2 cores, docs/performance-log.md). So the
    backend loads with one intra-op thread, and the count is restored after."""
    import torch

    from neuronctl.backends.torch import TorchBackend
    from neuronctl.engine.loader import open_artifact

    seen: list[int] = []
    real_load = TorchBackend.load

    def load(self, path, manifest):  # type: ignore[no-untyped-def]
        seen.append(torch.get_num_threads())
        return real_load(self, path, manifest)

    monkeypatch.setattr(TorchBackend, "load", load)
    before = torch.get_num_threads()
    open_artifact(compiled_artifact)
    assert seen == [1] and torch.get_num_threads() == before


def test_generate_hands_each_request_to_consume_in_prompt_order(prompts) -> None:
    """`neuronctl generate` prints through this hook: each prompt in order, while the later
    ones keep generating; `follow` shows every event and ends with the same output."""
    engine = make_engine(FakeRunner(batch_size=2))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    seen: list[tuple[int, str]] = []

    def consume(index: int, handle) -> RequestOutput:  # type: ignore[no-untyped-def]
        texts: list[str] = []
        output = handle.follow(lambda event: texts.append(event.text))
        seen.append((index, "".join(texts)))
        return output

    try:
        followed = engine.generate(prompts[:5], params, consume)
        plain = engine.generate(prompts[:5], params)
    finally:
        engine.stop()
    assert [o.token_ids for o in followed] == [o.token_ids for o in plain]
    assert seen == [(i, o.text) for i, o in enumerate(plain)]


def test_running_stops_the_engine_however_the_block_ends() -> None:
    """generate and bench run their engine in `running`: an error or Ctrl-C in the block stops
    it at once, abandoning what is still generating, instead of leaving its thread busy."""
    from types import SimpleNamespace

    from neuronctl.engine.loader import running

    loaded = SimpleNamespace(
        runner=FakeRunner(batch_size=1, seq_len=4096, step_delay=0.01),
        tokenizer=SimpleNamespace(new_decoder=byte_decoder),
        eos_ids=[EOS_ID],
        global_topk=256,
    )
    long = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)  # 40 s unstopped
    with pytest.raises(KeyboardInterrupt):
        with running(loaded) as engine:  # type: ignore[arg-type]
            handles = [engine.submit([1, 2, 3], long), engine.submit([4, 5], long)]
            raise KeyboardInterrupt
    assert [h.result().finish_reason for h in handles] == ["abort", "abort"]
    with pytest.raises(EngineStoppedError):
        engine.submit([1], GREEDY)


def _openmp() -> Any:
    """torch's own OpenMP runtime (the one its kernels and the backend's use), or skip."""
    import ctypes
    from pathlib import Path

    import torch

    for name in ("libgomp.so.1", "libiomp5.so", "libomp.so"):
        lib = Path(torch.__file__).parent / "lib" / name
        if lib.exists():
            return ctypes.CDLL(str(lib))
    pytest.skip("torch ships no OpenMP runtime this test can ask")


def test_the_engine_thread_runs_kernels_with_the_starting_threads_intra_op_count() -> None:
    """OpenMP's thread count is per thread (the nthreads-var ICV of the OpenMP spec): a new
    thread starts at the process default, whatever `torch.set_num_threads` set elsewhere,
    until torch's first parallel op on it. The backend's own kernels (`#pragma omp parallel`
    in backends/torch/gemv.cpp and attention.cpp) read the thread's count, so the engine's
    first runner call must already see the caller's count: the one the Runner alone ran with."""
    import torch

    omp = _openmp()
    fresh: list[int] = []
    probe = threading.Thread(target=lambda: fresh.append(omp.omp_get_max_threads()))
    probe.start()
    probe.join()
    want = 1 if fresh[0] != 1 else 2  # a count no new thread has by itself

    seen: list[int] = []

    class Recording(FakeRunner):
        def prefill(self, slot: int, token_ids: list[int]) -> Any:
            seen.append(omp.omp_get_max_threads())  # before any torch op on this thread
            return super().prefill(slot, token_ids)

    before = torch.get_num_threads()
    torch.set_num_threads(want)
    try:
        engine = make_engine(Recording(batch_size=1))
        try:
            engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2))
        finally:
            engine.stop()
    finally:
        torch.set_num_threads(before)
    assert seen == [want]
