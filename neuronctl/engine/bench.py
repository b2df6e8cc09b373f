"""Load generation against an engine and the report `neuronctl bench` prints.

The report uses NxD Inference's benchmark field names (latency_ms_p50/p90/p95/p99/p100/avg and
throughput) for each measured quantity, plus TTFT and TPOT (time per output token).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from typing import Any

from neuronctl.engine.engine import Engine
from neuronctl.engine.request import RequestOutput
from neuronctl.engine.sampling import SamplingParams

PERCENTILES = (50, 90, 95, 99, 100)


def latency_stats(values_ms: Sequence[float]) -> dict[str, float | None]:
    """p50..p100 (linear interpolation, as numpy) and the mean, in milliseconds."""
    if not values_ms:
        return {**{f"latency_ms_p{p}": None for p in PERCENTILES}, "latency_ms_avg": None}
    ordered = sorted(values_ms)
    stats: dict[str, float | None] = {
        f"latency_ms_p{p}": round(_percentile(ordered, p), 3) for p in PERCENTILES
    }
    stats["latency_ms_avg"] = round(sum(ordered) / len(ordered), 3)
    return stats


def _percentile(ordered: Sequence[float], p: float) -> float:
    rank = (len(ordered) - 1) * p / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def random_prompts(count: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    # Byte-range ids: valid and ordinary tokens in any byte-level tokenizer.
    rng = random.Random(seed)
    top = min(vocab_size, 256)
    return [[rng.randrange(top) for _ in range(length)] for _ in range(count)]


def run_load(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    concurrency: int,
    max_tokens: int,
) -> tuple[list[RequestOutput], float]:
    """Keep `concurrency` requests in flight until every prompt ran; (outputs, wall seconds)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs: list[RequestOutput | None] = [None] * len(prompts)
    next_index = iter(range(len(prompts)))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            outputs[i] = engine.submit(prompts[i], params).result()

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    return [o for o in outputs if o is not None], wall


def report(
    outputs: Sequence[RequestOutput], wall_s: float, config: dict[str, Any]
) -> dict[str, Any]:
    tokens = sum(len(o.token_ids) for o in outputs)
    e2e = [(o.timings.finished - o.timings.arrival) * 1000 for o in outputs if o.timings.finished]
    ttft = [
        (o.timings.first_token - o.timings.arrival) * 1000 for o in outputs if o.timings.first_token
    ]
    tpot = [t for o in outputs if (t := o.tpot_ms()) is not None]
    failed = [o for o in outputs if o.finish_reason == "error"]
    return {
        "config": config,
        "requests": len(outputs),
        "failed": len(failed),
        "duration_s": round(wall_s, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall_s, 2) if wall_s else None,
        "requests_per_s": round(len(outputs) / wall_s, 3) if wall_s else None,
        "e2e_model": {
            **latency_stats(e2e),
            "throughput": round(tokens / wall_s, 2) if wall_s else None,
        },
        "ttft": latency_stats(ttft),
        "tpot": latency_stats(tpot),
    }


def bench_engine(
    engine: Engine,
    vocab_size: int,
    *,
    concurrency: int,
    requests: int,
    prompt_len: int,
    max_tokens: int,
    warmup: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    prompts = random_prompts(requests + warmup, prompt_len, vocab_size, seed)
    if warmup:  # first calls load kernels and allocate: keep them out of the numbers
        run_load(engine, prompts[:warmup], min(warmup, concurrency), max_tokens)
    outputs, wall = run_load(engine, prompts[warmup:], concurrency, max_tokens)
    config = {
        "concurrency": concurrency,
        "requests": requests,
        "prompt_len": prompt_len,
        "max_tokens": max_tokens,
    }
    return report(outputs, wall, config)


def runner_decode_speed(
    runner: Any, batch: int, prompt_len: int, steps: int, seed: int = 0
) -> dict[str, float]:
    """The Runner's own greedy decode speed with `batch` live slots: the reference the
    engine's overhead is measured against (no engine, no sampling beyond an argmax)."""
    from neuronctl.engine.sampling import argmax_rows

    prompts = random_prompts(batch, prompt_len, runner.vocab_size, seed)
    tokens = [0] * runner.batch_size
    positions = [-1] * runner.batch_size
    for slot, prompt in enumerate(prompts):
        tokens[slot] = argmax_rows(runner.prefill(slot, prompt).unsqueeze(0))[0]
        positions[slot] = prompt_len
    runner.decode(tokens, positions)  # warm-up step, not measured
    spent = 0.0
    for _ in range(steps):
        positions = [p + 1 if p >= 0 else -1 for p in positions]
        started = time.perf_counter()
        logits = runner.decode(tokens, positions)
        spent += time.perf_counter() - started
        picked = argmax_rows(logits)
        tokens = [picked[s] if positions[s] >= 0 else 0 for s in range(runner.batch_size)]
    return {
        "batch": batch,
        "tokens_per_s": round(batch * steps / spent, 2),
        "ms_per_step": round(spent / steps * 1000, 3),
    }
