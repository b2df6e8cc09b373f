"""FakeRunner: a stand-in for a loaded artifact, for engine/server tests. Not a model.

Its next-token logits are a pure function of the slot's whole token history (a hash seeds
them), so a scheduling bug — a token written to the wrong slot or position, a stale cache
after a slot is reused — changes every later token. It is strict like Neuron's static cache
(KvCache): a decode must write exactly at the next free position of its slot, and any write
into a slot's history fails the test.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from neuronctl.engine.tokenizer import EngineTokenizer, TokenizedText

EOS_ID = 257  # tests/helpers.py's byte-level tokenizer: <s>=256, </s>=257, <pad>=258
BYTE_TOKENS = 256


class KvCache:
    """A static KV cache as the Runner contract sees it: `batch_size` slots of `seq_len`
    positions, each holding the history (tokens) of the sequence prefilled into it.

    `write` is what a device does for every row of a decode, live or idle: it fails the test
    when it lands inside a slot's history, which is a live sequence's cached token being
    replaced (Runner.decode's invariant). Only the caller knows whether a row was live:
    `append` then adds its token to the history. The Neuron SDK stand-ins write into the one
    in `standin_recorder.KV` when a test sets it.
    """

    def __init__(self, batch_size: int, seq_len: int) -> None:
        self.seq_len = seq_len
        self.history: list[list[int]] = [[] for _ in range(batch_size)]
        self.writes = 0

    def prefill(self, slot: int, token_ids: Sequence[int]) -> None:
        if not 0 < len(token_ids) <= self.seq_len:
            raise AssertionError(f"slot {slot}: prefill of {len(token_ids)} tokens")
        self.history[slot] = list(token_ids)

    def write(self, slot: int, pos: int) -> None:
        held = len(self.history[slot])
        if not 0 <= pos < self.seq_len:
            raise AssertionError(f"slot {slot}: write at {pos}, outside 0..{self.seq_len - 1}")
        if pos < held and held < self.seq_len:
            raise AssertionError(
                f"slot {slot}: write at {pos} replaces a token of the {held}-token sequence "
                "it holds"
            )
        self.writes += 1

    def commit(self, slot: int, pos: int, token: int) -> None:
        """A live row's token joins its sequence: it was written at the next free position."""
        if pos != len(self.history[slot]):
            raise AssertionError(
                f"slot {slot}: write at {pos}, but {len(self.history[slot])} filled"
            )
        self.history[slot].append(token)

    def append(self, slot: int, pos: int, token: int) -> None:
        """A live row's write and commit."""
        self.write(slot, pos)
        self.commit(slot, pos, token)


def decode_beside_a_fresh_prefill(runner: Any, kv: KvCache) -> None:
    """The engine's step order over a Runner whose device writes into `kv`: slot 0 decodes,
    then slot 1 is prefilled with a longer prompt and stays idle (-1) in the same step's
    decode, then both decode. The first decode after the prefill is where a runner that
    parks idle rows at position 0 overwrites slot 1's prompt (KvCache.write fails)."""
    batch = runner.batch_size
    runner.prefill(0, [5, 6, 7, 8])
    steps = [({0: 4}, None), ({0: 5}, (1, [9, 10, 11, 12, 13, 14, 15])), ({0: 6, 1: 7}, None)]
    for live, admit in steps:
        if admit is not None:
            runner.prefill(*admit)
        tokens, positions = [0] * batch, [-1] * batch
        for slot, pos in live.items():
            tokens[slot], positions[slot] = 40 + pos, pos
        runner.decode(tokens, positions)
        for slot, pos in live.items():
            kv.commit(slot, pos, tokens[slot])
    assert [len(h) for h in kv.history[:2]] == [7, 8]


class FakeRunner:
    def __init__(
        self,
        batch_size: int = 4,
        seq_len: int = 64,
        max_context_length: int | None = None,
        vocab_size: int = 320,
        eos_every: int = 0,  # > 0: EOS becomes likely about once in this many histories
        step_delay: float = 0.0,  # seconds per prefill / decode call, to make queues build up
        fail_prefill_on: int | None = None,  # a first prompt token that makes prefill raise
        nan_on: int | None = None,  # a first prompt token whose slot gets NaN logits
        batched_prefill: bool = True,  # offer the optional Runner.prefill_batch
    ) -> None:
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.max_context_length = max_context_length or seq_len
        self.context_buckets = [self.max_context_length]
        self.token_gen_buckets = [seq_len]
        self.vocab_size = vocab_size
        self.eos_every = eos_every
        self.step_delay = step_delay
        self.fail_prefill_on = fail_prefill_on
        self.nan_on = nan_on
        if not batched_prefill:
            self.prefill_batch = None  # type: ignore[assignment]
        self.prefill_calls: list[int] = []  # prompts per prefill call (1 for plain prefill)
        self.kv = KvCache(batch_size, seq_len)
        self.history = self.kv.history  # per slot: the tokens its sequence holds
        self.prefills = 0
        self.decodes = 0
        self.max_live = 0  # most slots live in one decode step
        self._lock = threading.Lock()  # the engine must call from one thread at a time

    def logits_for(self, history: Sequence[int]) -> torch.Tensor:
        digest = hashlib.sha256(",".join(map(str, history)).encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        logits = torch.full((self.vocab_size,), float("-inf"))
        logits[:BYTE_TOKENS] = torch.randn(BYTE_TOKENS, generator=gen) * 3
        if self.eos_every and digest[8] % self.eos_every == 0:
            logits[EOS_ID] = 50.0
        else:
            logits[EOS_ID] = -5.0
        return logits

    def logits_of_slot(self, slot: int) -> torch.Tensor:
        history = self.history[slot]
        if self.nan_on is not None and history[0] == self.nan_on:
            return torch.full((self.vocab_size,), float("nan"))
        return self.logits_for(history)

    def prefill(self, slot: int, token_ids: Sequence[int]) -> torch.Tensor:
        with self._lock:
            self._sleep()
            self.prefill_calls.append(1)
            return self._encode(slot, token_ids)

    def prefill_batch(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """The optional Runner method: several prompts in one call (one step's delay)."""
        with self._lock:
            self._sleep()
            if len(slots) != len(prompts) or len(set(slots)) != len(slots):
                raise AssertionError("prefill_batch takes one distinct slot per prompt")
            self.prefill_calls.append(len(prompts))
            return torch.stack([self._encode(s, p) for s, p in zip(slots, prompts, strict=True)])

    def _encode(self, slot: int, token_ids: Sequence[int]) -> torch.Tensor:
        if self.fail_prefill_on is not None and token_ids[0] == self.fail_prefill_on:
            raise RuntimeError("injected prefill failure")
        if not 0 < len(token_ids) <= self.max_context_length:
            raise AssertionError(f"prefill of {len(token_ids)} tokens")
        self.kv.prefill(slot, token_ids)
        self.prefills += 1
        return self.logits_of_slot(slot)

    def decode(self, token_ids: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        with self._lock:
            self._sleep()
            if len(token_ids) != self.batch_size or len(positions) != self.batch_size:
                raise AssertionError("decode must pass one entry per slot")
            out = torch.zeros(self.batch_size, self.vocab_size)
            live = 0
            for slot, (token, pos) in enumerate(zip(token_ids, positions, strict=True)):
                if pos < 0:
                    continue  # the ideal runner: an idle row writes nothing
                self.kv.append(slot, pos, token)
                out[slot] = self.logits_of_slot(slot)
                live += 1
            self.decodes += 1
            self.max_live = max(self.max_live, live)
            return out

    def _sleep(self) -> None:
        if self.step_delay:
            time.sleep(self.step_delay)


def byte_detokenize(token_ids: Sequence[int]) -> str:
    """Bytes as Latin-1 characters; specials vanish (as with skip_special_tokens)."""
    return "".join(chr(t) for t in token_ids if t < BYTE_TOKENS)


def byte_decoder() -> Callable[[int], str]:
    """The engine's per-request incremental detokenizer for byte tokens."""
    return lambda t: chr(t) if t < BYTE_TOKENS else ""


class FakeTextModel(TokenizedText):
    """The TextModel the server needs, over a tokenizer directory (e.g. a tiny checkpoint)."""

    def __init__(self, tokenizer_dir: str) -> None:
        self.tokenizer = EngineTokenizer.load(Path(tokenizer_dir))


def main(argv: Sequence[str]) -> None:
    import sys

    """`python -m tests.fake_runner --tokenizer DIR --port N ...`: the real server over a
    FakeRunner, for tests that need slow, predictable steps (queue limits, SIGTERM drain)."""
    import argparse

    from neuronctl.engine.engine import Engine
    from neuronctl.server.app import Limits
    from neuronctl.server.run import run_server

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--step-delay", type=float, default=0.05)
    parser.add_argument("--max-queue", type=int, default=1)
    parser.add_argument("--api-key")
    parser.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024)
    parser.add_argument("--max-prompt-chars", type=int)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    runner = FakeRunner(args.batch_size, args.seq_len, step_delay=args.step_delay)
    engine = Engine(runner, byte_decoder, eos_ids=[EOS_ID], max_queue=args.max_queue)
    run_server(
        engine,
        FakeTextModel(args.tokenizer),
        served_model_name="fake",
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        max_model_len=args.seq_len,
        log_level=args.log_level,
        limits=Limits(args.max_body_bytes, args.max_prompt_chars),
        on_ready=lambda: print("serving on", args.port, file=sys.stderr, flush=True),
    )


if __name__ == "__main__":
    import sys as _sys

    main(_sys.argv[1:])
