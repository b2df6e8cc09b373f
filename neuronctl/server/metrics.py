"""/metrics with prometheus_client, under vLLM's metric names and labels, so dashboards and
alerts written for vLLM's server read this one unchanged.

vLLM (vllm/v1/metrics/loggers.py, PrometheusStatLogger) labels every series with
`model_name` (the served model name) and `engine` ("0" for a single engine). Only what vLLM
has no name for stays `neuronctl_*`: HTTP requests by endpoint and code, and the slot count.
Each app gets its own registry, so several servers in one process (tests) never share counts;
the gauges read the engine's state when scraped.
"""

from __future__ import annotations

from collections.abc import Callable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from neuronctl.engine.request import RequestOutput

# Only the documented series: no *_created timestamps next to every counter.
prometheus_client.disable_created_metrics()

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
# vLLM's buckets for each histogram (same file), so bucket-based quantiles compare.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
LABELS = ("model_name", "engine")


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's build_1_2_5_buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return out
            out.append(step * scale)
        scale *= 10


class Metrics:
    def __init__(
        self, engine_stats: Callable[[], dict[str, int]], model_name: str = "", max_len: int = 0
    ) -> None:
        self.registry = reg = CollectorRegistry(auto_describe=True)
        self.label = {"model_name": model_name, "engine": "0"}
        self.requests = Counter(
            "requests", "HTTP requests by endpoint and status code.",
            ["endpoint", "code"], namespace="neuronctl", registry=reg,
        )  # fmt: skip
        slots = Gauge("neuronctl_slots_total", "KV-cache slots (the compiled batch size).",
                      registry=reg)  # fmt: skip
        slots.set_function(lambda: engine_stats()["batch_size"])
        for name, help_, read in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             lambda: engine_stats()["running"]),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             lambda: engine_stats()["waiting"]),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage (the "
             "static cache's slots that hold a sequence).", lambda: _usage(engine_stats())),
        ):  # fmt: skip
            Gauge(name, help_, LABELS, registry=reg).labels(**self.label).set_function(read)
        self.finished = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            [*LABELS, "finished_reason"], registry=reg,
        )  # fmt: skip
        self.prompt_tokens = self._counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed."
        )
        self.generation_tokens = self._counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        tokens = buckets_1_2_5(max(max_len, 1))
        self.prompt_hist = self._histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens
        )
        self.generation_hist = self._histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self.ttft = self._histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )  # fmt: skip
        self.itl = self._histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )  # fmt: skip
        self.tpot = self._histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS,
        )  # fmt: skip
        self.phases = {
            phase: self._histogram(f"vllm:{name}", f"Histogram of {what} in seconds.",
                                   LATENCY_BUCKETS)
            for phase, name, what in (
                ("e2e", "e2e_request_latency_seconds", "e2e request latency"),
                ("queue", "request_queue_time_seconds", "time spent in WAITING phase for request"),
                ("inference", "request_inference_time_seconds",
                 "time spent in RUNNING phase for request"),
                ("prefill", "request_prefill_time_seconds",
                 "time spent in PREFILL phase for request"),
                ("decode", "request_decode_time_seconds", "time spent in DECODE phase for request"),
            )
        }  # fmt: skip

    def _counter(self, name: str, help_: str) -> Counter:
        return Counter(name, help_, LABELS, registry=self.registry).labels(**self.label)

    def _histogram(self, name: str, help_: str, buckets: tuple | list) -> Histogram:
        made = Histogram(name, help_, LABELS, buckets=buckets, registry=self.registry)
        return made.labels(**self.label)

    def count_request(self, endpoint: str, code: int) -> None:
        self.requests.labels(endpoint=endpoint, code=str(code)).inc()

    def observe(self, output: RequestOutput) -> None:
        """Per-request series are observed when a request finishes."""
        self.finished.labels(**self.label, finished_reason=output.finish_reason).inc()
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(len(output.token_ids))
        self.prompt_hist.observe(len(output.prompt_token_ids))
        self.generation_hist.observe(len(output.token_ids))
        t = output.timings
        spans = {
            "e2e": (t.arrival, t.finished),
            "queue": (t.arrival, t.scheduled),
            "inference": (t.scheduled, t.finished),
            "prefill": (t.scheduled, t.first_token),
            "decode": (t.first_token, t.finished),
        }
        for phase, (start, end) in spans.items():
            if start is not None and end is not None:
                self.phases[phase].observe(end - start)
        if t.first_token is not None:
            self.ttft.observe(t.first_token - t.arrival)
        times = output.token_times
        for earlier, later in zip(times, times[1:], strict=False):
            self.itl.observe(later - earlier)
        if len(times) > 1:
            self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))

    def render(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)


def _usage(stats: dict[str, int]) -> float:
    return stats["running"] / stats["batch_size"] if stats["batch_size"] else 0.0
