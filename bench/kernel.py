"""neuronctl's matmul kernel alone, over one decode step's matrices, on both weight layouts,
against torch's own.

    python bench/kernel.py                # float32, bf16, int8; 1, 8 and 64 rows (a few minutes)
    python bench/kernel.py --dtypes float32 --rows 1

The matrices are a decode step's for the SmolLM2-135M shape (bench/decode.py's SHAPE: q/k/v
and gate/up fused as the graphs hold them, every layer, the LM head), random; 64 rows is a
context bucket's worth. Each round runs, back to back:
- the kernel on blocked weights (linear_blocked) in one 2 MiB-page mapping, as the runner
  holds them (kernel.into_huge_pages), and the same blocked weights in ordinary 4 KiB pages;
- the kernel on the plain [N, K] weights (linear_rows), also in 2 MiB pages: the one copy a
  per-row-count choice of path keeps, which the torch systems below read too;
- aten's F.linear with the weight widened to the float32 of the activations per call
  (linear.linear: what a float32 graph without the kernel runs);
- for int8 up to 8 rows, aten._weight_int8pack_mm (aten's weight-only int8 kernel);
- where oneDNN runs the dtype natively (linear.can_pack: float32, and bf16 on a CPU with
  bf16 units), oneDNN's linear on weights packed for the row count (linear.packed_linear);
- a float32 sum over as many bytes: the read bandwidth this minute.
Every figure is the median over the rounds (JSON lines give the best too). GB/s counts each
weight byte once per step, so above a few rows (compute-bound) it is a speed, not traffic.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
from decode import SHAPE  # noqa: E402
from peers import host_facts  # noqa: E402

from neuronctl.backends.torch import kernel  # noqa: E402
from neuronctl.backends.torch.linear import can_pack, linear, pack_weight, packed_linear  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


def step_shapes() -> list[tuple[int, int]]:
    """[N, K] of every matmul in one decode step, in the order the graph runs them."""
    hidden, inter = int(SHAPE["hidden_size"]), int(SHAPE["intermediate_size"])
    head = hidden // int(SHAPE["num_attention_heads"])
    qkv = hidden + 2 * head * int(SHAPE["num_key_value_heads"])
    layer = [(qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    return layer * int(SHAPE["num_hidden_layers"]) + [(int(SHAPE["vocab_size"]), hidden)]


def plain_weights(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for n, k in step_shapes():
        w = torch.randn(n, k, generator=gen) * 0.02
        if dtype == torch.int8:
            scale = w.abs().amax(1) / 127
            out.append(((w / scale[:, None]).round().to(torch.int8), scale.bfloat16()))
        else:
            out.append((w.to(dtype), None))
    return out


# aten's weight-only int8 kernel serves token generation (linear.int8_linear); at a context
# bucket (64 rows) it takes ~30 s a step on an AVX2 host, so it is left out above this.
WEIGHT_ONLY_ROWS = 8


def systems(dtype: torch.dtype, rows: int) -> dict[str, Callable[[], object]]:
    """name -> one decode step's matmuls."""
    plain = plain_weights(dtype)
    blocked = {str(i): kernel.block(w) for i, (w, _) in enumerate(plain)}
    huge = dict(blocked)
    kernel.into_huge_pages(huge, list(huge))
    rows_huge = {str(i): w for i, (w, _) in enumerate(plain)}
    kernel.into_huge_pages(rows_huge, list(rows_huge))
    steps = [(rows_huge[str(i)], s) for i, (_, s) in enumerate(plain)]  # plain, 2 MiB pages
    x = {k: torch.randn(rows, k) for k in {k for _, k in step_shapes()}}

    def run(op: Callable[..., object], weights: list[torch.Tensor],
            act: torch.dtype = torch.float32) -> Callable[[], object]:
        """op(x, w, scale) over the step, activations in `act`."""
        calls = [(w, s, x[k].to(act))
                 for w, (_, s), (_, k) in zip(weights, plain, step_shapes(), strict=True)]
        return lambda: [op(xi, w, s) for w, s, xi in calls]

    def blocked_list(weights: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return [weights[str(i)] for i in range(len(plain))]

    out = {
        "kernel blocked": run(torch.ops.neuronctl.linear_blocked, blocked_list(huge)),
        "kernel blocked, 4 KiB pages": run(torch.ops.neuronctl.linear_blocked,
                                           blocked_list(blocked)),
        "kernel plain": run(torch.ops.neuronctl.linear_rows, [w for w, _ in steps]),
        "aten F.linear, widened": run(lambda xi, w, s: linear(xi, w, None, s),
                                      [w for w, _ in steps]),
    }
    if dtype == torch.int8 and rows <= WEIGHT_ONLY_ROWS:
        out["aten int8 weight-only"] = run(
            lambda xi, w, s: torch.ops.aten._weight_int8pack_mm(xi, w, s.float()),
            [w for w, _ in steps])
    if can_pack(dtype):
        packed = [pack_weight(w, rows) for w, _ in steps]
        out["oneDNN packed"] = run(lambda xi, w, s: packed_linear(xi, w), packed, dtype)
    ones = torch.ones(sum(w.nbytes for w, _ in plain) // 4)
    out["read (float32 sum)"] = lambda: ones.sum()
    return out


def measure(dtype_name: str, rows: int, rounds: int) -> dict[str, dict[str, float]]:
    dtype = DTYPES[dtype_name]
    runs = systems(dtype, rows)
    nbytes = sum(n * k for n, k in step_shapes()) * dtype.itemsize  # the weights, once
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds + 2):  # the first two warm up
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    out = {}
    for name, ts in times.items():
        med, best = statistics.median(ts[2:]), min(ts[2:])
        out[name] = {"median_ms": med * 1e3, "best_ms": best * 1e3, "gbs": nbytes / med / 1e9}
        print(json.dumps({"dtype": dtype_name, "rows": rows, "system": name,
                          **{k: round(v, 2) for k, v in out[name].items()}}), flush=True)
    return out


COLUMNS = ["kernel blocked", "kernel blocked, 4 KiB pages", "kernel plain",
           "aten F.linear, widened", "aten int8 weight-only", "oneDNN packed"]


def table(results: list[tuple[str, int, dict[str, dict[str, float]]]]) -> list[str]:
    """A markdown table: per dtype and row count, each system's ms and GB/s, plain's speed
    over blocked's, and the read bandwidth."""
    shown = [c for c in COLUMNS if any(c in got for _, _, got in results)]
    lines = ["| weights | rows | " + " | ".join(f"{c} ms (GB/s)" for c in shown)
             + " | plain / blocked | read GB/s |",
             "| --- | --- |" + " --- |" * (len(shown) + 2)]
    for dtype, rows, got in results:
        cells = [f"{got[c]['median_ms']:.1f} ({got[c]['gbs']:.1f})" if c in got else "–"
                 for c in shown]
        ratio = got["kernel blocked"]["median_ms"] / got["kernel plain"]["median_ms"]
        lines.append(f"| {dtype} | {rows} | " + " | ".join(cells)
                     + f" | {ratio:.2f}x | {got['read (float32 sum)']['gbs']:.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16,int8")
    parser.add_argument("--rows", default="1,8,64", help="activation rows (batch, bucket)")
    parser.add_argument("--rounds", type=int, default=15)
    opts = parser.parse_args()
    kernel.load()
    facts = host_facts()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    facts["transparent_hugepages"] = thp.read_text().strip() if thp.exists() else "none"
    print(json.dumps({"host": facts}), flush=True)
    results = [(dtype, rows, measure(dtype, rows, opts.rounds))
               for dtype in opts.dtypes.split(",") for rows in map(int, opts.rows.split(","))]
    print(f"\nhost: {facts['cpu']}; ISA {facts['isa']}; {facts['threads']} threads; "
          f"transparent huge pages {facts['transparent_hugepages']}; torch {facts['torch']}\n")
    print("\n".join(table(results)))
    print("\nmedians over the rounds; plain / blocked is the plain layout's speed over the "
          "blocked one's (> 1: plain is faster)")


if __name__ == "__main__":
    main()
