"""Queue limits count only requests that have no free slot to go to."""

from __future__ import annotations

import pytest

from neuronctl.engine.engine import Engine
from neuronctl.engine.errors import QueueFullError
from neuronctl.engine.sampling import SamplingParams
from tests.fake_runner import EOS_ID, FakeRunner, byte_decoder

GREEDY = SamplingParams(temperature=0, max_tokens=3)


def test_a_burst_into_free_slots_is_not_refused_as_a_full_queue() -> None:
    """`--max-queue 0`: no waiting, but every free slot takes a request. Submissions that
    arrive before the engine thread admits them (a burst, or an engine not yet started)
    must not count as queued while slots are free."""
    engine = Engine(FakeRunner(batch_size=2), byte_decoder, eos_ids=[EOS_ID], max_queue=0)
    handles = [engine.submit([1], GREEDY), engine.submit([2], GREEDY)]
    with pytest.raises(QueueFullError):
        engine.submit([3], GREEDY)
    engine.start()
    assert all(h.result().finish_reason in ("stop", "length") for h in handles)
    engine.stop()


def test_queue_limit_applies_beyond_the_free_slots() -> None:
    engine = Engine(FakeRunner(batch_size=2), byte_decoder, eos_ids=[EOS_ID], max_queue=1)
    handles = [engine.submit([i], GREEDY) for i in range(3)]  # 2 slots + 1 queue place
    with pytest.raises(QueueFullError):
        engine.submit([9], GREEDY)
    engine.start()
    assert len([h.result() for h in handles]) == 3
    engine.stop()
