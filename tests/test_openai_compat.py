"""The request schema, fields, endpoints and metric names a vLLM user relies on, through the
official openai client against `tests.fake_runner`'s server (fast: no compiled model).

Shapes follow vLLM's own source (vllm-project/vllm): vllm/entrypoints/openai/protocol.py
(CompletionLogProbs: text_offset, token_logprobs, tokens, top_logprobs;
TokenizeCompletionRequest / TokenizeChatRequest / TokenizeResponse: count, max_model_len,
tokens, token_strs; DetokenizeRequest: tokens -> prompt), and vllm/v1/metrics/loggers.py
(PrometheusStatLogger: labels model_name and engine, vllm:num_requests_running,
vllm:num_requests_waiting, vllm:prompt_tokens, vllm:generation_tokens, vllm:request_success with
finished_reason, vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
vllm:e2e_request_latency_seconds, ...).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from neuronctl.server.protocol import (
    NO_EFFECT,
    UNSUPPORTED,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tests.fake_runner import FakeRunner
from tests.helpers import wait_until
from tests.test_server import Server, fake_argv, free_port

FAKE = FakeRunner()  # its logits are a pure function of the history: the reference


PROMPT_CHARS = 64  # the module server's prompt limit: above every prompt its tests send


@pytest.fixture(scope="module")
def fake_server(tiny_llama: Path) -> Iterator[Server]:
    port = free_port()
    argv = fake_argv(
        tiny_llama,
        port,
        "--batch-size",
        "4",
        "--max-queue",
        "64",
        "--step-delay",
        "0",
        "--log-level",
        "info",
        "--max-prompt-chars",
        str(PROMPT_CHARS),
    )
    srv = Server(argv, port)
    yield srv
    srv.stop()


@pytest.fixture
def client(fake_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=fake_server.url + "/v1", api_key="none", max_retries=0)


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


def reference(history: list[int]) -> torch.Tensor:
    return torch.log_softmax(FAKE.logits_for(history), -1)


PROMPT = "abc"  # byte tokens, BOS first: ids below the fake vocabulary


def completion(**fields: Any) -> dict[str, Any]:
    """A completions request to the fake model on PROMPT that runs to max_tokens (EOS
    ignored), with `fields`."""
    return {"model": "fake", "prompt": PROMPT, "extra_body": {"ignore_eos": True}, **fields}


# -- the schema ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field",
    [
        "temperature",
        "top_p",
        "n",
        "stream",
        "echo",
        "logprobs",
        "stop",
        "seed",
        "max_tokens",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "best_of",
        "min_p",
        "min_tokens",
        "repetition_penalty",
        "top_k",
        "model",
        "user",
    ],
)
def test_null_is_the_default_for_every_optional_completion_field(
    fake_server: Server, field: str
) -> None:
    base = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    r = post(fake_server, "/v1/completions", {**base, field: None})
    assert r.status_code == 200, r.text
    if field not in ("max_tokens", "temperature"):  # their defaults are 16 and 1
        assert (
            r.json()["choices"][0]["text"]
            == post(fake_server, "/v1/completions", base).json()["choices"][0]["text"]
        )


@pytest.mark.parametrize(
    "field",
    [
        "temperature",
        "top_p",
        "n",
        "stream",
        "logprobs",
        "top_logprobs",
        "max_tokens",
        "max_completion_tokens",
        "stream_options",
        "response_format",
        "tools",
        "seed",
    ],
)
def test_null_is_the_default_for_every_optional_chat_field(fake_server: Server, field: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: None}
    if field in ("max_tokens", "max_completion_tokens"):
        body["max_completion_tokens" if field == "max_tokens" else "max_tokens"] = 2
    r = post(fake_server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "body, param",
    [
        ({"stream": "yes"}, "stream"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": "0.5"}, "temperature"),
        ({"echo": 1}, "echo"),
        ({"n": 1.5}, "n"),
        ({"logprobs": True}, "logprobs"),  # completions take a count, not a flag
        ({"prompt": None}, "prompt"),
    ],
)
def test_mistyped_fields_are_400_with_an_openai_error_body(
    fake_server: Server, body: dict[str, Any], param: str
) -> None:
    r = post(fake_server, "/v1/completions", {"prompt": PROMPT, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_malformed_json_is_400(fake_server: Server) -> None:
    r = httpx.post(fake_server.url + "/v1/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_model_is_optional_and_another_name_is_404(fake_server: Server) -> None:
    assert (
        post(fake_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1}).status_code == 200
    )
    r = post(fake_server, "/v1/completions", {"model": "x", "prompt": PROMPT, "max_tokens": 1})
    assert r.status_code == 404


def test_a_user_message_without_content_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="no content") as exc:
        client.chat.completions.create(model="fake", messages=[{"role": "user"}], max_tokens=2)  # type: ignore[typeddict-item]
    assert exc.value.body["param"] == "messages.0.content"  # type: ignore[index]


@pytest.mark.parametrize(
    "field, value",
    [
        ("response_format", {"type": "json_object"}),
        ("suffix", "x"),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ],
)
def test_what_is_not_implemented_stays_refused_by_name(
    client: openai.OpenAI, field: str, value: Any
) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(
            model="fake", prompt=PROMPT, max_tokens=2, extra_body={field: value}
        )
    assert exc.value.body["param"] == field  # type: ignore[index]


# -- logprobs ------------------------------------------------------------------------------


def prompt_ids(server: Server, text: str = PROMPT) -> list[int]:
    return list(post(server, "/tokenize", {"prompt": text}).json()["tokens"])


def test_completion_logprobs_match_log_softmax_of_the_logits(
    client: openai.OpenAI, fake_server: Server
) -> None:
    out = client.completions.create(
        model="fake",
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = out.choices[0]
    ids, history = choice.model_extra["token_ids"], prompt_ids(fake_server)  # type: ignore[index]
    lp = choice.logprobs
    assert lp is not None and len(lp.token_logprobs) == 4  # type: ignore[arg-type]
    for j, token in enumerate(ids):
        ref = reference(history + ids[:j])
        assert lp.token_logprobs[j] == pytest.approx(ref[token].item(), abs=1e-5)  # type: ignore[index]
        top = lp.top_logprobs[j]  # type: ignore[index]
        # keyed by token text (bytes that are no character share one key, as in vLLM)
        assert max(top.values()) == pytest.approx(ref.max().item(), abs=1e-5)
        allowed = [*torch.topk(ref, 3).values.tolist(), ref[token].item()]
        assert all(min(abs(v - a) for a in allowed) < 1e-5 for v in top.values())
    assert lp.text_offset == [0, *[sum(len(t) for t in lp.tokens[:j]) for j in range(1, 4)]]  # type: ignore[index]


def test_echo_returns_prompt_logprobs_with_max_tokens_0_and_1(
    client: openai.OpenAI, fake_server: Server
) -> None:
    """lm-eval's loglikelihood request: echo, logprobs 1, max_tokens 1, temperature 0."""
    history = prompt_ids(fake_server)
    for max_tokens in (0, 1):
        out = client.completions.create(
            model="fake", prompt=PROMPT, max_tokens=max_tokens, temperature=0, logprobs=1, echo=True
        )
        lp = out.choices[0].logprobs
        assert lp is not None and lp.token_logprobs is not None
        assert len(lp.token_logprobs) == len(history) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # type: ignore[index]
        for i in range(1, len(history)):
            ref = reference(history[:i])
            assert lp.token_logprobs[i] == pytest.approx(ref[history[i]].item(), abs=1e-5)
            assert max(lp.top_logprobs[i].values()) == pytest.approx(ref.max().item(), abs=1e-5)  # type: ignore[index]
        assert out.choices[0].text.startswith(PROMPT)
        assert out.usage is not None and out.usage.completion_tokens == max_tokens


def test_chat_logprobs_streamed_and_not(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model="fake",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy
        assert entry.bytes == list(entry.token.encode())
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []
    ]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]


def test_streamed_completion_logprobs_equal_the_whole(client: openai.OpenAI) -> None:
    kwargs = completion(max_tokens=5, temperature=0, logprobs=2)
    whole = client.completions.create(**kwargs).choices[0].logprobs
    parts = [
        c.choices[0].logprobs
        for c in client.completions.create(**kwargs, stream=True)
        if c.choices and c.choices[0].logprobs
    ]
    assert [t for p in parts for t in p.token_logprobs] == whole.token_logprobs  # type: ignore[union-attr, misc]
    assert [o for p in parts for o in p.text_offset] == whole.text_offset  # type: ignore[union-attr, misc]


# -- n, best_of, penalties, min_p, min_tokens, logit_bias -----------------------------------


def test_n_gives_n_different_seeded_choices(client: openai.OpenAI) -> None:
    kwargs = completion(max_tokens=6, n=3, seed=5, temperature=1.0)
    out = client.completions.create(**kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.text for c in out.choices}) == 3
    again = client.completions.create(**kwargs)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    assert out.usage is not None and out.usage.completion_tokens == 18
    chat = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "x"}], n=2, max_tokens=3, seed=1
    )
    assert [c.index for c in chat.choices] == [0, 1]


def test_best_of_returns_the_most_likely_of_its_sequences(client: openai.OpenAI) -> None:
    kwargs = completion(max_tokens=4, seed=3, temperature=1.0)
    every = client.completions.create(**kwargs, n=4, logprobs=0).choices
    best = client.completions.create(**kwargs, n=1, best_of=4).choices
    scores = {c.text: sum(c.logprobs.token_logprobs) for c in every}  # type: ignore[union-attr, arg-type]
    assert len(best) == 1 and best[0].text == max(scores, key=scores.__getitem__)
    assert best[0].logprobs is None  # computed to rank, reported only when asked for


def test_n_beyond_the_batch_queues_its_sequences_as_vllm_does(client: openai.OpenAI) -> None:
    """n and best_of above the artifact's batch (4 here) run through the queue: vLLM bounds
    n only by VLLM_MAX_N_SEQUENCES (vllm-project/vllm, vllm/sampling_params.py,
    _verify_num_sequences), never by max_num_seqs. Choice j is seeded seed + j, so the 6th
    choice is the one a request with seed + 5 gets alone. What the server can never hold at
    once (batch 4 + queue 64) is refused by name."""
    kwargs = completion(max_tokens=5, seed=11, temperature=1.0)
    many = client.completions.create(**kwargs, n=6, logprobs=0)
    assert [c.index for c in many.choices] == list(range(6))
    alone = client.completions.create(**{**kwargs, "seed": 16}, n=1)
    assert many.choices[5].text == alone.choices[0].text
    best = client.completions.create(**kwargs, n=1, best_of=6, logprobs=0)
    scores = [sum(c.logprobs.token_logprobs) for c in many.choices]  # type: ignore[union-attr, arg-type]
    assert best.choices[0].text == many.choices[scores.index(max(scores))].text
    chat = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "x"}], n=5, max_tokens=2, seed=1
    )
    assert [c.index for c in chat.choices] == list(range(5))
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="fake", prompt=PROMPT, max_tokens=1, n=69)
    error = caught.value.body  # the client unwraps {"error": ...}
    assert error["param"] == "n" and "at most 68" in error["message"], error  # type: ignore[index]


def test_logit_bias_forces_a_token_and_min_tokens_holds_off_eos(
    client: openai.OpenAI, fake_server: Server
) -> None:
    out = client.completions.create(
        model="fake", prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={"120": 100}
    )
    assert out.choices[0].text == "xxx"  # token 120 is "x" in the byte tokenizer
    r = post(
        fake_server,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 3, "logit_bias": {"100000": 5}},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    eos = FAKE_EOS_BIAS = {"257": 100}  # EOS made certain ...
    stopped = client.completions.create(
        model="fake",
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        logit_bias=eos,
        extra_body={"return_token_ids": True},
    )
    assert stopped.choices[0].model_extra["token_ids"] == [257]  # type: ignore[index]
    held = client.completions.create(
        model="fake",
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        logit_bias=FAKE_EOS_BIAS,
        extra_body={"min_tokens": 3, "return_token_ids": True},
    )
    ids = held.choices[0].model_extra["token_ids"]  # type: ignore[index]
    assert 257 not in ids[:3] and ids[3] == 257  # ... but only after min_tokens


def test_penalties_change_greedy_output_as_vllm_defines_them(
    client: openai.OpenAI, fake_server: Server
) -> None:
    """Greedy with a penalty = argmax of the penalised logits (vllm/model_executor/layers/
    utils.py apply_penalties: repetition divides positive / multiplies negative logits of seen
    tokens; frequency subtracts count x f, presence subtracts p once)."""
    from neuronctl.engine.sampling import SamplingParams, apply_options

    history = prompt_ids(fake_server)
    for field, value in (
        ("frequency_penalty", 2.0),
        ("presence_penalty", 2.0),
        ("repetition_penalty", 3.0),
    ):
        out = client.completions.create(
            model="fake",
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            extra_body={field: value, "return_token_ids": True, "ignore_eos": True},
        )
        ids = out.choices[0].model_extra["token_ids"]  # type: ignore[index]
        params = SamplingParams(**{field: value})
        for j, token in enumerate(ids):
            row = apply_options(FAKE.logits_for(history + ids[:j]), params, history, ids[:j])
            assert token == int(row.argmax())


def test_min_p_and_top_k_leave_only_the_likely_tokens(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="fake",
        prompt=PROMPT,
        max_tokens=1,
        temperature=1,
        logprobs=0,
        n=4,  # the server's slots: at most this many per prompt
        seed=0,
        extra_body={"min_p": 1.0},
    )
    assert len({c.text for c in out.choices}) == 1  # min_p 1: only the most likely survives
    top = max(c.logprobs.token_logprobs[0] for c in out.choices)  # type: ignore[union-attr, index]
    assert math.isclose(out.choices[0].logprobs.token_logprobs[0], top)  # type: ignore[union-attr, index]


# -- endpoints -----------------------------------------------------------------------------


def test_version_ping_tokenize_detokenize_openapi(fake_server: Server) -> None:
    url = fake_server.url
    assert httpx.get(url + "/version").json()["version"]
    assert httpx.get(url + "/ping").status_code == 200
    assert httpx.post(url + "/ping").status_code == 200
    tok = post(fake_server, "/tokenize", {"prompt": "hi", "return_token_strs": True}).json()
    assert set(tok) == {"count", "max_model_len", "tokens", "token_strs"}
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 128
    assert tok["token_strs"][-2:] == ["h", "i"]
    bare = post(fake_server, "/tokenize", {"prompt": "hi", "add_special_tokens": False}).json()
    assert bare["tokens"] == tok["tokens"][-2:]
    chat = post(fake_server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2
    assert post(fake_server, "/detokenize", {"tokens": bare["tokens"]}).json() == {"prompt": "hi"}
    assert post(fake_server, "/tokenize", {"model": "other", "prompt": "x"}).status_code == 404
    spec = httpx.get(url + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize"} <= set(spec["paths"])
    assert httpx.get(url + "/docs").status_code == 200


def test_metrics_carry_vllm_names_and_labels(client: openai.OpenAI, fake_server: Server) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(
        model="fake", prompt=PROMPT, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    text = httpx.get(fake_server.url + "/metrics").text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    labels = (("engine", "0"), ("model_name", "fake"))
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    ):
        assert (name, labels) in samples
    assert samples[("vllm:prompt_tokens_total", labels)] >= 4
    assert samples[("vllm:generation_tokens_total", labels)] >= 3
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "inter_token_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert samples[(f"vllm:{name}_count", labels)] >= 1
    success = (("engine", "0"), ("finished_reason", "length"), ("model_name", "fake"))
    assert samples[("vllm:request_success_total", success)] >= 1
    assert not any(
        n.startswith("neuronctl_")
        and n not in ("neuronctl_requests_total", "neuronctl_slots_total")
        for n, _ in samples
    )


def test_every_request_gets_an_access_log_line(fake_server: Server) -> None:
    line = '"POST /v1/completions HTTP/1.1" 200'
    before = fake_server.log().count(line)  # the module's other tests post too
    post(fake_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
    wait_until(lambda: fake_server.log().count(line) > before, 10, "the request's log line")


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_a_streamed_echo_opens_with_the_prompt_and_its_logprobs(
    client: openai.OpenAI, max_tokens: int
) -> None:
    kwargs = completion(max_tokens=max_tokens, temperature=0, logprobs=1, echo=True)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True) if c.choices]
    assert chunks[0].text == PROMPT
    assert "".join(c.text for c in chunks) == whole.text
    lps = [c.logprobs for c in chunks if c.logprobs]
    assert lps[0].token_logprobs[0] is None  # type: ignore[index]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for lp in lps for x in getattr(lp, field)] == getattr(whole.logprobs, field)


@pytest.mark.parametrize(
    "model, revision, name",
    [
        ("HuggingFaceTB/SmolLM2-135M", "0123abcd", "HuggingFaceTB/SmolLM2-135M"),
        ("/data/hf/hub/models--Qwen--Qwen2.5-0.5B/snapshots/abc123", None, "Qwen/Qwen2.5-0.5B"),
        ("./checkpoints/my-llama/", None, "my-llama"),
        (None, None, None),
    ],
)
def test_the_default_served_name_is_the_hub_id_not_the_path_as_typed(
    model: str | None, revision: str | None, name: str | None
) -> None:
    from neuronctl.engine.loader import served_name

    assert served_name(model, revision) == name


def test_logprob_counts_over_20_are_refused_by_name(fake_server: Server) -> None:
    chat = {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}
    r = post(fake_server, "/v1/chat/completions", chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = post(fake_server, "/v1/chat/completions", {**chat, "logprobs": None, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = post(fake_server, "/v1/completions", {"prompt": PROMPT, "logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_tokenize_keeps_the_prompt_character_limit(fake_server: Server) -> None:
    r = post(fake_server, "/tokenize", {"prompt": "y" * (PROMPT_CHARS + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    at_limit = post(fake_server, "/tokenize", {"prompt": "y" * PROMPT_CHARS}).json()
    assert at_limit["count"] >= PROMPT_CHARS


def test_the_openai_client_sending_nulls_gets_the_defaults(client: openai.OpenAI) -> None:
    """The client sends an explicit None as JSON null (NotGiven is what leaves a field out)."""
    out = client.completions.create(
        model="fake", prompt=PROMPT, max_tokens=2, temperature=None, top_p=None, n=None,
        stream=None, echo=None, logprobs=None, best_of=None, stop=None, seed=None,
        presence_penalty=None, frequency_penalty=None, logit_bias=None, user=None,
    )  # fmt: skip
    assert len(out.choices) == 1 and out.choices[0].logprobs is None
    chat = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        temperature=None, top_p=None, n=None, stream=None, logprobs=None, top_logprobs=None,
        response_format=None, seed=None, stop=None, presence_penalty=None,
    )  # fmt: skip
    assert len(chat.choices) == 1 and chat.choices[0].logprobs is None


# -- every vLLM request field: implemented or refused ----------------------------------------

VLLM_FIELDS = json.loads((Path(__file__).parent / "vllm_request_fields.json").read_text())
OURS = {  # vLLM's request model -> this server's, and the endpoint that reads it
    "ChatCompletionRequest": (ChatRequest, "/v1/chat/completions"),
    "CompletionRequest": (CompletionRequest, "/v1/completions"),
    "TokenizeCompletionRequest": (TokenizeRequest, "/tokenize"),
    "TokenizeChatRequest": (TokenizeRequest, "/tokenize"),
    "DetokenizeRequest": (DetokenizeRequest, "/detokenize"),
}
BASE = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/v1/completions": {"prompt": PROMPT, "max_tokens": 1},
    "/tokenize": {"messages": [{"role": "user", "content": "hi"}]},
    "/detokenize": {"tokens": [97]},
}
# A value other than the field's neutral ones (a typed field needs one of its type).
NOT_NEUTRAL: dict[str, Any] = {
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "auto",
    "skip_special_tokens": False,
    "include_reasoning": False,
}


def vllm_fields() -> list[tuple[str, str]]:
    return [(model, f) for model, names in VLLM_FIELDS["models"].items() for f in names]


def test_the_field_list_is_vllms_own() -> None:
    """Generated by tests/vllm_request_fields.py from vLLM 0.33.0's source (commit in the
    file): the models the server mirrors, each with its known fields."""
    assert VLLM_FIELDS["vllm_version"] == "0.33.0" and VLLM_FIELDS["vllm_commit"]
    assert set(VLLM_FIELDS["models"]) == set(OURS)
    chat = VLLM_FIELDS["models"]["ChatCompletionRequest"]
    assert {"stop_token_ids", "continue_final_message", "echo", "chat_template"} <= set(chat)
    assert len(chat) > 60 and len(VLLM_FIELDS["models"]["CompletionRequest"]) > 50


@pytest.mark.parametrize("model, field", vllm_fields())
def test_every_vllm_request_field_is_implemented_or_refused(
    fake_server: Server, model: str, field: str
) -> None:
    """A field this server neither implements nor refuses would be accepted and ignored: a
    200 with the wrong answer. A refused one is a 400 naming it, unless it holds a neutral
    value (the value that changes nothing)."""
    ours, endpoint = OURS[model]
    implemented = field in ours.model_fields or field in NO_EFFECT
    refused = field in UNSUPPORTED
    assert implemented or refused, f"{model}.{field} is neither implemented nor refused"
    if refused:
        body = {**BASE[endpoint], field: NOT_NEUTRAL.get(field, "x")}
        r = post(fake_server, endpoint, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def greedy_ids(client: openai.OpenAI, **fields: Any) -> Any:
    body = completion(**{"max_tokens": 8, "temperature": 0, **fields})
    body["extra_body"] = {**body["extra_body"], "return_token_ids": True}
    return client.completions.create(**body).choices[0]


def test_stop_token_ids_end_the_output_and_leave_their_text_out(client: openai.OpenAI) -> None:
    """vLLM stops at a stop token (finish "stop"), keeps its id in the output, and decodes its
    text only with include_stop_str_in_output (vllm/v1/engine/detokenizer.py, update:
    skipped_stop_token_id)."""
    free = greedy_ids(client)
    ids = free.token_ids
    stop = ids[3]
    first = ids.index(stop)
    out = greedy_ids(client, extra_body={"ignore_eos": True, "stop_token_ids": [stop]})
    assert out.finish_reason == "stop" and out.token_ids == ids[: first + 1]
    assert free.text.startswith(out.text) and len(out.text) < len(free.text)
    kept = greedy_ids(client, extra_body={"ignore_eos": True, "stop_token_ids": [stop],
                                          "include_stop_str_in_output": True})  # fmt: skip
    assert kept.token_ids == out.token_ids and len(kept.text) > len(out.text)
    assert free.text.startswith(kept.text)


def test_include_stop_str_in_output_keeps_the_stop_string(client: openai.OpenAI) -> None:
    free = greedy_ids(client).text
    stop = free[2:4]
    cut = client.completions.create(**completion(max_tokens=8, temperature=0, stop=[stop]))
    kept = client.completions.create(**completion(
        max_tokens=8, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    ))  # fmt: skip
    at = free.index(stop)
    assert cut.choices[0].text == free[:at]
    assert kept.choices[0].text == free[: at + len(stop)]


def test_allowed_token_ids_restrict_every_sampled_token(client: openai.OpenAI) -> None:
    allowed = [40, 41]
    out = greedy_ids(client, temperature=1.0, seed=3,
                     extra_body={"ignore_eos": True, "allowed_token_ids": allowed})  # fmt: skip
    assert out.token_ids and set(out.token_ids) <= set(allowed)
    with pytest.raises(openai.BadRequestError) as caught:
        greedy_ids(client, extra_body={"allowed_token_ids": [10**6]})
    assert caught.value.body["param"] == "allowed_token_ids"  # type: ignore[index]


def prompt_ids_raw(server: Server) -> list[int]:
    body = {"prompt": "abcdef", "add_special_tokens": False}
    return list(post(server, "/tokenize", body).json()["tokens"])


def test_add_special_tokens_and_truncate_prompt_tokens_shape_the_prompt(
    client: openai.OpenAI, fake_server: Server
) -> None:
    """add_special_tokens false drops the BOS; truncate_prompt_tokens keeps the last k tokens
    (vLLM's default side, "left": vllm/tokenizers/registry.py), "right" the first k."""
    ids = prompt_ids(fake_server, "abcdef")

    def usage_and_text(**extra: Any) -> tuple[int, str]:
        out = client.completions.create(model="fake", prompt="abcdef", max_tokens=4,
                                        temperature=0, extra_body=extra)  # fmt: skip
        return out.usage.prompt_tokens, out.choices[0].text  # type: ignore[union-attr]

    assert usage_and_text(add_special_tokens=False)[0] == len(prompt_ids_raw(fake_server))
    last3 = client.completions.create(model="fake", prompt=ids[-3:], max_tokens=4, temperature=0)
    assert usage_and_text(truncate_prompt_tokens=3) == (3, last3.choices[0].text)
    first3 = client.completions.create(model="fake", prompt=ids[:3], max_tokens=4, temperature=0)
    right = usage_and_text(truncate_prompt_tokens=3, truncation_side="right")
    assert right == (3, first3.choices[0].text)


def test_chat_template_fields_as_vllm_reads_them(fake_server: Server, tiny_llama: Path) -> None:
    """add_generation_prompt, continue_final_message (the last message left open, as
    transformers' apply_chat_template does it) and add_special_tokens, through /tokenize and
    against transformers' own rendering of the same template."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_llama))  # the fake server's tokenizer
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The an"}]

    def ours(**fields: Any) -> list[int]:
        r = post(fake_server, "/tokenize", {"messages": messages, **fields})
        assert r.status_code == 200, r.text
        return list(r.json()["tokens"])

    def theirs(**kwargs: Any) -> list[int]:
        return list(hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))

    assert ours() == theirs(add_generation_prompt=True)
    assert ours(add_generation_prompt=False) == theirs(add_generation_prompt=False)
    continued = ours(add_generation_prompt=False, continue_final_message=True)
    assert continued == theirs(continue_final_message=True)
    assert hf.decode(continued).endswith("The an")
    both = post(fake_server, "/tokenize", {"messages": messages, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_chat_continue_final_message_and_echo(client: openai.OpenAI) -> None:
    """continue_final_message generates on from the assistant's words; echo puts them in
    front of the answer (vllm/entrypoints/openai/chat_completion/serving.py: the last
    message's content, when its role is the answer's)."""
    messages: Any = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ab"}]
    base = dict(model="fake", messages=messages, max_tokens=4, temperature=0)
    cont = {"add_generation_prompt": False, "continue_final_message": True, "ignore_eos": True}
    fresh = client.chat.completions.create(**base, extra_body={"ignore_eos": True})
    continued = client.chat.completions.create(**base, extra_body=cont)
    assert continued.usage.prompt_tokens < fresh.usage.prompt_tokens  # type: ignore[union-attr]
    echoed = client.chat.completions.create(**base, extra_body={**cont, "echo": True})
    assert echoed.choices[0].message.content == "ab" + (continued.choices[0].message.content or "")
    stream = client.chat.completions.create(**base, stream=True, extra_body={**cont, "echo": True})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == echoed.choices[0].message.content
    user_last = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0,
        extra_body={"echo": True, "ignore_eos": True},
    )  # fmt: skip
    plain = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert user_last.choices[0].message.content == plain.choices[0].message.content


def test_tools_with_tool_choice_none_are_accepted(client: openai.OpenAI) -> None:
    """What many clients send by default; any other tool_choice stays refused by name."""
    tools: Any = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    chat = dict(model="fake", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    out = client.chat.completions.create(**chat, tools=tools, tool_choice="none")
    assert out.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**chat, tools=tools, tool_choice="auto")
    assert caught.value.body["param"] in ("tools", "tool_choice")  # type: ignore[index]
