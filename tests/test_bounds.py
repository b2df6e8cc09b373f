"""Bounds: no client, request, archive or remote takes more than its share. Each test here
is an attack that once got through: a hostile request that cost everyone else, a value that
ended in a 500, a variable that overflowed.

The server tests run the app in-process over tests/fake_runner.py (no compiled artifact).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
import zipfile
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from neuronctl.engine.engine import Engine
from neuronctl.engine.errors import QueueFullError
from neuronctl.engine.request import Request
from neuronctl.engine.sampling import SamplingParams, resolve_params
from neuronctl.engine.scheduler import Scheduler
from neuronctl.server.app import Limits, create_app
from neuronctl.server.guard import MAX_PACED_CLIENTS, MIN_REFUSAL_CHARGE, RefusalPacer
from neuronctl.server.protocol import (
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_PROMPTS,
    CompletionRequest,
)
from tests.fake_runner import EOS_ID, FakeRunner, FakeTextModel, byte_decoder
from tests.helpers import make_tokenizer
from tests.test_remote import trusted_env  # noqa: F401  (pulls trust the test publisher)

KEY = "sk-bounds"


@pytest.fixture(scope="module")
def text_model(tmp_path_factory: pytest.TempPathFactory) -> FakeTextModel:
    folder = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(folder)
    return FakeTextModel(str(folder))


def app_over(model: FakeTextModel, **kw: Any) -> Any:
    runner = FakeRunner(batch_size=kw.pop("batch_size", 2), seq_len=64)
    engine = Engine(runner, byte_decoder, eos_ids=[EOS_ID], max_queue=kw.pop("max_queue", 8))
    return engine.start(), create_app(engine, model, "fake", **kw)


def call(app: Any, method: str, path: str, body: Any = None, **headers: str) -> httpx.Response:
    """One request to the in-process app; a str body is sent as it is (NaN is not JSON)."""

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            content = body if isinstance(body, str) else json.dumps(body)
            head = {"content-type": "application/json", **headers}
            if body is None:
                return await client.request(method, path, headers=head)
            return await client.request(method, path, content=content, headers=head)

    return asyncio.run(go())


def refused(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return str(error["message"])


@pytest.fixture()
def app(text_model: FakeTextModel) -> Any:
    engine, app = app_over(text_model)
    yield app
    engine.stop(drain=False)


# -- logit_bias ---------------------------------------------------------------------------------


def test_logit_bias_is_capped_in_entries(app: Any) -> None:
    """450,865 keys in an 8 MB body took 212 s for 120 tokens and moved a bystander's median
    from 0.35 s to 15 s. vLLM's own per-request cap is 1024 (vllm-project/vllm,
    vllm/v1/worker/gpu/sample/logit_bias.py: MAX_NUM_LOGIT_BIAS_TOKENS = 1024)."""
    bias = {str(i): 1.0 for i in range(MAX_LOGIT_BIAS + 1)}
    body = {"prompt": "hi", "max_tokens": 2, "logit_bias": bias}
    assert "at most 1024" in refused(call(app, "POST", "/v1/completions", body), "logit_bias")
    # At the cap: 1024 keys, padded spellings of 256 token ids.
    body["logit_bias"] = {"0" * (i // 256) + str(i % 256): 1.0 for i in range(MAX_LOGIT_BIAS)}
    assert len(body["logit_bias"]) == MAX_LOGIT_BIAS
    assert call(app, "POST", "/v1/completions", body).status_code == 200


def test_logit_bias_keys_naming_one_token_are_one_entry() -> None:
    """ "12", " 12" and "0012" all name token 12: each was an entry, applied again at every
    step (the padding multiplied an 8 MB body's entries)."""
    request = CompletionRequest(prompt="hi", logit_bias={"12": 1.0, " 12": 2.0, "0012": 3.0})
    assert request.sampling(4).logit_bias == ((12, 3.0),)


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_logit_bias_is_a_400_naming_the_field(app: Any, value: str) -> None:
    """min(100.0, nan) is 100.0: a NaN bias was clamped into +100 and forced its token."""
    body = '{"prompt": "hi", "max_tokens": 2, "logit_bias": {"65": VALUE}}'.replace("VALUE", value)
    assert "finite" in refused(call(app, "POST", "/v1/completions", body), "logit_bias")


# -- prompts per request, and each request's share of the slots and the queue ------------------


def test_prompts_per_request_are_bounded(app: Any) -> None:
    """259 prompts in one 2.4 KB request filled all 256 waiting places."""
    body = {"prompt": ["a"] * (MAX_PROMPTS + 1), "max_tokens": 1}
    assert f"at most {MAX_PROMPTS}" in refused(call(app, "POST", "/v1/completions", body), "prompt")


def queued(client: str | None, group: object) -> Request:
    params = resolve_params(SamplingParams(temperature=0, max_tokens=2))
    return Request([1], params, 2, lambda _: None, byte_decoder(), client=client, group=group)


def test_a_later_request_gets_a_slot_beside_a_request_of_many_prompts() -> None:
    """Admission was first come, first served per sequence: a request of many prompts held
    every slot until its sequences were all done, and the next request waited behind all of
    them (a bystander's 0.35 s answer took 40 s). Now a free slot goes to the request holding
    the fewest, and one request never takes the last free slot while it holds another."""
    scheduler = Scheduler(batch_size=4, max_queue=64)
    many, one = object(), object()
    for _ in range(16):
        scheduler.add(queued("10.0.0.1", many))
    bystander = queued("10.0.0.2", one)
    scheduler.add(bystander)
    step = scheduler.schedule()
    assert bystander in step.prefill
    assert sum(r.group is many for r in step.prefill) == 2  # the fourth slot stays free


def test_one_request_leaves_the_last_slot_for_the_next() -> None:
    scheduler = Scheduler(batch_size=4, max_queue=64)
    many = object()
    for _ in range(8):
        scheduler.add(queued("10.0.0.1", many))
    assert len(scheduler.schedule().prefill) == 3
    late = queued("10.0.0.1", object())  # the same client, another request
    scheduler.add(late)
    assert scheduler.schedule().prefill == [late]


def test_one_client_holds_at_most_its_share_of_the_queue() -> None:
    """One client's requests take at most half the waiting places: the rest stay open to
    everyone else."""
    scheduler = Scheduler(batch_size=1, max_queue=8)
    for _ in range(1 + 4):  # the free slot, then its share of 8 places
        scheduler.add(queued("10.0.0.1", object()))
    with pytest.raises(QueueFullError, match="share"):
        scheduler.add(queued("10.0.0.1", object()))
    for _ in range(4):
        scheduler.add(queued("10.0.0.2", object()))


def test_a_client_of_many_requests_waits_behind_another_clients_first() -> None:
    """Slots went to the API request holding the fewest, so a client that sent many requests
    had one of them (holding none yet) ahead of a later client's first at every free slot:
    an attacker's connections shared the batch among themselves and a bystander waited for
    each. Now the client holding the fewest slots is served first."""
    scheduler = Scheduler(batch_size=4, max_queue=256)
    attacker = [object() for _ in range(20)]
    for group in attacker:  # 20 requests of 5 prompts each
        for _ in range(5):
            scheduler.add(queued("10.0.0.3", group))
    first = scheduler.schedule().prefill
    assert len(first) == 4 and all(r.client == "10.0.0.3" for r in first)
    bystander = queued("10.0.0.2", object())
    scheduler.add(bystander)
    scheduler.release(first[0])  # the next free slot
    assert scheduler.schedule().prefill == [bystander]


def requests_at_once(app: Any, sends: list[tuple[str, dict[str, Any]]]) -> list[httpx.Response]:
    """Send each (client address, completion body) at once; the answers in order."""

    async def go() -> list[httpx.Response]:
        async def one(host: str, body: dict[str, Any], delay: float) -> httpx.Response:
            await asyncio.sleep(delay)  # in order: the earlier ones are in flight first
            transport = httpx.ASGITransport(app=app, client=(host, 5000))
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                return await client.post("/v1/completions", json=body)

        return list(await asyncio.gather(*(
            one(host, body, 0.05 * i) for i, (host, body) in enumerate(sends)
        )))  # fmt: skip

    return asyncio.run(go())


def test_one_client_has_at_most_its_requests_in_flight(text_model: FakeTextModel) -> None:
    """One attacker on many connections had as many requests parsed, tokenized and queued
    at once: a bystander's answers took 4-20x as long. Past its limit a client gets a 429
    that names the limit, with Retry-After, before its body is read (and the connection
    closes, so the rest of the body is never read); another client is still served."""
    runner = FakeRunner(batch_size=2, seq_len=64, step_delay=0.02)
    engine = Engine(runner, byte_decoder, eos_ids=[EOS_ID], max_queue=8).start()
    app = create_app(engine, text_model, "fake", limits=Limits(max_client_requests=2))
    slow = {"prompt": "hi", "max_tokens": 20, "ignore_eos": True}
    quick = {"prompt": "hi", "max_tokens": 1}
    try:
        answers = requests_at_once(
            app, [("10.0.0.3", slow), ("10.0.0.3", slow), ("10.0.0.3", quick), ("10.0.0.2", quick)]
        )
    finally:
        engine.stop(drain=False)
    assert [a.status_code for a in answers] == [200, 200, 429, 200], [a.text for a in answers]
    refusal = answers[2]
    assert refusal.headers["retry-after"] == "1" and refusal.headers["connection"] == "close"
    error = refusal.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "too_many_requests"
    assert "2 requests in flight" in error["message"]


def test_refusal_debt_leaks_at_the_share_and_is_per_client() -> None:
    """The pacer's arithmetic on a stepped clock: within the burst a client's next request
    waits until its last refusals are `peak` of the time (here a quarter: three times as long
    as they took; answered back to back, a burst took the server's core from the engine: decode
    steps of 0.6 ms took 5-6 ms); past the burst it waits until its debt has leaked back to
    the burst; another client never waits on it; the table, once full, forgets clients whose
    debt is gone, then the longest unrefused."""
    now = [0.0]
    pacer = RefusalPacer(share=0.1, burst=1.0, clock=lambda: now[0], peak=0.25)
    pacer.charge("a", 0.3)
    pacer.charge("a", 0.2)  # two at once: the pauses add up
    assert pacer.wait("a") == pytest.approx(1.5)
    now[0] = 1.5
    assert pacer.wait("a") == 0
    pacer.charge("a", 0.4)  # 0.35 left of the 0.5, leaking 0.1 a second
    now[0] = 2.7
    assert pacer.wait("a") == 0
    pacer.charge("a", 0.6)  # 1.23 owed: past the burst
    assert pacer.wait("a") == pytest.approx(2.3) and pacer.wait("b") == 0
    now[0] = 3.0
    assert pacer.wait("a") == pytest.approx(2.0)
    now[0] = 5.0
    assert pacer.wait("a") == pytest.approx(0.0, abs=1e-9)
    now[0] = 100.0
    for i in range(MAX_PACED_CLIENTS):
        pacer.charge(f"10.1.{i // 256}.{i % 256}", 0.0)
    pacer.charge("b", 0.5)
    assert len(pacer.debts) <= 2 and "a" not in pacer.debts and pacer.debt("b") == 0.5
    for i in range(2 * MAX_PACED_CLIENTS):  # all owing: the latest half is kept
        pacer.charge(f"10.2.{i // 256}.{i % 256}", 1.0)
    assert len(pacer.debts) <= MAX_PACED_CLIENTS and "10.2.31.255" in pacer.debts


def test_a_paced_clients_requests_go_one_at_a_time() -> None:
    """Past its share a client's waiting requests ran together once its debt had leaked, 4
    at a time on 4 connections. A paced client's requests now take turns; a client within
    its share runs its requests together; the gates of no waiting request are forgotten."""
    pacer = RefusalPacer(share=1.0, burst=0.0)
    running = {"now": 0, "most": 0}

    async def request(client: str) -> None:
        async with pacer.turn(client):
            running["now"] += 1
            running["most"] = max(running["most"], running["now"])
            await asyncio.sleep(0.01)
            running["now"] -= 1
            pacer.charge(client, 0.01)

    async def go(client: str) -> int:
        running["most"] = 0
        await asyncio.gather(*(request(client) for _ in range(4)))
        return running["most"]

    assert asyncio.run(go("honest")) == 4
    pacer.charge("flood", 0.05)
    assert asyncio.run(go("flood")) == 1
    assert pacer.gates == {}


def test_a_client_whose_requests_are_refused_waits_and_no_one_else_does(
    text_model: FakeTextModel,
) -> None:
    """One client repeating a request the server refuses (259 prompts, 450,000 logit_bias
    keys, 180,000 messages: each read and checked, then a 400) had the event loop answer it
    2,000 times a second, on the core the engine shares (bench/hostile.py). A client's
    refusals are charged their time, at least MIN_REFUSAL_CHARGE each: past its burst its
    next request waits, unread, until its share is back, while another client's is answered
    at once; a 200 charges nothing."""
    engine, app = app_over(text_model, limits=Limits(refusal_share=0.01, refusal_burst=0.01))
    bad, good = {"prompt": "hi", "max_tokens": -1}, {"prompt": "hi", "max_tokens": 1}
    try:
        first = requests_at_once(app, [("10.0.0.3", bad), ("10.0.0.2", good)])
        assert [a.status_code for a in first] == [400, 200]
        pacer = app.state.pacer
        # at least the floor each refusal is charged, less what leaked since
        assert pacer.debt("10.0.0.3") > MIN_REFUSAL_CHARGE / 2 and pacer.debt("10.0.0.2") == 0
        # 2 s past the burst: a bystander answered within 1 s did not wait on it, with room
        # for the stalls a loaded CI host gives any request (0.86 s was seen at 0.5 s past)
        pacer.charge("10.0.0.3", 0.03 - pacer.debt("10.0.0.3"))
        started = time.monotonic()
        timed = requests_at_once(app, [("10.0.0.3", good), ("10.0.0.2", good)])
        took = time.monotonic() - started
    finally:
        engine.stop(drain=False)
    assert [a.status_code for a in timed] == [200, 200]
    assert 1.9 < took, f"the refused client was not paced ({took:.3f} s)"
    assert timed[1].elapsed.total_seconds() < 1.0, "the bystander waited on the other client"


def test_a_refusal_is_charged_the_servers_time_not_the_clients_upload(
    text_model: FakeTextModel,
) -> None:
    """A refusal was charged its time from the guard to the answer, the wait for a slowly
    sent body included: a client on a slow link whose 2 s upload was refused then waited
    (2 - 0.25) / 0.02 = 90 s for its next request. The time spent waiting for the body is
    not charged; a body that takes 0.9 s to arrive, in three pieces, and is refused owes a
    few milliseconds."""
    engine, app = app_over(text_model)

    async def slowly() -> AsyncIterator[bytes]:
        for piece in (b'{"prompt": "hi", ', b'"max_tokens": ', b"-1}"):
            yield piece
            await asyncio.sleep(0.3)

    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, client=("10.0.0.5", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/v1/completions", content=slowly(),
                                     headers={"content-type": "application/json"})  # fmt: skip

    try:
        answer = asyncio.run(send())
    finally:
        engine.stop(drain=False)
    assert answer.status_code == 400, answer.text
    assert app.state.pacer.debt("10.0.0.5") < 0.1, "the upload's wait was charged"


class CountingModel(FakeTextModel):
    """Counts how many chat templates render at once, per client."""

    def __init__(self, tokenizer_dir: str) -> None:
        super().__init__(tokenizer_dir)
        self.lock = threading.Lock()
        self.now = self.most = 0

    def encode_chat(self, messages: list[dict[str, Any]], **options: Any) -> list[int]:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        time.sleep(0.05)  # a long template
        with self.lock:
            self.now -= 1
        return super().encode_chat(messages, **options)


def test_one_clients_templates_render_one_at_a_time(tmp_path: Path) -> None:
    """Templating and tokenizing hold the GIL; one client's many chat requests rendered as
    many templates at once in the worker threads and took the CPU from the engine and
    everyone else. A client's render one at a time; other clients' beside them."""
    make_tokenizer(tmp_path)
    model = CountingModel(str(tmp_path))
    engine = Engine(FakeRunner(batch_size=4, seq_len=64), byte_decoder, eos_ids=[EOS_ID],
                    max_queue=16).start()  # fmt: skip
    app = create_app(engine, model, "fake")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

    async def go(hosts: list[str]) -> list[int]:
        async def one(host: str) -> int:
            transport = httpx.ASGITransport(app=app, client=(host, 5000))
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                return (await client.post("/v1/chat/completions", json=body)).status_code

        return list(await asyncio.gather(*(one(h) for h in hosts)))

    try:
        assert asyncio.run(go(["10.0.0.3"] * 4)) == [200] * 4
        assert model.most == 1
        assert asyncio.run(go(["10.0.0.3", "10.0.0.2"])) == [200] * 2
        assert model.most == 2
    finally:
        engine.stop(drain=False)


# -- chat messages ------------------------------------------------------------------------------


def test_chat_messages_are_bounded_in_count_before_templating(app: Any) -> None:
    """180,000 empty messages (5 MB) cost ~8 s of template and tokenizer time before the 400."""
    body = {"messages": [{"role": "user", "content": ""}] * (MAX_MESSAGES + 1), "max_tokens": 1}
    refused(call(app, "POST", "/v1/chat/completions", body), "messages")
    refused(call(app, "POST", "/tokenize", {"messages": body["messages"]}), "messages")


def test_empty_messages_count_against_the_character_limit(text_model: FakeTextModel) -> None:
    """The character check counted content only, so empty messages were free to template."""
    engine, app = app_over(text_model, limits=Limits(max_prompt_chars=100))
    try:
        body = {"messages": [{"role": "user", "content": ""}] * 10, "max_tokens": 1}
        assert "characters" in refused(call(app, "POST", "/v1/chat/completions", body), "messages")
        tokenize = {"messages": body["messages"]}
        assert "characters" in refused(call(app, "POST", "/tokenize", tokenize), "messages")
    finally:
        engine.stop(drain=False)


# -- 500s that are the client's mistake ---------------------------------------------------------


@pytest.mark.parametrize("token", [-5, 2**64, 10**6])
def test_detokenize_of_an_id_outside_the_vocabulary_is_a_400(app: Any, token: int) -> None:
    """The tokenizer raised OverflowError (or returned nothing) for them: a plain-text 500."""
    response = call(app, "POST", "/detokenize", {"tokens": [65, token]})
    assert "tokens[1]" in refused(response, "tokens")
    assert call(app, "POST", "/detokenize", {"tokens": [39, 72]}).json() == {"prompt": "Hi"}


@pytest.mark.parametrize("value", [1e-300, 0.001, 1e300])
def test_an_extreme_repetition_penalty_is_a_400(app: Any, value: float) -> None:
    """1e-300 divided each logit into inf: "probability tensor contains inf/nan", a 500."""
    body = {"prompt": "hi", "max_tokens": 2, "repetition_penalty": value}
    refused(call(app, "POST", "/v1/completions", body), "repetition_penalty")
    body["repetition_penalty"] = 1.2
    assert call(app, "POST", "/v1/completions", body).status_code == 200


# -- the API's description ----------------------------------------------------------------------


def test_docs_and_schema_take_the_api_key_when_one_is_set(text_model: FakeTextModel) -> None:
    engine, app = app_over(text_model, api_key=KEY)
    try:
        for path in ("/docs", "/openapi.json"):
            assert call(app, "GET", path).status_code == 401
            auth = {"authorization": f"Bearer {KEY}"}
            assert call(app, "GET", path, **auth).status_code == 200
        assert call(app, "GET", "/health").status_code == 200  # probes stay open
    finally:
        engine.stop(drain=False)


# -- environment timeouts -----------------------------------------------------------------------


@pytest.mark.parametrize("text", ["1e308", "9e18", "604801"])
def test_a_timeout_variable_past_a_week_is_a_usage_error(monkeypatch: Any, text: str) -> None:
    """1e308 or 9e18 passed the check and died in an OverflowError inside the wait (for the
    graph timeout, after the compiles ended)."""
    from neuronctl.backends.torch import graphs, kernel
    from neuronctl.errors import UsageError

    for name, read in ((kernel.BUILD_TIMEOUT_ENV, kernel.build_timeout),
                       (graphs.GRAPH_TIMEOUT_ENV, graphs.graph_timeout)):  # fmt: skip
        monkeypatch.setenv(name, text)
        with pytest.raises(UsageError, match="a week"):
            read()
        monkeypatch.setenv(name, "604800")
        assert read() == 604800.0


# -- a graph archive read one way by the scan and another by torch ------------------------------


class _Touch:
    """Unpickling this creates a file: the stand-in for any command an attacker runs."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))


def stored_zip(members: list[tuple[str, bytes]], zip64_end_at: int) -> bytes:
    """A plain stored zip of `members`, its zip64 end record placed at `zip64_end_at` and no
    end record after it: what miniz finds when an end record later in the file points there."""
    out, central = bytearray(), bytearray()
    for name, data in members:
        raw, crc, offset = name.encode(), zlib.crc32(data), len(out)
        out += struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0, crc, len(data),
                           len(data), len(raw), 0) + raw + data  # fmt: skip
        central += struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 0, 0, 0, crc, len(data),
                               len(data), len(raw), 0, 0, 0, 0, 0, offset) + raw  # fmt: skip
    cd_at = len(out)
    out += central
    out += bytes(zip64_end_at - len(out))
    out += struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, len(members), len(members),
                       len(central), cd_at)  # fmt: skip
    return bytes(out)


def two_faced_graph(folder: Path, marker: Path) -> Path:
    """A malicious zip followed by a benign export graph, as torch writes it. Python's
    zipfile finds the benign graph's end record and, seeing data before it, shifts every
    offset by it: the benign members. miniz (torch's reader) takes the zip64 locator's offset
    as written, which lands on the malicious zip's own zip64 end record: its members, whose
    sample inputs torch.export.load unpickles with weights_only=False on fallback."""
    import torch

    class AddOne(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    program = torch.export.export(AddOne(), (torch.ones(2),))
    program.example_inputs = None  # as neuronctl saves its graphs: nothing pickled
    benign_file = folder / "benign.pt2"
    torch.export.save(program, str(benign_file))
    benign = benign_file.read_bytes()
    locator = benign[-22 - 20 : -22]
    assert locator[:4] == b"PK\x06\x07", "torch writes a zip64 locator"
    payload = pickle.dumps(_Touch(str(marker)), protocol=2)
    with zipfile.ZipFile(benign_file) as archive:
        members = [
            (info.filename, payload if info.filename.endswith("model.pt") else archive.read(info))
            for info in archive.infolist()
        ]
    hostile = folder / "graph.pt2"
    hostile.write_bytes(stored_zip(members, struct.unpack("<Q", locator[8:16])[0]) + benign)
    return hostile


def test_a_graph_that_zipfile_and_torch_read_differently_is_refused(tmp_path: Path) -> None:
    """`validate --deep` said "no graph carries code" of such a file and generate
    --allow-unsigned then unpickled it. The scan now refuses any layout but the one both
    readers read alike."""
    import torch

    from neuronctl.backends.torch.safeload import UnsafeGraphError, check_export_graph

    marker = tmp_path / "pwned"
    graph = two_faced_graph(tmp_path, marker)
    with zipfile.ZipFile(graph) as archive:  # what the scan used to judge: benign
        assert archive.getinfo("benign/data/sample_inputs/model.pt").file_size == 0
    reader = torch._C.PyTorchFileReader(str(graph))  # what torch loads: the payload
    assert reader.get_record("data/sample_inputs/model.pt").startswith(b"\x80\x02")
    check_export_graph(tmp_path / "benign.pt2")  # torch's own layout passes
    with pytest.raises(UnsafeGraphError, match="bytes before its first member"):
        check_export_graph(graph)
    assert not marker.exists()
    try:
        torch.export.load(str(graph))  # without the scan: the payload runs
    except Exception:
        pass
    assert marker.exists()


@pytest.mark.parametrize("damage", ["trailing", "gap"])
def test_archive_layouts_torch_never_writes_are_refused(tmp_path: Path, damage: str) -> None:
    """Bytes after the end record and a gap between members: Python's zipfile reads past
    both, and either leaves room for a second archive another reader may find. (Two entries
    on one local header, or a local name unlike the central directory's, zipfile refuses by
    itself; the layout check refuses them too.)"""
    from neuronctl.backends.torch.safeload import UnsafeGraphError, check_export_graph

    members = [("g/a.json", b"{}"), ("g/b.json", b"[]")]
    plain = io.BytesIO()
    with zipfile.ZipFile(plain, "w") as archive:
        for name, body in members:
            archive.writestr(name, body)
    data = bytearray(plain.getvalue())
    if damage == "trailing":
        data += b"x"
    else:  # 4 bytes between the members, offsets moved past them
        second = data.index(b"PK\x03\x04", 4)
        data[second:second] = b"\0" * 4
        at = data.rindex(b"PK\x01\x02")
        data[at + 42 : at + 46] = struct.pack("<L", second + 4)
        end = data.rindex(b"PK\x05\x06")
        cd_at = struct.unpack("<L", data[end + 16 : end + 20])[0]
        data[end + 16 : end + 20] = struct.pack("<L", cd_at + 4)
    graph = tmp_path / "graph.pt2"
    graph.write_bytes(bytes(data))
    with pytest.raises(UnsafeGraphError):
        check_export_graph(graph)


# -- a FIFO in place of a graph, and a step that never ends -------------------------------------


def within(seconds: float, call: Any) -> Any:
    """call() in a daemon thread: a hang fails the test instead of blocking the suite."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(call())
        except BaseException as exc:  # handed back to the test
            box.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert box, f"still blocked after {seconds} s"
    return box[0]


def test_a_fifo_in_place_of_a_graph_is_refused_without_waiting(tmp_path: Path) -> None:
    """Opening a FIFO waits for a writer: the engine thread's first use of the graph hung,
    and with it every request. Graphs and the kernel are read through runner._copy_code
    (the verified copy), the only way the runner opens an artifact's code."""
    from neuronctl.backends.torch.runner import _copy_code
    from neuronctl.store.files import NotRegularFileError
    from neuronctl.store.manifest import FileEntry

    fifo = tmp_path / "graph.pt2"
    os.mkfifo(fifo)
    files = {"graph.pt2": FileEntry(size=0, sha256="0" * 64)}
    error = within(10, lambda: _copy_code(tmp_path, "graph.pt2", files))
    assert isinstance(error, NotRegularFileError) and "a FIFO" in str(error)


class StuckRunner(FakeRunner):
    """Its decode never returns until released: a read that blocks for good."""

    def __init__(self) -> None:
        super().__init__(batch_size=1)
        self.release = threading.Event()

    def decode(self, token_ids: Any, positions: Any) -> Any:
        self.release.wait()
        return super().decode(token_ids, positions)


def test_a_stuck_step_turns_health_503_and_fails_what_it_held(text_model: FakeTextModel) -> None:
    """/health said ok while a step could not finish, and every request hung."""
    runner = StuckRunner()
    engine = Engine(runner, byte_decoder, eos_ids=[EOS_ID], stall_seconds=0.5).start()
    app = create_app(engine, text_model, "fake")
    try:
        handle = engine.submit([1, 2], SamplingParams(temperature=0, max_tokens=4))
        assert call(app, "GET", "/health").status_code == 200
        time.sleep(1.0)
        health = call(app, "GET", "/health")
        assert health.status_code == 503 and "without finishing" in health.json()["error"]
        out = within(5, handle.result)
        assert out.finish_reason == "error"
        body = {"prompt": "hi", "max_tokens": 1}
        assert call(app, "POST", "/v1/completions", body).status_code == 503
    finally:
        runner.release.set()


STUCK_AT_EXIT = """
import threading, time
from neuronctl.engine import engine as engine_module
from neuronctl.engine.engine import Engine
from neuronctl.engine.sampling import SamplingParams
from tests.fake_runner import EOS_ID, FakeRunner, byte_decoder

engine_module.EXIT_JOIN_SECONDS = 1.0

class Stuck(FakeRunner):
    def decode(self, token_ids, positions):
        threading.Event().wait()

engine = Engine(Stuck(batch_size=1), byte_decoder, eos_ids=[EOS_ID]).start()
engine.submit([1, 2], SamplingParams(temperature=0, max_tokens=4))
time.sleep(0.5)
print("exiting", flush=True)
"""


def test_exit_proceeds_past_an_engine_stuck_in_a_step() -> None:
    """The exit hook joined the stuck engine thread with no timeout: after SIGTERM the
    process lived on until SIGKILL."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-c", STUCK_AT_EXIT], env=env, cwd=root,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert "exiting" in proc.stdout
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "stuck in a step" in proc.stderr


# -- manifest.json: read capped, nesting checked ------------------------------------------------


def test_validate_reads_a_huge_sparse_manifest_capped(tmp_path: Path) -> None:
    """A 6 GB sparse manifest.json cost validate (and the reuse check before every generate
    and serve) 12.6 GB of memory: it was read whole."""
    from neuronctl.store.manifest import MAX_MANIFEST_BYTES
    from neuronctl.validate import check_artifact

    artifact = tmp_path / "artifact"
    artifact.mkdir()
    with open(artifact / "manifest.json", "wb") as out:
        out.truncate(MAX_MANIFEST_BYTES * 4)  # sparse: no disk, a whole read costs 256 MB
    check, manifest = check_artifact(artifact)
    assert not check.ok and manifest is None
    assert "limit" in check.reason, check.reason


@pytest.mark.parametrize("opener", ["[", '{"a":'])
def test_a_deeply_nested_manifest_is_a_clear_error(tmp_path: Path, opener: str) -> None:
    """Nested 100,000 deep it was an internal RecursionError."""
    from neuronctl.errors import NotFoundError
    from neuronctl.store.manifest import read_manifest
    from neuronctl.validate import check_artifact

    artifact = tmp_path / "artifact"
    artifact.mkdir()
    closer = "]" if opener == "[" else "}"
    (artifact / "manifest.json").write_text(opener * 100_000 + "1" + closer * 100_000)
    check, _ = check_artifact(artifact)
    assert not check.ok and "nests deeper" in check.reason, check.reason
    with pytest.raises(NotFoundError, match="nests deeper"):
        read_manifest(artifact)


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    from neuronctl.store.manifest import json_depth_problem

    assert json_depth_problem(b'{"a": "[[[[[[[[[[\\"[[[[", "b": [[1]]}', limit=3) is None
    assert json_depth_problem(b'{"a": [[[1]]]}', limit=3) is not None


# -- pulls: a remote that stalls, drips or breaks off mid-object ------------------------------


class _Remote:
    """What a pull reads from, handed out by Transport.open_object: the real object until
    `after` bytes, then a read that `behave` decides (block for good, or raise)."""

    def __init__(self, real: Any, after: int, behave: Any) -> None:
        self.real, self.left, self.behave = real, after, behave

    def read(self, n: int = -1) -> bytes:
        if self.left <= 0:
            return self.behave()  # type: ignore[no-any-return]
        data = self.real.read(min(n, self.left))
        self.left -= len(data)
        return data  # type: ignore[no-any-return]

    def __enter__(self) -> _Remote:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.real.close()


def remote_that(monkeypatch: Any, behave: Any) -> None:
    from neuronctl.store.remote.transport import Transport

    real_open = Transport.open_object

    def open_object(self: Any, dirname: str, rel: str) -> _Remote:
        return _Remote(real_open(self, dirname, rel), 1000, behave)

    monkeypatch.setattr(Transport, "open_object", open_object)


def test_a_pull_from_a_remote_that_stalls_fails_and_frees_the_key(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """A remote dripping a byte every 8 s never tripped the read timeout: the pull sat at
    73 % for 10 minutes holding the key's lock."""
    from neuronctl.store.local import Store
    from neuronctl.store.remote import pull
    from neuronctl.store.remote.client import open_remote
    from neuronctl.store.remote.errors import RemoteUnreachableError
    from tests.test_remote import _pushed_to_mount

    artifact, _ = _pushed_to_mount(tmp_path)
    monkeypatch.setattr(pull, "READ_STALL_SECONDS", 0.5)
    never = threading.Event()
    remote_that(monkeypatch, lambda: never.wait() or b"")
    store = Store(tmp_path / "b")
    error = within(30, lambda: open_remote(str(tmp_path / "mount")).pull(artifact.name, store))
    assert isinstance(error, RemoteUnreachableError), error
    assert "stalled" in str(error) and "1000 of" in str(error)
    lock = store.lock(artifact.name)
    lock.acquire(timeout=0)  # the key is free again
    lock.release()
    never.set()


def test_a_transfer_that_breaks_off_mid_object_is_a_clear_error(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """An S3 stall mid-object ended in "internal error: IndexError"."""
    from neuronctl.store.local import Store
    from neuronctl.store.remote.client import open_remote
    from neuronctl.store.remote.errors import RemoteUnreachableError
    from tests.test_remote import _pushed_to_mount

    artifact, _ = _pushed_to_mount(tmp_path)

    def broken() -> bytes:
        raise IndexError("list index out of range")

    remote_that(monkeypatch, broken)
    with pytest.raises(RemoteUnreachableError, match="broke off at 1000 of .*IndexError"):
        open_remote(str(tmp_path / "mount")).pull(artifact.name, Store(tmp_path / "b"))


def test_a_second_pull_of_a_key_says_it_waits_for_the_first(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The second pull of a key waited silently behind the first."""
    from neuronctl.store.local import Store
    from neuronctl.store.remote.client import open_remote
    from tests.test_remote import _pushed_to_mount

    artifact, _ = _pushed_to_mount(tmp_path)
    store = Store(tmp_path / "b")
    lock = store.lock(artifact.name)
    lock.acquire()  # the first pull, in another process as far as the second can tell
    with caplog.at_level("WARNING", logger="neuronctl.store.local"):
        thread = threading.Thread(
            target=lambda: open_remote(str(tmp_path / "mount")).pull(artifact.name, store),
            daemon=True,
        )
        thread.start()
        deadline = time.monotonic() + 20
        while "waiting for another" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        lock.release()
        thread.join(30)
    assert "waiting for another neuronctl process" in caplog.text
    assert not thread.is_alive()


def test_a_checksum_failure_hints_at_corruption_in_transit_not_the_url() -> None:
    """botocore's FlexibleChecksumError (a flipped byte caught by the S3 client) got the
    hint "check the URL, the network and the credentials"."""
    from botocore.exceptions import FlexibleChecksumError

    from neuronctl.store.remote.errors import unreachable

    exc = FlexibleChecksumError(error_msg="Expected checksum abc did not match calculated def")
    error = unreachable("s3://bucket/neuron", exc)
    assert error is not None and "corrupted in transit" in (error.hint or "")
    assert "URL" not in (error.hint or "")


# -- compile beside a server ------------------------------------------------------------------


def test_a_rebuild_never_replaces_an_artifact_a_server_holds(tmp_path: Path) -> None:
    """`compile` of a key whose artifact was not intact replaced it while a server held its
    lease (the server's mapped weights and graphs went to the trash under it)."""
    from neuronctl.errors import NeuronctlError
    from neuronctl.store.lease import hold
    from neuronctl.store.local import Store
    from neuronctl.store.manifest import is_intact
    from tests.test_remote import make_artifact

    artifact = make_artifact(tmp_path / "store", {"weights/w.bin": b"w" * 100})
    store = Store(tmp_path / "store")
    (artifact / "weights" / "w.bin").write_bytes(b"x" * 10)  # no longer intact
    built = []

    def build(staging: Path) -> Any:
        built.append(staging)
        raise AssertionError("never built: it could not be published")

    lease = hold(artifact)
    try:
        with pytest.raises(NeuronctlError, match="holds it: refusing to replace"):
            store.publish(artifact.name, build, reuse=is_intact)
        assert not built
        assert (artifact / "weights" / "w.bin").read_bytes() == b"x" * 10  # left as it was
    finally:
        lease.release()
    rebuilt = []

    def rebuild(staging: Path) -> Any:
        rebuilt.append(staging)
        (staging / "weights").mkdir()
        (staging / "weights" / "w.bin").write_bytes(b"w" * 100)
        from neuronctl.store.manifest import read_manifest

        return read_manifest(artifact).model_copy(update={"files": {}})

    store.publish(artifact.name, rebuild, reuse=is_intact)  # nobody holds it now
    assert rebuilt and (artifact / "weights" / "w.bin").read_bytes() == b"w" * 100


def test_a_body_of_a_flood_of_keys_is_refused_before_it_is_parsed(app: Any) -> None:
    """450,000 logit_bias keys in 6.6 MB cost 0.9 s of json.loads each on the event loop
    every request shares, before the logit_bias cap could refuse them: two senders starved
    a bystander. The guard counts keys in the raw bytes as they arrive (without a regular
    expression, which took 4-8 ms per 400 KB), whitespace before the colon included."""
    from neuronctl.server.guard import MAX_JSON_KEYS

    flood = {"prompt": "hi", "logit_bias": {str(i): 1.0 for i in range(MAX_JSON_KEYS)}}
    response = call(app, "POST", "/v1/completions", flood)
    assert response.status_code == 400 and response.json()["error"]["code"] == "too_many_keys"
    spaces = [" ", "\t", "\r\n", " \n\t "]  # all the whitespace JSON allows before a colon
    entries = ", ".join(f'"{i}"{spaces[i % 4]}: 1' for i in range(MAX_JSON_KEYS))
    spaced = '{"prompt": "hi", "logit_bias": {' + entries + "}}"
    response = call(app, "POST", "/v1/completions", spaced)
    assert response.json()["error"]["code"] == "too_many_keys"
    messages = {"messages": [{"role": "user", "content": ""}] * 180_000}
    response = call(app, "POST", "/v1/chat/completions", messages)
    assert response.json()["error"]["code"] == "too_many_keys"
