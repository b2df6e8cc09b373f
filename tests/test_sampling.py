from __future__ import annotations

import pytest
import torch

from neuronctl.engine.errors import RequestError
from neuronctl.engine.sampling import SamplingParams, make_generator, resolve, sample, sample_rows
from neuronctl.engine.text import TextStream


def test_temperature_zero_is_greedy_like_top_k_one() -> None:
    p = resolve(SamplingParams(temperature=0.0, top_k=50))
    assert p.greedy and p.top_k == 1
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert sample(logits, p, make_generator(0)) == 1


def test_top_k_minus_one_and_zero_are_capped_at_global_top_k() -> None:
    assert resolve(SamplingParams(top_k=-1)).top_k == 256
    assert resolve(SamplingParams(top_k=0)).top_k == 256
    assert resolve(SamplingParams(top_k=-1), global_topk=64).top_k == 64


def test_top_k_above_global_top_k_is_refused_with_the_cap() -> None:
    with pytest.raises(RequestError, match="global top_k 256") as exc:
        resolve(SamplingParams(top_k=257))
    assert exc.value.param == "top_k"
    assert resolve(SamplingParams(top_k=256)).top_k == 256


@pytest.mark.parametrize(
    "params, field",
    [
        (SamplingParams(temperature=-0.5), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(top_k=-2), "top_k"),
        (SamplingParams(max_tokens=0), "max_tokens"),
    ],
)
def test_invalid_parameters_name_the_field(params: SamplingParams, field: str) -> None:
    with pytest.raises(RequestError) as exc:
        resolve(params)
    assert exc.value.param == field


def test_same_seed_same_samples_different_seed_differs() -> None:
    logits = torch.randn(300, generator=make_generator(1))
    p = resolve(SamplingParams(temperature=1.5, seed=7))

    def draw(seed: int) -> list[int]:
        gen = make_generator(seed)
        return [sample(logits, p, gen) for _ in range(30)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_top_k_limits_choices_to_the_k_largest() -> None:
    logits = torch.arange(100, dtype=torch.float32)
    p = resolve(SamplingParams(temperature=100.0, top_k=3, seed=0))
    gen = make_generator(0)
    seen = {sample(logits, p, gen) for _ in range(200)}
    assert seen == {97, 98, 99}


def test_top_p_keeps_smallest_prefix_reaching_the_mass() -> None:
    # probabilities 0.5, 0.3, 0.2 (after softmax of the logs): top_p 0.6 keeps two tokens.
    logits = torch.log(torch.tensor([0.2, 0.5, 0.3]))
    p = resolve(SamplingParams(temperature=1.0, top_p=0.6, seed=0))
    gen = make_generator(0)
    seen = {sample(logits, p, gen) for _ in range(300)}
    assert seen == {1, 2}
    tiny = resolve(SamplingParams(top_p=0.01))
    assert {sample(logits, tiny, gen) for _ in range(50)} == {1}


def test_sample_rows_mixes_greedy_and_sampled_rows() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [9.0, 0.0, 0.0], [0.0, 0.0, 7.0]])
    greedy = resolve(SamplingParams(temperature=0))
    hot = resolve(SamplingParams(top_k=1, temperature=2.0))
    out = sample_rows(logits, [2, 0], [greedy, hot], [make_generator(0), make_generator(1)])
    assert out == [2, 1]


def test_text_stream_holds_back_partial_stop_strings() -> None:
    stream = TextStream(lambda ids: "".join(chr(i) for i in ids), stop=["END", "xy"])
    text = "abcEN"
    deltas = [stream.update([ord(c) for c in text[: i + 1]]) for i in range(len(text))]
    assert "".join(d for d, _ in deltas) == "abc"  # "EN" may become "END"
    delta, stopped = stream.update([ord(c) for c in "abcENDzz"])
    assert stopped and delta == "" and stream.text == "abc"


def test_text_stream_holds_back_incomplete_characters() -> None:
    decoded = {1: "a\ufffd", 2: "aé"}
    stream = TextStream(lambda ids: decoded[len(ids)])
    assert stream.update([0]) == ("a", False)
    assert stream.update([0, 0]) == ("é", False)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens="8"),  # type: ignore[arg-type]
        SamplingParams(temperature="hot"),  # type: ignore[arg-type]
        SamplingParams(top_k=2.5),  # type: ignore[arg-type]
        SamplingParams(seed="1"),  # type: ignore[arg-type]
        SamplingParams(max_tokens=True),
        SamplingParams(stop=5),  # type: ignore[arg-type]
        SamplingParams(ignore_eos="yes"),  # type: ignore[arg-type]
    ],
)
def test_resolve_refuses_mistyped_fields_as_request_errors(params: SamplingParams) -> None:
    with pytest.raises(RequestError):
        resolve(params)
