"""`neuronctl serve` as a real process on 127.0.0.1, driven with the official openai client.

Two servers per module: the real tiny compiled artifact (API behaviour, results), and the
server over tests/fake_runner.py's slow FakeRunner (queue limits, guards and SIGTERM need
steps slow enough to act while a request is in flight).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from neuronctl.engine.sampling import SamplingParams
from neuronctl.server.app import create_app
from neuronctl.server.metrics import Metrics
from neuronctl.server.streams import Run
from tests.fake_runner import BYTE_TOKENS, FakeRunner
from tests.helpers import cli_in_process, wait_until
from tests.test_faults import ByteModel, engine_over

API_KEY = "test-key"
MODEL = "tiny"
REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, argv: list[str], port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("NEURONCTL_API_KEY", None)
        # A file, not a pipe: readable while the server runs, and never full (a full pipe
        # would block a server logging every request).
        self._output = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=self._output, stderr=subprocess.STDOUT, text=True
        )
        self._wait_healthy()

    def _wait_healthy(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise AssertionError(f"server not healthy after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        """What the server has printed so far, stdout and stderr."""
        self._output.seek(0)
        return self._output.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def serve_argv(artifact: Path, port: int, *extra: str) -> list[str]:
    code = "from neuronctl.cli.main import main; main()"
    return [sys.executable, "-c", code, "serve", "--artifacts", str(artifact), "--port", str(port),
            "--uvicorn-log-level", "warning", *extra]  # fmt: skip


@contextmanager
def serving(artifact: Path, *extra: str) -> Iterator[Server]:
    """A real `neuronctl serve` of `artifact` on a free port, stopped afterwards."""
    port = free_port()
    srv = Server(serve_argv(artifact, port, *extra), port)
    try:
        yield srv
    finally:
        srv.stop()


def fake_argv(tokenizer_dir: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tests.fake_runner", "--tokenizer", str(tokenizer_dir),
            "--port", str(port), *extra]  # fmt: skip


@pytest.fixture(scope="module")
def server(compiled_artifact: Path) -> Iterator[Server]:
    with serving(compiled_artifact, "--api-key", API_KEY, "--served-model-name", MODEL) as srv:
        yield srv


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(compiled_artifact: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(compiled_artifact))


GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


def test_models_list_names_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion_counts_usage(client: openai.OpenAI, tokenizer) -> None:  # type: ignore[no-untyped-def]
    out = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=7, **GREEDY)
    assert out.object == "text_completion"
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert len(choice.model_extra["token_ids"]) == 7  # type: ignore[index]
    assert choice.text == tokenizer.decode(
        choice.model_extra["token_ids"], skip_special_tokens=True
    )  # type: ignore[index]
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(tokenizer("Hello there")["input_ids"])
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7


def test_several_prompts_in_one_completion_request(client: openai.OpenAI) -> None:
    single = client.completions.create(model=MODEL, prompt="b", max_tokens=4, **GREEDY)
    out = client.completions.create(model=MODEL, prompt=["a", "b", "c"], max_tokens=4, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.choices[1].model_extra == single.choices[0].model_extra
    assert out.usage is not None and out.usage.completion_tokens == 12


def test_chat_completion_uses_the_chat_template(client: openai.OpenAI, tokenizer) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": "Say hi"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, **GREEDY)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert out.usage.completion_tokens == 5


def test_streaming_chat_matches_the_whole_answer_and_ends_with_usage(
    client: openai.OpenAI,
) -> None:
    messages = [{"role": "user", "content": "Count"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, **GREEDY)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=9,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids", [])]  # type: ignore[union-attr]
    assert text == whole.choices[0].message.content
    assert ids == whole.choices[0].model_extra["token_ids"]  # type: ignore[index]
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 9
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens  # type: ignore[union-attr]


def test_requests_without_the_key_are_rejected(server: Server) -> None:
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    r = httpx.get(server.url + "/v1/models")
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/health").status_code == 200  # health needs no key
    # /tokenize runs the tokenizer: it takes the key too (vLLM leaves it open)
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.get(server.url + "/version").status_code == 200


def test_malformed_requests_get_openai_error_json(server: Server, client: openai.OpenAI) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL}, headers=headers)
    assert r.status_code == 400  # as vLLM: validation errors are 400s, not FastAPI's 422
    assert r.json()["error"]["param"] == "prompt"
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
        headers=headers,
    )
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers=headers)
    assert r.status_code == 400
    with pytest.raises(openai.BadRequestError, match="global top_k 256"):
        client.completions.create(model=MODEL, prompt="x", extra_body={"top_k": 1000})
    with pytest.raises(openai.BadRequestError, match="at most 64"):
        client.completions.create(model=MODEL, prompt="y" * 80)
    with pytest.raises(openai.BadRequestError, match="sequence length 128"):
        client.completions.create(model=MODEL, prompt="y", max_tokens=200)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="other", prompt="x")
    assert httpx.get(server.url + "/v1/nothing", headers=headers).status_code == 404


def test_metrics_are_prometheus_text(server: Server, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="m", max_tokens=3, **GREEDY)
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics").text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    engine = (("engine", "0"), ("model_name", MODEL))
    assert samples[("neuronctl_slots_total", ())] == 4
    assert samples[("vllm:time_to_first_token_seconds_count", engine)] >= 1
    assert samples[("vllm:inter_token_latency_seconds_count", engine)] >= 2
    labels = (("code", "200"), ("endpoint", "/v1/completions"))
    assert samples[("neuronctl_requests_total", labels)] >= 1
    assert samples[("vllm:generation_tokens_total", engine)] >= 3
    assert "# TYPE vllm:num_requests_waiting gauge" in text


def test_32_concurrent_streams_match_each_prompt_run_alone(server: Server) -> None:
    prompts = [f"prompt number {i} " + "x" * (i % 11) for i in range(32)]
    lengths = [3 + i % 9 for i in range(32)]  # finish at different steps: slots get reused

    async def one(client: openai.AsyncOpenAI, prompt: str, n: int) -> list[int]:
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=n, stream=True, **GREEDY
        )
        ids: list[int] = []
        async for chunk in stream:
            ids += chunk.choices[0].model_extra.get("token_ids", []) if chunk.choices else []  # type: ignore[union-attr]
        return ids

    async def together() -> list[list[int]]:
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key=API_KEY, max_retries=0
        ) as client:
            return await asyncio.gather(
                *(one(client, p, n) for p, n in zip(prompts, lengths, strict=True))
            )

    async def alone() -> list[list[int]]:
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key=API_KEY, max_retries=0
        ) as client:
            return [await one(client, p, n) for p, n in zip(prompts, lengths, strict=True)]

    batched = asyncio.run(together())
    assert [len(ids) for ids in batched] == lengths
    assert batched == asyncio.run(alone())


# -- the fake-runner server: slow steps ---------------------------------------------------------


@pytest.fixture(scope="module")
def slow_server(tiny_llama: Path) -> Iterator[Server]:
    """One slot, one queue place, a key and a prompt limit: the queue tests and the guard
    tests share it (one server start fewer). 0.05 s a step and room for 500 tokens: a request
    left to run holds its slot for 25 s."""
    port = free_port()
    argv = fake_argv(
        tiny_llama, port, "--batch-size", "1", "--max-queue", "1", "--api-key", API_KEY,
        "--max-prompt-chars", "1000", "--step-delay", "0.05", "--seq-len", "512",
    )  # fmt: skip
    srv = Server(argv, port)
    yield srv
    srv.stop()


AUTH = {"Authorization": f"Bearer {API_KEY}"}


def health(server: Server) -> dict[str, Any]:
    return dict(httpx.get(server.url + "/health", timeout=10).json())


def test_full_queue_gets_429_not_a_hang(slow_server: Server) -> None:
    body = {"model": "fake", "prompt": "a", "max_tokens": 30, "ignore_eos": True, "stream": True}
    url = slow_server.url + "/v1/completions"
    with httpx.Client(timeout=30, headers=AUTH) as http:
        # Takes the only slot for 25 s, unless it is let go.
        running = http.send(http.build_request("POST", url, json={**body, "max_tokens": 500}),
                            stream=True)  # fmt: skip
        lines = running.iter_lines()  # (dropping the iterator would close the stream)
        next(lines)
        with http.stream("POST", url, json=body) as queued:  # the one queue place
            wait_until(lambda: health(slow_server)["waiting"] == 1, 30, "one request queued")
            full = httpx.post(url, json={**body, "stream": False}, headers=AUTH, timeout=20)
            # Not a hang: refused while both places were still held, not once one freed.
            assert (health(slow_server)["running"], health(slow_server)["waiting"]) == (1, 1)
            assert full.status_code == 429
            assert full.json()["error"]["type"] == "rate_limit_error"
            assert full.headers["retry-after"] == "1"
            running.close()  # the queued request runs now, not in 25 s
            assert '"finish_reason":"length"' in "".join(queued.iter_lines())


def test_a_client_that_goes_away_frees_its_slot(slow_server: Server) -> None:
    body = {"model": "fake", "prompt": "a", "max_tokens": 500, "ignore_eos": True, "stream": True}
    url = slow_server.url + "/v1/completions"
    with httpx.stream("POST", url, json=body, headers=AUTH) as stream:
        lines = stream.iter_lines()
        next(lines)
        assert health(slow_server)["running"] == 1
    # 500 tokens would hold the slot for 25 s; the abort takes one step.
    wait_until(lambda: health(slow_server)["running"] == 0, 12, "the slot freed")


def test_sigterm_drains_with_health_503_then_exits_0_and_off_loopback_warns(
    tiny_llama: Path,
) -> None:
    """A server of its own, since it ends it. Bound off loopback without a key, so the same
    start also shows the warning that binding earns (one server start fewer)."""
    port = free_port()
    argv = fake_argv(tiny_llama, port, "--batch-size", "2", "--max-queue", "4", "--host", "0.0.0.0")
    srv = Server(argv, port)
    body = {"model": "fake", "prompt": "a", "max_tokens": 60, "ignore_eos": True, "stream": True}
    chunks = []
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", srv.url + "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            chunks.append(next(lines))
            srv.proc.send_signal(signal.SIGTERM)
            draining = lambda: httpx.get(srv.url + "/health", timeout=5)  # noqa: E731
            wait_until(lambda: draining().status_code == 503, 20, "health turning 503")
            answer = draining()  # still answering while the stream runs (60 tokens: 3 s)
            assert answer.status_code == 503 and answer.json()["status"] == "draining"
            assert answer.json()["running"] == 1
            refused = httpx.post(srv.url + "/v1/completions", json=body, timeout=2)
            assert refused.status_code == 503
            chunks += list(lines)
    assert srv.proc.wait(30) == 0
    data = [c for c in chunks if c.startswith("data: {")]
    assert len(data) == 60  # every token arrived, the last with its finish reason
    assert '"finish_reason":"length"' in data[-1]
    assert [c for c in chunks if c][-1] == "data: [DONE]"
    with pytest.raises(httpx.TransportError):  # gone once nothing was left in flight
        httpx.get(srv.url + "/health", timeout=2)
    assert "without an API key" in srv.log()


# -- hardening: isolation, limits, refusals ----------------------------------------------------


def test_bad_sampling_values_get_400_while_greedy_neighbours_succeed(server: Server) -> None:
    async def greedy(client: openai.AsyncOpenAI, i: int) -> int:
        out = await client.completions.create(
            model=MODEL, prompt=f"neighbour {i}", max_tokens=8, **GREEDY
        )
        return len(out.choices[0].model_extra["token_ids"])  # type: ignore[index]

    async def bad(client: openai.AsyncOpenAI, **fields: Any) -> str | None:
        try:
            await client.completions.create(model=MODEL, prompt="x", max_tokens=8, **fields)
        except openai.BadRequestError as exc:
            return exc.body["param"]  # type: ignore[index]
        return None

    async def together() -> list[Any]:
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key=API_KEY, max_retries=0
        ) as client:
            return await asyncio.gather(
                *(greedy(client, i) for i in range(3)),
                bad(client, temperature=2e-39),
                bad(client, temperature=1e-300),
                bad(client, seed=2**64),
            )

    results = asyncio.run(together())
    assert results == [8, 8, 8, "temperature", "temperature", "seed"]


@pytest.mark.parametrize(
    "field, value",
    [
        ("response_format", {"type": "json_object"}),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("suffix", "end"),
    ],
)
def test_unsupported_result_changing_fields_are_refused_by_name(
    client: openai.OpenAI, field: str, value: Any
) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={field: value})
    assert exc.value.body["param"] == field  # type: ignore[index]
    assert field in str(exc.value)


def test_neutral_values_of_unsupported_fields_are_accepted(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
        presence_penalty=0, frequency_penalty=0, logit_bias={}, n=1,
        response_format={"type": "text"}, user="someone",
    )  # fmt: skip
    assert out.choices[0].finish_reason in ("stop", "length")


def test_an_empty_prompt_is_refused(client: openai.OpenAI) -> None:
    for prompt in ("", [""], [[]]):
        with pytest.raises(openai.BadRequestError, match="empty"):
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)  # type: ignore[arg-type]


def test_a_busy_port_fails_in_one_line_before_serving_on(
    server: Server, compiled_artifact: Path
) -> None:
    # The module's server holds the port. In this process: what serve says and its exit code
    # are tested, and the port is refused before anything is loaded or served.
    argv = serve_argv(compiled_artifact, server.port)[3:]  # from "serve" on
    out = cli_in_process(*argv)
    assert out.returncode == 1
    assert "serving on" not in out.stderr + out.stdout
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines[0].startswith("artifact trusted:")  # said before loading, as always
    assert "cannot listen on 127.0.0.1:" in lines[1] and "Traceback" not in out.stderr




UPLOADS = """
import json, sys, threading, httpx
url, key = sys.argv[1], sys.argv[2]
big = b'{"model": "fake", "prompt": "' + b"x" * (50 * 1024 * 1024) + b'"}'
def chunked():  # no Content-Length: the cap must apply while the body streams in
    for i in range(0, len(big), 1 << 20):
        yield big[i : i + (1 << 20)]
auth = {"Authorization": "Bearer " + key}
answers = {}
def post(name, headers, content):
    answers[name] = httpx.post(url, content=content, headers=headers, timeout=120).status_code
threads = [threading.Thread(target=post, args=a) for a in
           (("no key", {}, big), ("sized", auth, big), ("chunked", auth, chunked()))]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(answers))
"""


def test_a_50_mb_body_is_refused_while_health_keeps_answering(slow_server: Server) -> None:
    # The uploads come from another process, so /health timings measure the server alone.
    uploads = subprocess.Popen(
        [sys.executable, "-c", UPLOADS, slow_server.url + "/v1/completions", API_KEY],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    health = []
    while uploads.poll() is None:
        started = time.monotonic()
        status = httpx.get(slow_server.url + "/health", timeout=5).status_code
        health.append((status, time.monotonic() - started))
        time.sleep(0.05)
    out, _ = uploads.communicate()
    assert json.loads(out) == {"no key": 401, "sized": 413, "chunked": 413}
    # Answered while the uploads ran (the old server blocked /health for 40 s on one such
    # body). The bound is generous: this is a probe on a shared, loaded host.
    assert health and all(code == 200 and took < 5 for code, took in health), health


def test_a_prompt_over_the_character_limit_is_refused(slow_server: Server) -> None:
    body = {"model": "fake", "prompt": "y" * 1001, "max_tokens": 2}
    r = httpx.post(slow_server.url + "/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "at most 1000" in r.json()["error"]["message"]
    chat = {"model": "fake", "messages": [{"role": "user", "content": "z" * 1001}]}
    r = httpx.post(slow_server.url + "/v1/chat/completions", json=chat, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_a_non_streaming_client_that_goes_away_frees_its_slot(slow_server: Server) -> None:
    body = {"model": "fake", "prompt": "a", "max_tokens": 500, "ignore_eos": True}
    url = slow_server.url + "/v1/completions"
    with pytest.raises(httpx.ReadTimeout):  # 500 tokens take 25 s; the client leaves after 0.5
        httpx.post(url, json=body, headers=AUTH, timeout=httpx.Timeout(5, read=0.5))
    running = lambda: health(slow_server)["running"]  # noqa: E731
    wait_until(lambda: running() == 0, 12, "the abandoned request's slot freed")


def test_logprobs_of_a_compiled_artifact_match_log_softmax_of_transformers_logits(
    client: openai.OpenAI, tiny_llama: Path, tokenizer  # type: ignore[no-untyped-def]
) -> None:
    """Echoed prompt logprobs (scored through decode steps) and sampled-token logprobs equal
    torch.log_softmax of the fp32 reference model's logits at every position."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), torch_dtype=torch.float32).eval()
    prompt = "The quick brown fox"
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, logprobs=2, echo=True, **GREEDY
    )
    choice = out.choices[0]
    ids = tokenizer(prompt)["input_ids"] + choice.model_extra["token_ids"]  # type: ignore[index]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        assert max(lp.top_logprobs[i].values()) == pytest.approx(ref[i - 1].max().item(), abs=1e-4)


# -- event-loop wake-ups, in process over the FakeRunner ----------------------------------------


class ByteText(ByteModel):
    """ByteModel with the rest of the TextModel protocol (logprobs need token strings)."""

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return "".join(map(self.token_str, token_ids))

    def token_str(self, token_id: int) -> str:
        return chr(token_id) if token_id < BYTE_TOKENS else ""


def post_counting_wakes(
    monkeypatch: pytest.MonkeyPatch, path: str, body: dict[str, Any]
) -> tuple[httpx.Response, int]:
    """POST `body` to an in-process server over the FakeRunner; returns the response and how
    many times the engine thread woke the event loop (call_soon_threadsafe) meanwhile."""
    engine = engine_over(FakeRunner(batch_size=4, seq_len=128)).start()
    app = create_app(engine, ByteText(), "fake")
    wakes = 0

    async def send() -> httpx.Response:
        loop = asyncio.get_running_loop()
        wake = loop.call_soon_threadsafe

        def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal wakes
            wakes += threading.current_thread().name == "neuronctl-engine"
            return wake(*args, **kwargs)

        monkeypatch.setattr(loop, "call_soon_threadsafe", counted)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(path, json={"model": "fake", **body})

    try:
        response = asyncio.run(send())
    finally:
        engine.stop()
    assert response.status_code == 200, response.text
    return response, wakes


TOKENS = 24
LONG = {"max_tokens": TOKENS, "ignore_eos": True, "seed": 7}
CHAT = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize(
    ("path", "body", "requests"),
    [
        ("/v1/completions", {"prompt": "abc"}, 1),
        ("/v1/chat/completions", {"messages": CHAT}, 1),
        ("/v1/completions", {"prompt": "abc", "n": 2, "logprobs": 2}, 2),
        ("/v1/chat/completions", {"messages": CHAT, "n": 2, "logprobs": True}, 2),
        ("/v1/completions", {"prompt": "abc", "best_of": 3}, 3),
    ],
    ids=["completion", "chat", "completion-n2-logprobs", "chat-n2-logprobs", "best_of3"],
)
def test_a_whole_answer_wakes_the_event_loop_once_per_sequence_not_per_token(
    monkeypatch: pytest.MonkeyPatch, path: str, body: dict[str, Any], requests: int
) -> None:
    """A request that does not stream needs only each sequence's output. Its sink woke the
    event loop at every token (TOKENS times per sequence here), and on a 2-core host the loop
    thread then took the GIL and a core from every other request's engine step."""
    response, wakes = post_counting_wakes(monkeypatch, path, {**body, **LONG})
    assert response.json()["usage"]["completion_tokens"] == TOKENS * requests
    assert wakes == requests


def test_a_stream_still_gets_each_token_as_it_comes_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    body = {"prompt": "abc", "return_token_ids": True, **LONG}
    whole, _ = post_counting_wakes(monkeypatch, "/v1/completions", body)
    streamed, wakes = post_counting_wakes(monkeypatch, "/v1/completions", {**body, "stream": True})
    chunks = [
        json.loads(line.removeprefix("data: "))
        for line in streamed.text.splitlines()
        if line.startswith("data: {")
    ]
    ids = [i for c in chunks for i in c["choices"][0]["token_ids"]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    choice = whole.json()["choices"][0]
    assert ids == choice["token_ids"] and len(ids) == TOKENS
    assert text == choice["text"]
    assert wakes == TOKENS  # one per token; the last token's event carries the end


def test_a_whole_answer_whose_event_loop_closed_stops_generating() -> None:
    """The engine ends a request whose sink raises (its consumer is gone); a request that
    does not stream still raises at its next token once its event loop has closed, though
    its sink no longer wakes the loop per token."""
    engine = engine_over(FakeRunner(batch_size=1, seq_len=512, step_delay=0.01)).start()
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def submit() -> None:
        Run(engine, [([1, 2], params)], Metrics(engine.stats, "fake", 512), [[1, 2]], stream=False)
        while engine.stats()["running"] == 0:
            await asyncio.sleep(0.01)

    asyncio.run(submit())  # the loop closes with the request 4 s from its end
    try:
        wait_until(lambda: engine.stats()["running"] == 0, 2, "the orphaned request ended")
    finally:
        engine.stop(drain=False)
