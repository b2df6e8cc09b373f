"""/metrics with prometheus_client (as vLLM does), under the names docs/runtime.md lists.

Each app gets its own registry, so several servers in one process (tests) never share
counts; the gauges read the engine's state when scraped.
"""

from __future__ import annotations

from collections.abc import Callable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from neuronctl.engine.request import RequestOutput

# Only the documented series: no *_created timestamps next to every counter.
prometheus_client.disable_created_metrics()

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    def __init__(self, engine_stats: Callable[[], dict[str, int]]) -> None:
        self.registry = reg = CollectorRegistry(auto_describe=True)
        ns = "neuronctl"
        self.requests = Counter(
            "requests", "HTTP requests by endpoint and status code.",
            ["endpoint", "code"], namespace=ns, registry=reg,
        )  # fmt: skip
        self.finished = Counter(
            "requests_finished", "Generation requests finished, by finish reason.",
            ["finish_reason"], namespace=ns, registry=reg,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "prompt_tokens", "Prompt tokens processed.", namespace=ns, registry=reg
        )
        self.generation_tokens = Counter(
            "generation_tokens", "Tokens generated.", namespace=ns, registry=reg
        )
        self.ttft = Histogram(
            "time_to_first_token_seconds", "Arrival to first token.",
            buckets=TTFT_BUCKETS, namespace=ns, registry=reg,
        )  # fmt: skip
        self.tpot = Histogram(
            "time_per_output_token_seconds", "Time between output tokens.",
            buckets=TPOT_BUCKETS, namespace=ns, registry=reg,
        )  # fmt: skip
        self.e2e = Histogram(
            "e2e_request_latency_seconds", "Arrival to last token.",
            buckets=E2E_BUCKETS, namespace=ns, registry=reg,
        )  # fmt: skip
        for name, key, help_ in (
            ("queue_depth", "waiting", "Requests waiting for a slot."),
            ("slots_in_use", "running", "KV-cache slots holding a sequence."),
            ("slots_total", "batch_size", "KV-cache slots (the compiled batch size)."),
        ):
            gauge = Gauge(name, help_, namespace=ns, registry=reg)
            gauge.set_function(lambda key=key: engine_stats()[key])  # type: ignore[misc]

    def count_request(self, endpoint: str, code: int) -> None:
        self.requests.labels(endpoint=endpoint, code=str(code)).inc()

    def observe(self, output: RequestOutput) -> None:
        """Latency histograms are observed when a request finishes."""
        self.finished.labels(finish_reason=output.finish_reason).inc()
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(len(output.token_ids))
        t = output.timings
        if t.first_token is not None:
            self.ttft.observe(t.first_token - t.arrival)
        if t.finished is not None:
            self.e2e.observe(t.finished - t.arrival)
        times = output.token_times
        for earlier, later in zip(times, times[1:], strict=False):
            self.tpot.observe(later - earlier)

    def render(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)
