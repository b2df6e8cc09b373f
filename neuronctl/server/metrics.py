"""Prometheus text exposition (format 0.0.4), written by hand: a few counters, gauges and
histograms are all /metrics needs. Updated from the event loop only, so no locks."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

from neuronctl.engine.request import RequestOutput

PREFIX = "neuronctl"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Histogram:
    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += 1

    def lines(self) -> list[str]:
        """Sample lines without the metric name (the caller prefixes it)."""
        pairs = zip(self.buckets, self.counts, strict=True)
        out = [f'_bucket{{le="{b}"}} {c}' for b, c in pairs]
        out.append(f'_bucket{{le="+Inf"}} {self.count}')
        out.append(f"_sum {self.sum:.6f}")
        out.append(f"_count {self.count}")
        return out


class Metrics:
    def __init__(self, engine_stats: Callable[[], dict[str, int]]) -> None:
        self.engine_stats = engine_stats
        self.requests: dict[tuple[str, str], int] = defaultdict(int)  # (endpoint, code) -> n
        self.finished: dict[str, int] = defaultdict(int)  # finish_reason -> n
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def count_request(self, endpoint: str, code: int) -> None:
        self.requests[(endpoint, str(code))] += 1

    def observe(self, output: RequestOutput) -> None:
        self.finished[output.finish_reason] += 1
        self.prompt_tokens += len(output.prompt_token_ids)
        self.generation_tokens += len(output.token_ids)
        t = output.timings
        if t.first_token is not None:
            self.ttft.observe(t.first_token - t.arrival)
        if t.finished is not None:
            self.e2e.observe(t.finished - t.arrival)
        times = output.token_times
        for earlier, later in zip(times, times[1:], strict=False):
            self.tpot.observe(later - earlier)

    def render(self) -> str:
        stats = self.engine_stats()
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, lines: list[str]) -> None:
            full = f"{PREFIX}_{name}"
            out.append(f"# HELP {full} {help_}")
            out.append(f"# TYPE {full} {kind}")
            out.extend(f"{full}{line}" for line in lines)

        metric(
            "requests_total",
            "counter",
            "HTTP requests by endpoint and status code.",
            [f'{{endpoint="{e}",code="{c}"}} {n}' for (e, c), n in sorted(self.requests.items())],
        )
        metric(
            "requests_finished_total",
            "counter",
            "Generation requests finished, by finish reason.",
            [f'{{finish_reason="{r}"}} {n}' for r, n in sorted(self.finished.items())],
        )
        metric(
            "prompt_tokens_total", "counter", "Prompt tokens processed.", [f" {self.prompt_tokens}"]
        )
        metric(
            "generation_tokens_total",
            "counter",
            "Tokens generated.",
            [f" {self.generation_tokens}"],
        )
        for name, hist, help_ in (
            ("time_to_first_token_seconds", self.ttft, "Arrival to first token."),
            ("time_per_output_token_seconds", self.tpot, "Time between output tokens."),
            ("e2e_request_latency_seconds", self.e2e, "Arrival to last token."),
        ):
            metric(name, "histogram", help_, hist.lines())
        metric("queue_depth", "gauge", "Requests waiting for a slot.", [f" {stats['waiting']}"])
        metric(
            "slots_in_use", "gauge", "KV-cache slots holding a sequence.", [f" {stats['running']}"]
        )
        metric(
            "slots_total",
            "gauge",
            "KV-cache slots (the compiled batch size).",
            [f" {stats['batch_size']}"],
        )
        return "\n".join(out) + "\n"
