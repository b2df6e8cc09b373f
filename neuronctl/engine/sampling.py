"""Sampling parameters, their on-device rules, and the sampler itself.

The rules follow NxD Inference's on-device sampling (seed 002): temperature 0 means greedy
(the same as top_k 1); top_k -1 (or 0, "disabled") is capped at the artifact's global top_k
(256 by default); a top_k above that cap is refused rather than silently lowered.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from neuronctl.engine.errors import RequestError

DEFAULT_GLOBAL_TOPK = 256
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


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None  # None: up to the end of the sequence
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def resolve(params: SamplingParams, global_topk: int = DEFAULT_GLOBAL_TOPK) -> SamplingParams:
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
    if params.max_tokens is not None and params.max_tokens < 1:
        raise RequestError("max_tokens must be >= 1", param="max_tokens")
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
    numbers: dict[str, object] = {"temperature": params.temperature, "top_p": params.top_p}
    for name, value in numbers.items():
        if not (_is_int(value) or isinstance(value, float)):
            raise RequestError(f"{name} must be a number, not {value!r}", param=name)
    integers: dict[str, object] = {
        "top_k": params.top_k,
        "seed": params.seed,
        "max_tokens": params.max_tokens,
    }
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
    (278 us against 7 us for one row). NaN wins, as in torch."""
    t = logits.detach()
    if t.dtype not in (torch.float32, torch.float64, torch.float16):
        t = t.float()  # bfloat16: numpy has no such type
    return list(t.numpy().argmax(axis=-1).tolist())


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """One token from [vocab] float logits; params must have gone through `resolve`."""
    if params.greedy:
        return argmax_rows(logits.unsqueeze(0))[0]
    values, indices = torch.topk(logits.float(), min(params.top_k, logits.numel()))
    # values are sorted: subtracting the largest keeps every exponent <= 0 (no overflow).
    probs = torch.softmax((values - values[0]) / params.temperature, dim=-1)
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


def sample_rows(
    logits: torch.Tensor,
    rows: Sequence[int],
    params: Sequence[SamplingParams],
    gens: Sequence[torch.Generator],
) -> list[int | Exception]:
    """One token per listed row of [batch, vocab] logits, or the exception that row raised.

    Greedy rows (the common case) cost one argmax over the rows that are greedy; only the
    sampled rows pay for top-k and a draw. A row that fails never fails the others."""
    out: list[int | Exception] = [0] * len(rows)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if len(greedy) == len(rows) and list(rows) == list(range(logits.shape[0])):
        return list(argmax_rows(logits))  # the whole batch, no gather
    if greedy:
        picked = argmax_rows(logits[[rows[i] for i in greedy]])
        for i, token in zip(greedy, picked, strict=True):
            out[i] = token
    for i, p in enumerate(params):
        if not p.greedy:
            try:
                out[i] = sample(logits[rows[i]], p, gens[i])
            except Exception as exc:  # e.g. NaN logits in this row: only this request fails
                out[i] = exc
    return out
