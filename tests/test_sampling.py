from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from neuronctl.engine.errors import RequestError
from neuronctl.engine.sampling import (
    SamplingParams,
    apply_options,
    make_generator,
    resolve_params,
    sample,
    sample_step,
    token_logprobs,
)
from neuronctl.engine.text import TextStream, WindowDecoder
from neuronctl.engine.tokenizer import EngineTokenizer


@dataclass
class _State:  # sampling.RowState
    params: SamplingParams
    generator: torch.Generator
    prompt_ids: list[int]
    output_ids: list[int]


def test_temperature_zero_is_greedy_like_top_k_one() -> None:
    p = resolve_params(SamplingParams(temperature=0.0, top_k=50))
    assert p.greedy and p.top_k == 1
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert sample(logits, p, make_generator(0)) == 1


def test_top_k_minus_one_and_zero_are_capped_at_global_top_k() -> None:
    assert resolve_params(SamplingParams(top_k=-1)).top_k == 256
    assert resolve_params(SamplingParams(top_k=0)).top_k == 256
    assert resolve_params(SamplingParams(top_k=-1), global_topk=64).top_k == 64


def test_top_k_above_global_top_k_is_refused_with_the_cap() -> None:
    with pytest.raises(RequestError, match="global top_k 256") as exc:
        resolve_params(SamplingParams(top_k=257))
    assert exc.value.param == "top_k"
    assert resolve_params(SamplingParams(top_k=256)).top_k == 256


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
        resolve_params(params)
    assert exc.value.param == field


def test_same_seed_same_samples_different_seed_differs() -> None:
    logits = torch.randn(300, generator=make_generator(1))
    p = resolve_params(SamplingParams(temperature=1.5, seed=7))

    def draw(seed: int) -> list[int]:
        gen = make_generator(seed)
        return [sample(logits, p, gen) for _ in range(30)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_top_k_limits_choices_to_the_k_largest() -> None:
    logits = torch.arange(100, dtype=torch.float32)
    p = resolve_params(SamplingParams(temperature=100.0, top_k=3, seed=0))
    gen = make_generator(0)
    seen = {sample(logits, p, gen) for _ in range(200)}
    assert seen == {97, 98, 99}


def test_top_p_keeps_smallest_prefix_reaching_the_mass() -> None:
    # probabilities 0.5, 0.3, 0.2 (after softmax of the logs): top_p 0.6 keeps two tokens.
    logits = torch.log(torch.tensor([0.2, 0.5, 0.3]))
    p = resolve_params(SamplingParams(temperature=1.0, top_p=0.6, seed=0))
    gen = make_generator(0)
    seen = {sample(logits, p, gen) for _ in range(300)}
    assert seen == {1, 2}
    tiny = resolve_params(SamplingParams(top_p=0.01))
    assert {sample(logits, tiny, gen) for _ in range(50)} == {1}


def test_sample_rows_mixes_greedy_and_sampled_rows() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [9.0, 0.0, 0.0], [0.0, 0.0, 7.0]])
    greedy = resolve_params(SamplingParams(temperature=0))
    hot = resolve_params(SamplingParams(top_k=1, temperature=2.0))
    out = sample_rows(logits, [2, 0], [greedy, hot], [make_generator(0), make_generator(1)])
    assert out == [2, 1]


@dataclass(frozen=True)
class Row:
    """One row's request as sample_step reads it, with no history."""

    params: SamplingParams
    generator: torch.Generator
    prompt_ids: tuple[int, ...] = ()
    output_ids: tuple[int, ...] = ()


def sample_rows(logits, rows, params, gens) -> list:
    """Tokens (or the exception a row raised) of sample_step over rows with no history."""
    picks = sample_step(logits, rows, [Row(p, g) for p, g in zip(params, gens, strict=True)])
    return [p if isinstance(p, Exception) else p.token_id for p in picks]


def chars(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def test_text_stream_holds_back_partial_stop_strings() -> None:
    stream = TextStream(WindowDecoder(chars), stop=["END", "xy"])
    deltas = [stream.update(ord(c)) for c in "abcEN"]
    assert "".join(d for d, _ in deltas) == "abc"  # "EN" may become "END"
    assert not any(stopped for _, stopped in deltas)
    delta, stopped = stream.update(ord("D"))
    assert stopped and delta == "" and stream.text == "abc"


def test_text_stream_finds_a_stop_string_split_over_tokens_and_keeps_what_precedes() -> None:
    pieces = {1: "he", 2: "llo wo", 3: "rld"}
    stream = TextStream(lambda t: pieces[t], stop=["o w"])
    assert stream.update(1) == ("he", False)
    assert stream.update(2) == ("ll", True)
    assert stream.text == "hell"


def test_text_stream_releases_held_text_once_it_cannot_become_a_stop_string() -> None:
    stream = TextStream(WindowDecoder(chars), stop=["ab!"])
    assert stream.update(ord("a")) == ("", False)
    assert stream.update(ord("b")) == ("", False)
    assert stream.update(ord("c")) == ("abc", False)
    assert stream.update(ord("a")) == ("", False)
    assert stream.flush() == "a" and stream.text == "abca"


def test_window_decoder_holds_back_incomplete_characters() -> None:
    # Byte tokens whose UTF-8 needs two of them: "é" is c3 a9.
    def utf8(ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    decode = WindowDecoder(utf8)
    assert [decode(t) for t in b"a\xc3\xa9b"] == ["a", "", "é", "b"]
    assert decode(0xC3) == "" and decode.flush() == "\ufffd"  # an output cut mid-character


def test_window_decoder_keeps_spaces_that_depend_on_the_neighbour() -> None:
    # sentencepiece drops the leading "▁" of the first token decoded: differences keep it.
    vocab = {1: "▁Hello", 2: "▁world", 3: "!"}

    def sp(ids: list[int]) -> str:
        return "".join(vocab[i] for i in ids).replace("▁", " ").lstrip(" ")

    decode = WindowDecoder(sp)
    assert "".join(decode(t) for t in (1, 2, 3, 2)) == sp([1, 2, 3, 2])


def test_detokenizing_4000_tokens_decodes_a_constant_number_of_ids_per_token() -> None:
    decoded_ids = 0

    def counting(ids: list[int]) -> str:
        nonlocal decoded_ids
        decoded_ids += len(ids)
        return chars(ids)

    stream = TextStream(WindowDecoder(counting), stop=["never"])
    ids = [97 + i % 26 for i in range(4000)]
    text = "".join(stream.update(t)[0] for t in ids) + stream.flush()
    assert text == chars(ids)
    # Re-decoding everything each step would decode 4000*4001/2 ~ 8 million ids.
    assert decoded_ids <= 4 * len(ids)


def test_tokenizers_decode_stream_gives_the_whole_decode_one_call_per_token(
    tmp_path: Path,
) -> None:
    from tests.helpers import make_tokenizer

    make_tokenizer(tmp_path)
    tokenizer = EngineTokenizer.load(tmp_path)
    text = "naïve café, 東京 " * 200
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 4000  # byte-level: multi-byte characters span several ids
    calls = 0
    step = tokenizer.new_decoder()

    def counted(token_id: int) -> str:
        nonlocal calls
        calls += 1
        return step(token_id)

    stream = TextStream(counted)
    out = "".join(stream.update(t)[0] for t in ids) + stream.flush()
    assert out == text == tokenizer.decode(ids)
    assert calls == len(ids)
    # An output that ends inside a character ends as a whole decode would end it.
    cut = tokenizer.encode("ab東", add_special_tokens=False)[:-1]
    stream = TextStream(tokenizer.new_decoder())
    out = "".join(stream.update(t)[0] for t in cut) + stream.flush()
    assert out == tokenizer.decode(cut) and out.endswith("\ufffd")


@pytest.mark.parametrize(
    "params, field",
    [
        (SamplingParams(temperature=2e-39), "temperature"),
        (SamplingParams(temperature=1e-300), "temperature"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(temperature=float("inf")), "temperature"),
        (SamplingParams(top_p=float("nan")), "top_p"),
        (SamplingParams(seed=2**64), "seed"),
        (SamplingParams(seed=-(2**63) - 1), "seed"),
    ],
)
def test_values_that_would_fail_inside_the_batch_are_refused_up_front(
    params: SamplingParams, field: str
) -> None:
    with pytest.raises(RequestError) as exc:
        resolve_params(params)
    assert exc.value.param == field


def test_extreme_but_accepted_values_sample_without_nan() -> None:
    logits = torch.tensor([1e30, -1e30, 5.0, 0.0])
    for temperature in (0.01, 1e6):
        p = resolve_params(SamplingParams(temperature=temperature, seed=2**64 - 1))
        assert sample(logits, p, make_generator(p.seed or 0)) in range(4)
    make_generator(-(2**63))  # the lowest seed is one torch takes


def test_a_row_that_cannot_be_sampled_fails_alone() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [float("nan")] * 3])
    hot = resolve_params(SamplingParams(temperature=1.0, seed=0))
    greedy = resolve_params(SamplingParams(temperature=0))
    out = sample_rows(logits, [0, 1], [greedy, hot], [make_generator(0), make_generator(1)])
    assert out[0] == 1 and isinstance(out[1], Exception)


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
        resolve_params(params)


# -- vLLM's per-request options -------------------------------------------------------------


def test_token_logprobs_are_log_softmax_of_the_raw_logits() -> None:
    logits = torch.randn(3, 50, generator=make_generator(0)) * 4
    found = token_logprobs(logits, [7, 0, 49], [0, 2, 5])
    ref = torch.log_softmax(logits, -1)
    for row, lp in enumerate(found):
        assert lp.logprob == pytest.approx(ref[row, lp.token_id].item(), abs=1e-6)
        values, ids = torch.topk(ref[row], len(lp.top)) if lp.top else (torch.zeros(0), [])
        assert [t for t, _ in lp.top] == list(ids.tolist() if lp.top else [])
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-6)
    assert [len(lp.top) for lp in found] == [0, 2, 5]


def test_logprobs_are_of_the_raw_logits_even_when_options_change_the_pick() -> None:
    """vLLM's default logprobs_mode is raw_logprobs: what the model said, not the penalised
    distribution (vllm/config/model.py, LogprobsMode)."""
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]])
    params = resolve_params(SamplingParams(temperature=0, logit_bias=((3, 100.0),), logprobs=1))
    state = _State(params, make_generator(0), [0], [])
    [pick] = sample_step(logits, [0], [state])
    assert not isinstance(pick, Exception) and pick.token_id == 3
    assert pick.logprob is not None
    assert pick.logprob.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[3].item())
    assert pick.logprob.top[0][0] == 0  # the model's own favourite heads the list


def test_penalties_follow_vllm() -> None:
    """vllm/model_executor/layers/utils.py apply_penalties: repetition over prompt and output
    tokens (positive logits divided, negative multiplied), then frequency x count and presence
    once, over output tokens only."""
    row = torch.tensor([2.0, -2.0, 1.0, 3.0, 0.5])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_options(row, p, prompt_ids=[0], output_ids=[1, 3, 3])
    assert out.tolist() == pytest.approx([1.0, -4.0 - 0.75, 1.0, 1.5 - 1.25, 0.5])
    assert row.tolist() == [2.0, -2.0, 1.0, 3.0, 0.5]  # the caller's logits are untouched


def test_min_tokens_masks_eos_until_reached_and_logit_bias_adds() -> None:
    row = torch.tensor([0.0, 9.0, 1.0])
    p = SamplingParams(min_tokens=2, logit_bias=((2, 0.5),))
    early = apply_options(row, p, [0], [2], eos_ids={1})
    assert early[1] == -math.inf and early[2] == 1.5
    assert apply_options(row, p, [0], [2, 2], eos_ids={1})[1] == 9.0


def test_logit_bias_is_built_once_per_request_and_the_last_entry_wins() -> None:
    """A 1,024-entry bias rebuilt from the tuple at every step took a fifth of a shared
    engine step (py-spy on bench/hostile.py's capped-bias load): its tensors are built once
    per request, and a token named twice (the Python API does not merge) gets its last value,
    once, as before."""
    p = SamplingParams(logit_bias=((2, 0.5), (0, 1.0), (2, 3.0)))
    assert p.bias_tensors is p.bias_tensors
    out = apply_options(torch.zeros(3), p, [], [])
    assert out.tolist() == [1.0, 0.0, 3.0]
    allowed = SamplingParams(allowed_token_ids=(1,))
    assert allowed.allowed_tensor is allowed.allowed_tensor
    assert apply_options(torch.ones(3), allowed, [], []).tolist() == [-math.inf, 1.0, -math.inf]


def test_min_p_drops_tokens_below_its_share_of_the_top() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = resolve_params(SamplingParams(temperature=1.0, min_p=0.4, seed=0))
    gen = make_generator(0)
    assert {sample(logits, p, gen) for _ in range(300)} == {0, 1}  # 0.15 < 0.4 x 0.5


@pytest.mark.parametrize(
    "params, field",
    [
        (SamplingParams(presence_penalty=2.5), "presence_penalty"),
        (SamplingParams(frequency_penalty=-3), "frequency_penalty"),
        (SamplingParams(repetition_penalty=0), "repetition_penalty"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(min_tokens=5, max_tokens=2), "min_tokens"),
        (SamplingParams(logprobs=21), "logprobs"),
        (SamplingParams(logit_bias=((1, math.inf),)), "logit_bias"),
        (SamplingParams(max_tokens=0, prompt_logprobs=None), "max_tokens"),
    ],
)
def test_out_of_range_options_name_the_field(params: SamplingParams, field: str) -> None:
    with pytest.raises(RequestError) as exc:
        resolve_params(params)
    assert exc.value.param == field


def test_prompt_logprobs_allow_max_tokens_zero() -> None:
    assert resolve_params(SamplingParams(max_tokens=0, prompt_logprobs=0)).max_tokens == 0


def test_the_engine_scores_prompt_tokens_through_decode_steps() -> None:
    """Echo: each prompt token's logprob under the logits of the tokens before it, although
    the runner's context encoding returns the last position's logits only; its neighbour in
    the batch gets the same tokens as alone."""
    from neuronctl.engine.engine import Engine
    from tests.fake_runner import EOS_ID, FakeRunner, byte_decoder

    runner = FakeRunner(batch_size=2, seq_len=64)
    engine = Engine(runner, byte_decoder, eos_ids=[EOS_ID]).start()
    try:
        prompt, other = [5, 9, 77, 100, 3], [1, 2, 3]
        echo = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1, logprobs=0)
        plain = SamplingParams(temperature=0, max_tokens=6)
        scored, neighbour = engine.generate([prompt, other], [echo, plain])
        assert neighbour.token_ids == engine.generate([other], plain)[0].token_ids
        assert scored.token_ids == engine.generate([prompt], replace(echo, prompt_logprobs=None))[
            0].token_ids  # fmt: skip
        assert scored.prompt_logprobs is not None and scored.prompt_logprobs[0] is None
        for i in range(1, len(prompt)):
            lp = scored.prompt_logprobs[i]
            ref = torch.log_softmax(runner.logits_for(prompt[:i]), -1)
            assert lp is not None and lp.token_id == prompt[i]
            assert lp.logprob == pytest.approx(ref[prompt[i]].item(), abs=1e-6)
            assert lp.top[0] == (int(ref.argmax()), pytest.approx(ref.max().item(), abs=1e-6))
        only = engine.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
        assert only.token_ids == [] and only.finish_reason == "length"
        assert len(only.prompt_logprobs or []) == len(prompt)
    finally:
        engine.stop()


def test_min_tokens_also_holds_off_stop_strings_as_vllm() -> None:
    """vLLM's incremental detokenizer checks stop strings only once len(output) > min_tokens
    (vllm/v1/engine/detokenizer.py, IncrementalDetokenizer.update)."""
    from neuronctl.engine.engine import Engine
    from tests.fake_runner import EOS_ID, FakeRunner, byte_decoder

    engine = Engine(FakeRunner(batch_size=1), byte_decoder, eos_ids=[EOS_ID]).start()
    try:
        greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        text = engine.generate([[1, 2]], greedy)[0].text
        stop = text[1]  # the second character would stop the output at once
        early = engine.generate([[1, 2]], replace(greedy, stop=(stop,)))[0]
        assert early.text == text[: text.index(stop)] and early.finish_reason == "stop"
        held = engine.generate([[1, 2]], replace(greedy, stop=(stop,), min_tokens=3))[0]
        assert held.text.startswith(text[:3]) and len(held.token_ids) >= 3
    finally:
        engine.stop()


def _forbid(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Make these per-row sampling steps fail if they run at all."""
    from neuronctl.engine import sampling

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("per-row sampling work for a row that asked for none")

    for name in names:
        monkeypatch.setattr(sampling, name, refuse)


def _count_argmax(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows in each argmax_rows call sample_step makes."""
    from neuronctl.engine import sampling

    calls: list[int] = []
    real = sampling.argmax_rows

    def counted(logits: torch.Tensor) -> list[int]:
        calls.append(logits.shape[0])
        return real(logits)

    monkeypatch.setattr(sampling, "argmax_rows", counted)
    return calls


def test_a_plain_greedy_batch_is_one_argmax_and_no_per_row_work(monkeypatch) -> None:
    """Greedy rows with no options cost one batched argmax: no per-row pick, options,
    sampling or logprobs."""
    _forbid(monkeypatch, "_pick", "apply_options", "sample", "token_logprobs", "_add_logprobs")
    calls = _count_argmax(monkeypatch)
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(0))
    greedy = resolve_params(SamplingParams(temperature=0))
    states = [_State(greedy, make_generator(0), [1], []) for _ in range(8)]
    picks = sample_step(logits, list(range(8)), states)
    assert [p.token_id for p in picks] == logits.argmax(-1).tolist()  # type: ignore[union-attr]
    assert calls == [8]


def test_options_run_only_for_the_rows_that_ask_for_them(monkeypatch) -> None:
    """One row with a repetition penalty and one with logprobs among six plain greedy rows:
    the greedy rows without options share one argmax, options run once (for their row),
    logprobs once (for theirs)."""
    from neuronctl.engine import sampling

    optioned: list[int] = []
    real_options, real_logprobs = sampling.apply_options, sampling.token_logprobs

    def options(row, params, prompt_ids, output_ids, eos_ids=()):  # type: ignore[no-untyped-def]
        optioned.append(len(prompt_ids))
        return real_options(row, params, prompt_ids, output_ids, eos_ids)

    scored: list[int] = []

    def logprobs(logits, token_ids, ks):  # type: ignore[no-untyped-def]
        scored.append(len(token_ids))
        return real_logprobs(logits, token_ids, ks)

    monkeypatch.setattr(sampling, "apply_options", options)
    monkeypatch.setattr(sampling, "token_logprobs", logprobs)
    calls = _count_argmax(monkeypatch)
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(1))
    greedy = resolve_params(SamplingParams(temperature=0))
    penalised = resolve_params(SamplingParams(temperature=0, repetition_penalty=1.5))
    scoring = resolve_params(SamplingParams(temperature=0, logprobs=2))
    params = [greedy] * 8
    params[3], params[5] = penalised, scoring
    states = [_State(p, make_generator(0), [i] * 7, []) for i, p in enumerate(params)]
    picks = sample_step(logits, list(range(8)), states)
    assert optioned == [7]  # row 3 alone
    assert scored == [1]  # row 5 alone
    assert sorted(calls) == [1, 7]  # every greedy row without options together; row 3 alone
    assert all(not isinstance(p, Exception) for p in picks)


def test_bfloat16_argmax_matches_torch_without_torchs_widening(monkeypatch) -> None:
    """bf16 logits are widened by numpy (a shift of their bits), not by `Tensor.float`, an
    OpenMP op whose hand-off costs more than the argmax; the picks are torch's, NaN and
    negative rows included."""
    from neuronctl.engine.sampling import argmax_rows

    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(6, 5000, generator=gen) * 30).bfloat16()
    logits[1] = -logits[1].abs() - 1  # all negative
    logits[2, 77] = float("nan")
    logits[3, 10] = float("-nan")
    logits[4, 4999] = float("inf")
    logits[5, :] = -float("inf")
    want = [int(i) for i in logits.float().argmax(-1)]

    def refuse(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("bf16 widened by torch")

    monkeypatch.setattr(torch.Tensor, "float", refuse)
    assert argmax_rows(logits) == want
    assert argmax_rows(logits[[4, 2]]) == [want[4], want[2]]
