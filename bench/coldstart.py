"""Cold start: a fresh `neuronctl generate` for one token against a bare `import torch`.

    python bench/coldstart.py                       # inductor (the default compiler), 7 runs
    python bench/coldstart.py --compiler export --runs 5

The SmolLM2-135M-shaped bench checkpoint (bench/decode.py's, with its byte-level tokenizer) is
compiled bf16 at batch 1 with bench/peers.py's buckets, in its work directory (a peers run's
artifact is a cache hit here), then the two commands run in turn,
each in a fresh process, the same way bench/peers.py's cold-start row runs them (its
`cold_start`: process start to exit). Each figure is the best over the runs, since other
work on a shared host only ever adds time; the CPU seconds (user + system, the process and its
threads) are printed too, as they move less with the host's load than the wall time does.
Target: the generate process within 1.5x the bare import.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]
from decode import compile_artifact, make_checkpoint  # noqa: E402
from peers import PROMPT_TEXT, cold_start, host_facts  # noqa: E402

TARGET = 1.5


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def commands(artifact: str) -> dict[str, list[str]]:
    py = sys.executable
    return {
        "import torch": [py, "-c", "import torch"],
        "neuronctl generate": [py, "-m", "neuronctl.cli.main", "generate", "--artifacts",
                               artifact, "--prompt", PROMPT_TEXT, "--max-tokens", "1"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--compiler", default="inductor", choices=["inductor", "export"])
    parser.add_argument("--work", type=Path, default=Path("/tmp/neuronctl-bench-peers"),
                        help="bench/peers.py's by default: its artifact is reused")
    opts = parser.parse_args()
    ckpt = make_checkpoint(opts.work / "smollm2-135m-shape")
    built = compile_artifact(ckpt, opts.work / "store", "bfloat16", 1, opts.compiler)
    facts = host_facts()
    print(json.dumps({"host": facts}), flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    wall: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    for run in range(opts.runs):
        for name, args in commands(str(built["path"])).items():
            before = children_cpu()
            secs, why = cold_start(args, env)
            if secs is None:
                sys.exit(f"{name} failed: {why}")
            wall.setdefault(name, []).append(secs)
            cpu.setdefault(name, []).append(children_cpu() - before)
            print(json.dumps({"run": run, "system": name, "s": round(secs, 3),
                              "cpu_s": round(cpu[name][-1], 3)}), flush=True)
    floor, ours = min(wall["import torch"]), min(wall["neuronctl generate"])
    cpu_floor, cpu_ours = min(cpu["import torch"]), min(cpu["neuronctl generate"])
    ratio = ours / floor
    print(f"host: {facts['cpu']}; compiler {opts.compiler}; best of {opts.runs}")
    print(f"import torch {floor:.2f} s ({cpu_floor:.2f} s CPU); neuronctl generate, 1 token "
          f"{ours:.2f} s ({cpu_ours:.2f} s CPU)")
    print(f"cold start {ratio:.2f}x import torch (CPU {cpu_ours / cpu_floor:.2f}x); target <= "
          f"{TARGET}x: {'met' if ratio <= TARGET else 'not met'}")


if __name__ == "__main__":
    main()
