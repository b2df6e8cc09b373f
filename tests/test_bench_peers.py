"""bench/peers.py survives a peer that crashes: reported, a fallback measures, never dies.

The crash it must survive: llama.cpp's AMX repack buffers, its default on a CPU with AMX,
built with GCC 12, segfault on any multi-token llama_decode but decode one token fine. The
default configuration is llama.cpp's own (`llama_model_default_params`, use_extra_bufts =
true: vendor/llama.cpp/src/llama-model.cpp, make_cpu_buft_list, in abetlen/llama-cpp-python).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
import peers  # noqa: E402


class FakeWorker:
    """A worker whose configuration crashes on the operations `dies_on` names."""

    def __init__(self, spec: dict[str, Any], dies_on: set[str]) -> None:
        self.spec, self.dies_on = spec, dies_on

    def ask(self, **request: Any) -> float:
        if request["op"] in self.dies_on:
            raise peers.WorkerDied(-11)
        return {"default": 1.0, "decode-only": 2.0, "no-repack": 3.0}[self.spec["mode"]]

    def close(self) -> None:
        pass


def amx_host(crashing: dict[str, set[str]]):  # type: ignore[no-untyped-def]
    started: list[str] = []

    def start(spec: dict[str, Any], threads: int) -> FakeWorker:
        started.append(spec["mode"])
        if "load" in crashing.get(spec["mode"], set()):
            raise peers.WorkerDied(-11)
        return FakeWorker(spec, crashing.get(spec["mode"], set()))

    return start, started


def llama_spec(n_seq: int) -> dict[str, Any]:
    return {"kind": "llama.cpp", "path": "m.gguf", "n_seq": n_seq, "threads": 2,
            "mode": "default"}


def test_the_default_is_tried_first_and_a_crash_falls_back_to_decode_only() -> None:
    start, started = amx_host({"default": {"ttft"}})  # multi-token batches crash
    notes: list[str] = []
    system = peers.System("llama.cpp", "bfloat16 batch 1", llama_spec(1), 2, notes, start)
    tok_s, secs, crashed = peers.measure(system, 1, wants_ttft=True)
    assert started == ["default", "decode-only"]
    assert (tok_s, secs, crashed) == (2.0, 2.0, True)  # both from decode-only
    assert system.mode == "decode-only"
    assert notes == ["bfloat16 batch 1: llama.cpp (default) died during ttft (exit -11); "
                     "falling back to decode-only"]
    assert peers.measure(system, 1, wants_ttft=True) == (2.0, 2.0, False)


def test_a_batch_falls_back_past_decode_only_and_a_dead_peer_is_left_out() -> None:
    start, started = amx_host({"default": {"decode"}, "no-repack": {"load"}})
    notes: list[str] = []
    system = peers.System("llama.cpp", "bfloat16 batch 8", llama_spec(8), 2, notes, start)
    assert peers.measure(system, 8, wants_ttft=False) == (None, None, True)
    assert started == ["default", "no-repack"]  # decode-only serves one sequence only
    assert notes[-1] == ("bfloat16 batch 8: llama.cpp (no-repack) died during load (exit "
                         "-11); no configuration left: left out of this row")
    assert system.decode(8) is None  # and stays out, without dying


@pytest.mark.parametrize("flags,target", [("avx2 fma", 1.4), ("avx2 fma avx512_vnni", 1.6)])
def test_the_int8_target_is_per_host_class(flags: str, target: float) -> None:
    assert peers.int8_target(flags) == target


def test_a_real_worker_that_dies_at_load_is_reported(tmp_path: Path) -> None:
    notes: list[str] = []
    spec = {**llama_spec(8), "path": str(tmp_path / "missing.gguf")}
    system = peers.System("llama.cpp", "float32 batch 8", spec, 1, notes)
    assert system.decode(8) is None
    assert [n.split(" died during ")[1].split(";")[0] for n in notes] == ["load (exit 1)"] * 2


class Drifting:
    """A system on a host whose speed falls 10 % before each pair (`first` moves the clock),
    as this host's read bandwidth fell within a run; `scale` is its speed over the other's."""

    def __init__(self, clock: list[float], scale: float, first: bool) -> None:
        self.clock, self.scale, self.first = clock, scale, first

    def decode(self, batch: int) -> float:
        if self.first:
            self.clock[0] *= 0.9
        return 100.0 * self.scale * self.clock[0]


def test_served_over_the_runner_is_the_median_of_back_to_back_pairs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Best-of-rounds figures of the Runner and the Engine come from different minutes: one
    run read 0.85 for fp32 batch 8 on unchanged code while the host's read bandwidth fell
    14 %. Each pair is measured back to back, so a drift moves both sides alike; the report
    says which figure it used."""
    clock = [1.0]
    systems = {"float32 batch 8": {"neuronctl": Drifting(clock, 1.0, first=True),
                                   "engine": Drifting(clock, 0.95, first=False)}}  # fmt: skip
    rows = [("float32 batch 8", "float32", 8, False)]
    ratios = peers.served_pairs(systems, rows, 3)  # type: ignore[arg-type]
    assert [round(r, 3) for r in ratios["float32 batch 8"]] == [0.95] * 3
    decode = {("float32 batch 8", "neuronctl"): [100.0], ("float32 batch 8", "engine"): [60.0]}
    facts = {"cpu": "c", "class": "k", "flags": "avx2", "isa": "i", "half_units": "no",
             "threads": 2, "read_bandwidth_gbs": 1, "read_bandwidth_gbs_after": 1,
             "torch": "t"}  # fmt: skip
    peers.report(facts, rows, decode, {}, {}, [], ratios, {}, [])
    line = next(x for x in capsys.readouterr().out.splitlines() if "through the engine" in x)
    assert "0.95x (median of 3 back-to-back pairs), met" in line
