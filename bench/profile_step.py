"""Where one decode step's time goes: the whole token-generation graph, profiled by op.

    python bench/profile_step.py                          # fp32 batch 1, SmolLM2-135M shape
    python bench/profile_step.py --dtype bfloat16 --batch 1 --steps 32
    python bench/profile_step.py --artifact PATH          # an artifact already compiled
    python bench/profile_step.py --threads 1              # a busy shared host

Compiles (or finds in a scratch store) bench/decode.py's SmolLM2-135M-shaped model as
bench/peers.py does (one 64-token context bucket, one 128-token generation bucket), loads
its Runner, prefills one prompt per slot, then times `--steps` decode steps bare (the step
time: the fastest and the median) and the same steps under torch.profiler. Prints the
artifact's op choice, then each op the profiler saw by its self time per step, grouped:

- matmul: the projections and the LM head (neuronctl::linear_*, oneDNN's
  mkldnn::_linear_pointwise, aten's mm/addmm/linear/int8 kernel);
- attention: neuronctl::attend, or aten's batched matmuls and softmax;
- other ops: everything else the dispatcher records (copies, index writes into the cache);
- unattributed: the step time less all of the above: inductor's own generated C++
  kernels (norms, rope, activations, residual adds, dtype casts) are not dispatcher ops.

The profiler's own overhead inflates the recorded ops a little; the bare step time is the
reference. The machine is shared: the fastest step is the figure to quote.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from decode import NEW, PROMPT, make_checkpoint  # noqa: E402
from opchoice import cpu_model  # noqa: E402

MATMUL = ("neuronctl::linear", "mkldnn::_linear_pointwise", "aten::mm", "aten::addmm",
          "aten::linear", "aten::matmul", "aten::_weight_int8pack_mm")
ATTENTION = ("neuronctl::attend", "aten::bmm", "aten::baddbmm", "aten::_softmax",
             "aten::softmax")


def compile_artifact(work: Path, dtype: str, batch: int) -> Path:
    from neuronctl.build import compile_model, resolve_build

    ckpt = make_checkpoint(work / "ckpt")
    spec: dict[str, Any] = {
        "dtype": dtype, "batch_size": batch, "seq_len": PROMPT + NEW,
        "max_context_length": PROMPT, "context_buckets": str(PROMPT),
        "token_gen_buckets": str(PROMPT + NEW), "compiler": "inductor",
    }
    outcome = compile_model(resolve_build(str(ckpt), spec, store_dir=work / "store"), jobs=1)
    return Path(outcome.path)


def group(name: str) -> str:
    if name.startswith(MATMUL):
        return "matmul"
    if name.startswith(ATTENTION):
        return "attention"
    return "other ops"


def decode_steps(runner: Any, batch: int, steps: int) -> list[float]:
    """Seconds per decode step, every slot live, after a prefill per slot."""
    for slot in range(batch):
        runner.prefill(slot, list(range(1, PROMPT // 2)))
    times = []
    for step in range(steps):
        position = PROMPT // 2 + step
        start = time.perf_counter()
        runner.decode([5] * batch, [position] * batch)
        times.append(time.perf_counter() - start)
    return times


def profile(runner: Any, batch: int, steps: int) -> tuple[dict[str, float], float]:
    """Self milliseconds per step of each recorded op, and the profiled steps' time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    decode_steps(runner, batch, 2)  # warm
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        decode_steps(runner, batch, steps)
        wall = time.perf_counter() - start
    ops: dict[str, float] = {}
    for event in prof.key_averages():
        if event.key.startswith(("aten::", "mkldnn::", "neuronctl::", "quantized::")):
            ops[event.key] = ops.get(event.key, 0.0) + event.self_cpu_time_total / 1000 / steps
    return ops, wall * 1000 / steps


def report(artifact: Path, batch: int, steps: int) -> dict[str, Any]:
    from neuronctl.backends.torch import TorchBackend
    from neuronctl.store.manifest import read_manifest

    manifest = read_manifest(artifact)
    runner = TorchBackend().load(artifact, manifest)
    decode_steps(runner, batch, 4)  # loads the graph, warms the caches
    bare = [t * 1000 for t in decode_steps(runner, batch, steps)]
    ops, profiled = profile(runner, batch, steps)
    fastest = min(bare)
    groups: dict[str, float] = {}
    for name, ms in ops.items():
        groups[group(name)] = groups.get(group(name), 0.0) + ms
    # The profiled steps ran slower than bare ones (recording): scale their ops to the bare
    # step before calling the rest unattributed.
    scale = fastest / profiled if profiled else 1.0
    recorded = sum(groups.values()) * scale
    groups = {name: ms * scale for name, ms in groups.items()}
    groups["unattributed"] = max(0.0, fastest - recorded)
    ops_choice = manifest.ops
    return {
        "artifact": str(artifact), "dtype": str(manifest.spec.dtype), "batch": batch,
        "steps": steps, "step_ms_fastest": fastest, "step_ms_median": statistics.median(bare),
        "profiled_step_ms": profiled,
        "ops": [(row.rows, row.path, row.compute) for row in ops_choice.rows]
        if ops_choice else None,
        "layout": ops_choice.layout if ops_choice else None,
        "groups_ms": groups,
        "top_ops_ms": dict(sorted(((n, ms * scale) for n, ms in ops.items()),
                                  key=lambda item: -item[1])[:12]),
    }


def print_report(result: dict[str, Any]) -> None:
    print(f"{result['dtype']} batch {result['batch']}: layout {result['layout']}, "
          f"op choice {result['ops']}")
    print(f"  decode step: fastest {result['step_ms_fastest']:.2f} ms, median "
          f"{result['step_ms_median']:.2f} ms ({result['steps']} steps; profiled "
          f"{result['profiled_step_ms']:.2f} ms)")
    for name, ms in sorted(result["groups_ms"].items(), key=lambda item: -item[1]):
        share = ms / result["step_ms_fastest"] * 100
        print(f"  {name:<14} {ms:7.2f} ms  {share:5.1f} %")
    print("  top ops (self ms per step):")
    for name, ms in result["top_ops_ms"].items():
        print(f"    {name:<36} {ms:7.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--artifact", type=Path, help="profile this artifact instead")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's); 1 on "
                        "a busy shared host, where a 2-thread op waits for a descheduled one")
    parser.add_argument("--work", type=Path, default=Path("/tmp/neuronctl-bench-profile"))
    parser.add_argument("--json", action="store_true", help="one JSON object, no table")
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    artifact = opts.artifact or compile_artifact(opts.work, opts.dtype, opts.batch)
    result = report(artifact, opts.batch, opts.steps)
    result["host"] = cpu_model()
    result["threads"] = torch.get_num_threads()
    if opts.json:
        print(json.dumps(result))
        return
    print(f"host: {result['host']}, {result['threads']} threads")
    print_report(result)


if __name__ == "__main__":
    main()
