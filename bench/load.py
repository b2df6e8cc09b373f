"""Peak resident memory of loading an artifact's weights, over the weights' own size.

    python bench/load.py            # SmolLM2-135M shape: bf16 and int8, tp 1 and 3
    python bench/load.py --quick    # bf16 tp 1 only

Compiles bench/decode.py's checkpoint with `--compiler export` (seconds; the graphs do not
matter here), then, in a fresh process per case, loads the weights in each layout a graph
can take (plain, the kernel's blocked layout in 2 MiB pages, the same in the arena `generate`
reserves ahead, oneDNN-packed) with the
runner's own loader and reports `(peak RSS - RSS before loading) / bytes of weights`. The
target is <= 1.2 (docs/performance.md): the loader holds one copy of the weights and one
transient tensor, never the checkpoint's tensors beside their graph form.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

TARGET = 1.2
# "reserved": blocked, into the arena `generate` reserves and faults in before it imports
# torch (backends/torch/arena.py), as large as the weight files: counted from before it.
LAYOUTS = ("plain", "blocked", "reserved", "packed")


def memory() -> dict[str, int]:
    """VmRSS, VmHWM (its peak) and RssFile of this process, in bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM", "RssFile"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def measure(artifact: Path, layout: str) -> dict[str, Any]:
    """In this process: load the weights in `layout`; the peak RSS it added."""
    import torch

    from neuronctl.backends.torch import kernel
    from neuronctl.backends.torch.config import args_from_config
    from neuronctl.backends.torch.runner import _load_weights
    from neuronctl.store.manifest import read_manifest

    manifest = read_manifest(artifact)
    args = args_from_config(manifest.architecture)
    dtype = getattr(torch, str(manifest.spec.dtype))
    quantized = bool(manifest.spec.quantized)
    blocked = layout in ("blocked", "reserved")
    if blocked:
        kernel.load()  # the op library (built once, cached) is not the weights' memory
    weights_bytes = sum(p.stat().st_size for p in (artifact / "weights").iterdir())
    before = memory()
    start = time.perf_counter()
    if layout == "reserved":
        from neuronctl.backends.torch import arena

        arena.reserve(weights_bytes)
    weights = _load_weights(artifact / "weights", args, dtype, packed=layout == "packed",
                            batch_size=8, quantized=quantized, blocked=blocked)
    seconds = time.perf_counter() - start
    after = memory()
    # Code pages of torch's libraries that loading touches first stay mapped and count in
    # RSS: not the weights' memory. Shard pages a loader keeps mapped are the weights'.
    libraries = max(0, after["RssFile"] - before["RssFile"]
                    - mapped_rss((artifact / "weights").resolve()))
    peak = after["VmHWM"] - before["VmRSS"] - libraries
    held = sum(t.nbytes for t in weights.values() if not t.is_mkldnn)
    return {"layout": layout, "weights_mb": round(weights_bytes / 2**20, 1),
            "held_mb": round(held / 2**20, 1), "load_s": round(seconds, 2),
            "libraries_mb": round(libraries / 2**20, 1),
            "peak_over_weights": round(peak / weights_bytes, 3)}


def mapped_rss(directory: Path) -> int:
    """Resident bytes of this process's mappings of files under `directory` (/proc/self/smaps):
    weights a loader left mapped, which RssFile counts beside the libraries' code."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
            inside = len(head) >= 6 and head[5].startswith(str(directory))
        elif inside and head and head[0] == "Rss:":
            total += int(head[1]) * 1024
    return total


def compile_artifact(ckpt: Path, store: Path, tp: int, quantized: bool) -> Path:
    from decode import PROMPT

    from neuronctl.build import compile_model, resolve_build

    spec: dict[str, Any] = {"dtype": "bfloat16", "batch_size": 1, "tp_degree": tp,
                            "seq_len": 2 * PROMPT, "max_context_length": PROMPT,
                            "context_buckets": str(PROMPT), "token_gen_buckets": str(2 * PROMPT),
                            "compiler": "export"}
    if quantized:
        spec.update(quantized=True, quantization_type="per_channel_symmetric")
    return Path(compile_model(resolve_build(str(ckpt), spec, store_dir=store), jobs=1).path)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--measure":
        print(json.dumps(measure(Path(sys.argv[2]), sys.argv[3])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/neuronctl-bench-load"))
    parser.add_argument("--quick", action="store_true")
    opts = parser.parse_args()
    from decode import make_checkpoint

    from neuronctl.backends.torch.host import cpu_flags, kernel_runs_on

    ckpt = make_checkpoint(opts.work / "smollm2-135m-shape")
    # tp 3 (the bench model's 9 heads split unevenly, pieces crossing band edges) needs 3 CPUs:
    # compile refuses a tp degree above the host's, since the artifact would never validate.
    from neuronctl.doctor import available_cpus

    cases = [(1, False)] if opts.quick else [(1, False), (3, False), (1, True)]
    if available_cpus() < 3 and (3, False) in cases:
        cases.remove((3, False))
        print(json.dumps({"skipped": "tp 3: this host has fewer than 3 CPUs"}), flush=True)
    import torch

    from neuronctl.backends.torch.linear import can_pack

    # The layouts this host's graphs can take: blocked where the kernel runs, packed where
    # oneDNN packs bf16 (a CPU with bf16 units).
    layouts = [lay for lay in LAYOUTS
               if (lay not in ("blocked", "reserved") or kernel_runs_on(cpu_flags()))
               and (lay != "packed" or can_pack(torch.bfloat16))]
    print(json.dumps({"layouts": layouts}), flush=True)
    worst = 0.0
    for tp, quantized in cases:
        artifact = compile_artifact(ckpt, opts.work / "store", tp, quantized)
        for layout in layouts:
            if quantized and layout == "packed":
                continue  # int8 graphs never take oneDNN-packed weights
            done = subprocess.run([sys.executable, __file__, "--measure", str(artifact), layout],
                                  capture_output=True, text=True)
            if done.returncode:
                print(json.dumps({"tp": tp, "int8": quantized, "layout": layout,
                                  "failed": done.stderr.strip().splitlines()[-1:]}))
                continue
            row = {"tp": tp, "int8": quantized, **json.loads(done.stdout)}
            worst = max(worst, row["peak_over_weights"])
            print(json.dumps(row), flush=True)
    verdict = "met" if worst <= TARGET else "NOT met"
    print(f"peak load RSS over the weights, worst case: {worst:.2f}x (target <= {TARGET}x: "
          f"{verdict}); packed counts oneDNN's copy of a tied head beside the embedding table")


if __name__ == "__main__":
    main()
