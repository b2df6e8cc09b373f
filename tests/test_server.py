"""`neuronctl serve` as a real process on 127.0.0.1, driven with the official openai client.

Two servers per module: the real tiny compiled artifact (API behaviour, results), and the
server over tests/fake_runner.py's slow FakeRunner (queue limits and SIGTERM need steps slow
enough to act while a request is in flight).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

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
        self.proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
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
        return self.proc.stdout.read() if self.proc.stdout and self.proc.poll() is not None else ""

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
            "--log-level", "warning", *extra]  # fmt: skip


def fake_argv(tokenizer_dir: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tests.fake_runner", "--tokenizer", str(tokenizer_dir),
            "--port", str(port), *extra]  # fmt: skip


@pytest.fixture(scope="module")
def server(compiled_artifact: Path) -> Iterator[Server]:
    port = free_port()
    srv = Server(
        serve_argv(compiled_artifact, port, "--api-key", API_KEY, "--served-model-name", MODEL),
        port,
    )
    yield srv
    srv.stop()


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


def test_malformed_requests_get_openai_error_json(server: Server, client: openai.OpenAI) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL}, headers=headers)
    assert r.status_code == 422
    assert r.json()["error"]["param"] == "prompt"
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
        headers=headers,
    )
    assert r.status_code == 422 and "temperature" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers=headers)
    assert r.status_code == 422
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
    text = httpx.get(server.url + "/metrics").text
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert samples["neuronctl_slots_total"] == 4
    assert samples["neuronctl_time_to_first_token_seconds_count"] >= 1
    assert samples["neuronctl_time_per_output_token_seconds_count"] >= 2
    assert samples['neuronctl_requests_total{endpoint="/v1/completions",code="200"}'] >= 1
    assert samples["neuronctl_generation_tokens_total"] >= 3
    assert "# TYPE neuronctl_queue_depth gauge" in text


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
    port = free_port()
    srv = Server(fake_argv(tiny_llama, port, "--batch-size", "1", "--max-queue", "1"), port)
    yield srv
    srv.stop()


def test_full_queue_gets_429_not_a_hang(slow_server: Server) -> None:
    body = {"model": "fake", "prompt": "a", "max_tokens": 30, "ignore_eos": True, "stream": True}
    url = slow_server.url + "/v1/completions"
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", url, json=body) as running:  # takes the only slot
            lines = running.iter_lines()  # (dropping the iterator would close the stream)
            next(lines)
            with http.stream("POST", url, json=body) as queued:  # the one queue place
                time.sleep(0.2)
                assert httpx.get(slow_server.url + "/health").json()["waiting"] == 1
                started = time.monotonic()
                full = httpx.post(url, json={**body, "stream": False}, timeout=5)
                assert time.monotonic() - started < 2
                assert full.status_code == 429
                assert full.json()["error"]["type"] == "rate_limit_error"
                assert full.headers["retry-after"] == "1"
                assert '"finish_reason":"length"' in "".join(queued.iter_lines())


def test_a_client_that_goes_away_frees_its_slot(slow_server: Server) -> None:
    body = {"model": "fake", "prompt": "a", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", slow_server.url + "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        next(lines)
        assert httpx.get(slow_server.url + "/health").json()["running"] == 1
    deadline = time.monotonic() + 5  # 100 tokens would take 5 s; the abort takes one step
    while httpx.get(slow_server.url + "/health").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert time.monotonic() < deadline - 3


def test_sigterm_finishes_in_flight_requests_and_exits_0(tiny_llama: Path) -> None:
    port = free_port()
    srv = Server(fake_argv(tiny_llama, port, "--batch-size", "2", "--max-queue", "4"), port)
    body = {"model": "fake", "prompt": "a", "max_tokens": 20, "ignore_eos": True, "stream": True}
    chunks = []
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", srv.url + "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            chunks.append(next(lines))
            srv.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            with pytest.raises(httpx.TransportError):  # no longer accepting
                httpx.get(srv.url + "/health", timeout=2)
            chunks += list(lines)
    assert srv.proc.wait(30) == 0
    data = [c for c in chunks if c.startswith("data: {")]
    assert len(data) == 20  # every token arrived, the last with its finish reason
    assert '"finish_reason":"length"' in data[-1]
    assert [c for c in chunks if c][-1] == "data: [DONE]"
