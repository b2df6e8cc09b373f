"""Sampling parameters, their on-device rules, and the sampler itself.

The rules follow NxD Inference's on-device sampling, as the AWS "vLLM User Guide for NxD
Inference" states them (aws-neuron/aws-neuron-sdk,
libraries/nxd-inference/developer_guides/vllm-user-guide.rst): temperature 0 means greedy (the
same as top_k 1); top_k -1 (or 0, "disabled") is capped at the artifact's global top_k (256 by
default); a top_k above that cap is refused rather than silently lowered.

vLLM's per-request options run on top, only for the rows that ask for them (`sample_step`):
logit_bias and min_tokens, then the repetition / frequency / presence penalties on the logits,
then temperature, min_p, top-k and top-p on the probabilities. Logprobs are `log_softmax` of the
raw logits (vLLM's default `raw_logprobs`), one batched call over the rows that want them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Protocol

import numpy as np
import torch

from neuronctl.engine.errors import RequestError
from neuronctl.spec import DEFAULT_GLOBAL_TOPK

# Below this a temperature is greedy in all but name, and 1/t overflows float32 (2e-39) or
# float64 (1e-300): refused, so such a request never reaches the batch.
MIN_TEMPERATURE = 1e-2
# torch.Generator.manual_seed takes [-2**63, 2**64): anything else would fail inside the loop.
SEED_RANGE = (-(2**63), 2**64)
# Every stop string is matched against the new text at every token, on the engine thread that
# serves the whole batch: a request's stop strings are capped in count and total length, so
# one request's matching costs a bounded share of a step (400,000 of them took a neighbour's
# stream from 1 s to 12-16 s).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
# A penalty divides (or multiplies) a logit: past these a logit overflows float32 and the
# sampler meets inf/nan (1e-300 was a 500).
REPETITION_PENALTY_RANGE = (0.01, 100.0)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None  # None: up to the end of the sequence
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0  # EOS is masked until this many tokens were generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the top k
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's and the top k
    stop_token_ids: tuple[int, ...] = ()  # end the output as EOS does (vLLM's stop_token_ids)
    allowed_token_ids: tuple[int, ...] | None = None  # None: any token; else only these
    include_stop_str_in_output: bool = False  # the stop string (or stop token's text) kept

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def processed(self) -> bool:
        """Whether the logits change before sampling (a row without this costs nothing)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
            or self.min_tokens or self.logit_bias or self.allowed_token_ids is not None
        )  # fmt: skip

    @cached_property  # asked for every row at every step: computed once per request
    def argmax_picks(self) -> bool:
        """Greedy on the raw logits: one batched argmax picks the row's token (its logprobs,
        if asked for, come after, from the same raw logits)."""
        return self.greedy and not self.processed

    @cached_property
    def bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """logit_bias as (token ids, values), built once per request: rebuilt from the tuple
        at every step, a 1,024-entry bias took a fifth of a shared engine step (every row of
        the batch waits for it)."""
        merged = dict(self.logit_bias)  # one entry per token id, the last one given wins
        ids = torch.tensor(list(merged), dtype=torch.long)
        return ids, torch.tensor(list(merged.values()), dtype=torch.float32)

    @cached_property
    def allowed_tensor(self) -> torch.Tensor:
        """allowed_token_ids as a tensor, built once per request (see bias_tensors)."""
        return torch.tensor(list(self.allowed_token_ids or ()), dtype=torch.long)

    @cached_property
    def plain(self) -> bool:
        """Greedy with nothing else asked: one batched argmax is all the row costs."""
        return self.argmax_picks and self.logprobs is None


def resolve_params(
    params: SamplingParams, global_topk: int = DEFAULT_GLOBAL_TOPK
) -> SamplingParams:
    """Check a request's parameters and apply the on-device rules; raise RequestError."""
    _check_types(params)
    _check_values(params)
    if not 0 < params.top_p <= 1:
        raise RequestError("top_p must be in (0, 1]", param="top_p")
    if params.top_k < -1:
        raise RequestError("top_k must be -1 (disabled) or >= 1", param="top_k")
    if params.top_k > global_topk:
        raise RequestError(
            f"top_k {params.top_k} is above this artifact's global top_k {global_topk}",
            param="top_k",
            hint=f"use top_k <= {global_topk}, or -1 for {global_topk}",
        )
    if params.max_tokens is not None and params.max_tokens < _least_max_tokens(params):
        raise RequestError("max_tokens must be >= 1", param="max_tokens")
    _check_options(params)
    stop = tuple(s for s in params.stop if s)
    _check_stop(stop)
    top_k = global_topk if params.top_k in (-1, 0) else params.top_k
    if params.temperature == 0:
        top_k = 1
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    return replace(params, top_k=top_k, stop=stop, seed=seed)


def _check_stop(stop: tuple[str, ...]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise RequestError(
            f"{len(stop)} stop strings; a request may have at most {MAX_STOP_STRINGS}",
            param="stop",
        )
    chars = sum(len(s) for s in stop)
    if chars > MAX_STOP_CHARS:
        raise RequestError(
            f"the stop strings have {chars} characters in all; at most {MAX_STOP_CHARS}",
            param="stop",
        )


MAX_LOGPROBS = 20  # vLLM's default --max-logprobs, and OpenAI's top_logprobs limit


def _least_max_tokens(params: SamplingParams) -> int:
    """0 only when the prompt's logprobs are the answer (echo, as lm-eval asks for them)."""
    return 0 if params.prompt_logprobs is not None else 1


def _check_options(params: SamplingParams) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not -2 <= value <= 2:
            raise RequestError(f"{name} must be in [-2, 2], not {value}", param=name)
    low, high = REPETITION_PENALTY_RANGE
    if not low <= params.repetition_penalty <= high:  # NaN fails this too
        raise RequestError(
            f"repetition_penalty must be in [{low}, {high}], not {params.repetition_penalty}",
            param="repetition_penalty",
        )
    if not 0 <= params.min_p <= 1:
        raise RequestError(f"min_p must be in [0, 1], not {params.min_p}", param="min_p")
    if params.min_tokens < 0 or (
        params.max_tokens is not None and params.min_tokens > params.max_tokens
    ):
        raise RequestError(
            f"min_tokens must be in [0, max_tokens], not {params.min_tokens}", param="min_tokens"
        )
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise RequestError(f"{name} must be in [0, {MAX_LOGPROBS}], not {k}", param=name)
    for token, bias in params.logit_bias:
        if not math.isfinite(bias):
            raise RequestError(f"logit_bias for token {token} is not finite", "logit_bias")
    if params.allowed_token_ids is not None and not params.allowed_token_ids:
        raise RequestError("allowed_token_ids is empty", param="allowed_token_ids")


def _check_values(params: SamplingParams) -> None:
    t = params.temperature
    if not math.isfinite(t) or t < 0:
        raise RequestError(f"temperature must be a finite number >= 0, not {t}", "temperature")
    if 0 < t < MIN_TEMPERATURE:
        raise RequestError(
            f"temperature {t} is too small to sample with",
            param="temperature",
            hint=f"use 0 for greedy decoding, or a temperature >= {MIN_TEMPERATURE}",
        )
    low, high = SEED_RANGE
    if params.seed is not None and _is_int(params.seed) and not low <= params.seed < high:
        raise RequestError(f"seed must be in [-2**63, 2**64), not {params.seed}", "seed")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_types(params: SamplingParams) -> None:
    """Callers that skip the HTTP schema (generate --jsonl) can hand over any JSON value."""
    numbers: dict[str, object] = {
        "temperature": params.temperature, "top_p": params.top_p, "min_p": params.min_p,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
    }  # fmt: skip
    for name, value in numbers.items():
        if not (_is_int(value) or isinstance(value, float)):
            raise RequestError(f"{name} must be a number, not {value!r}", param=name)
    integers: dict[str, object] = {
        "top_k": params.top_k,
        "seed": params.seed,
        "max_tokens": params.max_tokens,
        "min_tokens": params.min_tokens,
        "logprobs": params.logprobs,
        "prompt_logprobs": params.prompt_logprobs,
    }
    for name in ("stop_token_ids", "allowed_token_ids"):
        ids = getattr(params, name)
        if ids is not None and not all(_is_int(t) for t in ids):
            raise RequestError(f"{name} must be a list of token ids", param=name)
    for name, value in integers.items():
        if value is not None and not _is_int(value):
            raise RequestError(f"{name} must be an integer, not {value!r}", param=name)
    if not isinstance(params.ignore_eos, bool):
        raise RequestError(f"ignore_eos must be true or false, not {params.ignore_eos!r}")
    if not isinstance(params.stop, tuple | list) or not all(
        isinstance(s, str) for s in params.stop
    ):
        raise RequestError("stop must be a string or a list of strings", param="stop")


def make_generator(seed: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of [rows, vocab] logits, with numpy.

    One SIMD pass on the calling thread. torch.argmax splits a vocabulary-sized row over its
    OpenMP pool, and handing that off costs more than the pass: on the 2-core AMD EPYC host
    of docs/performance.md, under load, 3.1 ms against numpy's 52 us for 8 x 49152 logits
    (278 us against 7 us for one row). NaN wins, as in torch.

    bfloat16 (which numpy lacks) is widened here too: its bits are a float32's top half, so a
    shift gives the float32 values. torch's `.float()` of a vocabulary-sized row is an OpenMP
    op with the same hand-off: 0.24 ms of every batch-8 engine step (cProfile, on a runner
    that costs nothing), and 11 ms under load, against 0.13 ms for the shift."""
    t = logits.detach()
    if t.dtype == torch.bfloat16:
        bits = t.view(torch.int16).numpy()
        values = (bits.astype(np.int32) << 16).view(np.float32)
    elif t.dtype in (torch.float32, torch.float64, torch.float16):
        values = t.numpy()
    else:
        values = t.float().numpy()
    return list(values.argmax(axis=-1).tolist())


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """One token from [vocab] float logits; params must have gone through `resolve_params`."""
    if params.greedy:
        return argmax_rows(logits.unsqueeze(0))[0]
    values, indices = torch.topk(logits.float(), min(params.top_k, logits.numel()))
    # values are sorted: subtracting the largest keeps every exponent <= 0 (no overflow).
    probs = torch.softmax((values - values[0]) / params.temperature, dim=-1)
    if params.min_p > 0:  # relative to the most likely token, which is probs[0]
        probs = torch.where(probs >= params.min_p * probs[0], probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    if params.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        # The comparison runs in the logits' float32, where a top_p below ~1e-45 is 0: the
        # first token is kept explicitly, not by `0 < top_p`.
        before = torch.cumsum(probs, dim=-1) - probs
        keep = before < params.top_p
        keep[0] = True
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    choice = torch.multinomial(probs, 1, generator=gen)
    return int(indices[choice])


@dataclass(frozen=True)
class TokenLogprob:
    """A token's logprob under the raw logits, and the `top` most likely tokens' (k of them,
    most likely first). `log_softmax` of the same logits, in float32."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Pick:
    token_id: int
    logprob: TokenLogprob | None = None  # when the request asked for logprobs


class RowState(Protocol):
    """What sampling needs to know about one row's request (engine.request.Request)."""

    @property
    def params(self) -> SamplingParams: ...
    @property
    def generator(self) -> torch.Generator: ...
    @property
    def prompt_ids(self) -> Sequence[int]: ...
    @property
    def output_ids(self) -> Sequence[int]: ...


def sample_step(
    logits: torch.Tensor,
    rows: Sequence[int],
    states: Sequence[RowState],
    eos_ids: Collection[int] = (),
) -> list[Pick | Exception]:
    """One token per listed row of [batch, vocab] logits (row `rows[i]` for `states[i]`), or
    the exception that row raised; a row that fails never fails the others.

    Greedy rows without options (the common case) share one argmax; only rows that ask for
    more pay for it: options (penalties, bias, min_tokens) and sampling one row at a time,
    logprobs in one batched log_softmax over the rows that want them."""
    if all(s.params.plain for s in states) and list(rows) == list(range(logits.shape[0])):
        return [Pick(t) for t in argmax_rows(logits)]  # the whole batch, no gather
    out: list[Pick | Exception] = [Pick(0)] * len(rows)
    direct = [i for i, s in enumerate(states) if s.params.argmax_picks]
    if direct:
        picked = argmax_rows(logits[[rows[i] for i in direct]])
        for i, token in zip(direct, picked, strict=True):
            out[i] = Pick(token)
    for i, state in enumerate(states):
        if not state.params.argmax_picks:
            try:
                out[i] = Pick(_pick(logits[rows[i]], state, eos_ids))
            except Exception as exc:  # e.g. NaN logits in this row: only this request fails
                out[i] = exc
    _add_logprobs(logits, rows, states, out)
    return out


def _pick(row: torch.Tensor, state: RowState, eos_ids: Collection[int]) -> int:
    params = state.params
    if params.processed:
        row = apply_options(row, params, state.prompt_ids, state.output_ids, eos_ids)
    if params.greedy:
        return argmax_rows(row.unsqueeze(0))[0]
    return sample(row, params, state.generator)


def apply_options(
    row: torch.Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    eos_ids: Collection[int] = (),
) -> torch.Tensor:
    """vLLM's logits processors on one [vocab] row, in its order: allowed_token_ids (every
    other token masked), logit_bias, min_tokens (EOS and stop_token_ids masked), then
    repetition (prompt and output tokens), frequency and presence (output tokens) penalties.
    Returns a new float32 row."""
    row = row.float().clone()
    if params.allowed_token_ids is not None:
        keep = torch.full_like(row, -math.inf)
        allowed = params.allowed_tensor
        keep[allowed] = row[allowed]
        row = keep
    if params.logit_bias:
        ids, bias = params.bias_tensors
        row.index_add_(0, ids, bias)
    stops = {*eos_ids, *params.stop_token_ids}
    if len(output_ids) < params.min_tokens and stops:
        row[sorted(stops)] = -math.inf
    if params.repetition_penalty != 1:
        seen = torch.tensor(sorted({*prompt_ids, *output_ids}), dtype=torch.long)
        values = row[seen]
        p = params.repetition_penalty
        row[seen] = torch.where(values > 0, values / p, values * p)
    if output_ids and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output_ids), minlength=row.numel()).float()
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return row


def _add_logprobs(
    logits: torch.Tensor, rows: Sequence[int], states: Sequence[RowState], out: list
) -> None:
    want = [i for i, s in enumerate(states)
            if s.params.logprobs is not None and isinstance(out[i], Pick)]  # fmt: skip
    if not want:
        return
    found = token_logprobs(
        logits[[rows[i] for i in want]],
        [out[i].token_id for i in want],
        [states[i].params.logprobs or 0 for i in want],
    )
    for i, logprob in zip(want, found, strict=True):
        out[i] = Pick(out[i].token_id, logprob)


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], ks: Sequence[int]
) -> list[TokenLogprob]:
    """For row j of [rows, vocab] logits: log_softmax's value at token_ids[j] and its top
    ks[j] entries. One batched log_softmax; the top-k is taken once for the largest k."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(1, torch.tensor(token_ids, dtype=torch.long).unsqueeze(1))[:, 0]
    k = max(ks, default=0)
    top_values, top_ids = torch.topk(logp, k, dim=-1) if k else (logp[:, :0], logp[:, :0])
    values, ids, picked_list = top_values.tolist(), top_ids.long().tolist(), picked.tolist()
    return [
        TokenLogprob(token_ids[j], picked_list[j],
                     tuple(zip(ids[j][:ks[j]], values[j][:ks[j]], strict=True)))
        for j in range(len(token_ids))
    ]  # fmt: skip
