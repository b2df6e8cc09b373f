"""neuronctl's matmul kernel alone, over one decode step's matrices, against torch's own.

    python bench/kernel.py                # float32, bf16, int8; batch 1 and 8 (about 2 minutes)
    python bench/kernel.py --dtypes float32 --rows 1

The matrices are a decode step's for the SmolLM2-135M shape (bench/decode.py's SHAPE: q/k/v
and gate/up fused as the graphs hold them, every layer, the LM head), random. Each round
runs, back to back:
- the kernel on blocked weights in one 2 MiB-page mapping, as the runner holds them
  (kernel.into_huge_pages);
- the kernel on the same blocked weights in ordinary 4 KiB pages;
- torch's own matmul on plain weights: F.linear for float32 and bf16 (a bf16 matmul, what a
  bf16 graph without the kernel runs), aten._weight_int8pack_mm for int8;
- a float32 sum over as many bytes: the read bandwidth this minute.
Every figure is the median over the rounds (the best is printed too). Ratios are the
kernel's speed over the others' (> 1: the kernel is faster); "of the read bandwidth" is the
kernel's bytes per second over the sum's.
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
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
from decode import SHAPE  # noqa: E402
from peers import host_facts  # noqa: E402

from neuronctl.backends.torch import kernel  # noqa: E402

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


def systems(dtype: torch.dtype, rows: int) -> dict[str, Callable[[], object]]:
    """name -> one decode step's matmuls."""
    plain = plain_weights(dtype)
    blocked = {str(i): kernel.block(w) for i, (w, _) in enumerate(plain)}
    huge = dict(blocked)
    kernel.into_huge_pages(huge, list(huge))
    x = {k: torch.randn(rows, k) for k in {k for _, k in step_shapes()}}
    op = torch.ops.neuronctl.linear_blocked

    def run_kernel(weights: dict[str, torch.Tensor]) -> Callable[[], object]:
        pairs = [(weights[str(i)], s, x[w.shape[1]]) for i, (w, s) in enumerate(plain)]
        return lambda: [op(xi, w, s) for w, s, xi in pairs]

    if dtype == torch.int8:
        pack = [(w, s.float(), x[w.shape[1]]) for w, s in plain]
        aten = lambda: [torch.ops.aten._weight_int8pack_mm(xi, w, s) for w, s, xi in pack]  # noqa: E731
    else:
        lin = [(w, x[w.shape[1]].to(dtype)) for w, _ in plain]
        aten = lambda: [F.linear(xi, w) for w, xi in lin]  # noqa: E731
    ones = torch.ones(sum(w.nbytes for w, _ in plain) // 4)
    return {"kernel, 2 MiB pages": run_kernel(huge), "kernel, 4 KiB pages": run_kernel(blocked),
            "torch": aten, "read (float32 sum)": lambda: ones.sum()}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16,int8")
    parser.add_argument("--rows", default="1,8", help="activation rows (the batch)")
    parser.add_argument("--rounds", type=int, default=15)
    opts = parser.parse_args()
    kernel.load()
    facts = host_facts()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    facts["transparent_hugepages"] = thp.read_text().strip() if thp.exists() else "none"
    print(json.dumps({"host": facts}), flush=True)
    table = []
    for dtype in opts.dtypes.split(","):
        for rows in map(int, opts.rows.split(",")):
            got = measure(dtype, rows, opts.rounds)
            k = got["kernel, 2 MiB pages"]["median_ms"]
            table.append((dtype, rows, got["kernel, 2 MiB pages"]["gbs"],
                          got["kernel, 4 KiB pages"]["median_ms"] / k,
                          got["torch"]["median_ms"] / k,
                          got["kernel, 2 MiB pages"]["gbs"] / got["read (float32 sum)"]["gbs"]))
    print(f"\nhost: {facts['cpu']}; ISA {facts['isa']}; {facts['threads']} threads; "
          f"transparent huge pages {facts['transparent_hugepages']}; torch {facts['torch']}\n")
    print("| weights | rows | kernel GB/s | vs 4 KiB pages | vs torch | of the read bandwidth |")
    print("| --- | --- | --- | --- | --- | --- |")
    for dtype, rows, gbs, pages, aten, share in table:
        print(f"| {dtype} | {rows} | {gbs:.1f} | {pages:.2f}x | {aten:.2f}x | {share:.2f} |")
    print("\nmedians over the rounds; ratios are the kernel's speed over the other's")


if __name__ == "__main__":
    main()
