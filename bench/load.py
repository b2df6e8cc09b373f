"""Peak resident memory of loading an artifact's weights, over the weights' own size.

    python bench/load.py            # SmolLM2-135M shape: bf16 and int8
    python bench/load.py --quick    # bf16 only

Writes bench/decode.py's checkpoint as a torch artifact's weights file in each layout a graph
can take (plain, the kernel's blocked layout, oneDNN-packed: compile writes one of them, the
one its op choice picked) with compile's own writer, then, in a fresh process per case, loads
it with the runner's own loader and reports `(peak RSS - RSS before loading) / bytes of
weights`, the load time and how much of the mapping is in 2 MiB pages. The target is <= 1.2
(docs/performance.md): the loader maps the file and copies nothing but what oneDNN packs.
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
LAYOUTS = ("plain", "blocked", "packed")


def memory() -> dict[str, int]:
    """VmRSS, VmHWM (its peak) and RssFile of this process, in bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM", "RssFile"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def measure(weights_dir: Path, layout: str, quantized: bool) -> dict[str, Any]:
    """In this process: load the weights file in `weights_dir`; the peak RSS it added."""
    import torch

    from neuronctl.backends.torch import kernel
    from neuronctl.backends.torch.config import args_from_config
    from neuronctl.backends.torch.runner import _load_weights

    args = args_from_config(json.loads((weights_dir / "config.json").read_text()))
    blocked = layout == "blocked"
    if blocked:
        kernel.load()  # the op library (built once, cached) is not the weights' memory
    weights_bytes = sum(p.stat().st_size for p in weights_dir.glob("*.safetensors"))
    before = memory()
    start = time.perf_counter()
    weights = _load_weights(weights_dir, args, torch.bfloat16, packed=layout == "packed",
                            batch_size=8, quantized=quantized, blocked=blocked)
    seconds = time.perf_counter() - start
    after = memory()
    # Code pages of torch's libraries that loading touches first stay mapped and count in
    # RSS: not the weights' memory. The weights file's pages are the weights'.
    mapped, huge = mapped_rss(weights_dir.resolve())
    libraries = max(0, after["RssFile"] - before["RssFile"] - mapped)
    peak = after["VmHWM"] - before["VmRSS"] - libraries
    held = sum(t.nbytes for t in weights.values() if not t.is_mkldnn)
    return {"layout": layout, "weights_mb": round(weights_bytes / 2**20, 1),
            "held_mb": round(held / 2**20, 1), "load_s": round(seconds, 3),
            "libraries_mb": round(libraries / 2**20, 1),
            "in_2mib_pages": round(huge / mapped, 2) if mapped else 0.0,
            "peak_over_weights": round(peak / weights_bytes, 3)}


def mapped_rss(directory: Path) -> tuple[int, int]:
    """Resident bytes of this process's mappings of files under `directory`, and how many of
    them are mapped as 2 MiB pages (/proc/self/smaps Rss, FilePmdMapped)."""
    total, huge, inside = 0, 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
            inside = len(head) >= 6 and head[5].startswith(str(directory))
        elif inside and head and head[0] == "Rss:":
            total += int(head[1]) * 1024
        elif inside and head and head[0] == "FilePmdMapped:":
            huge += int(head[1]) * 1024
    return total, huge


def write_weights(ckpt: Path, out: Path, layout: str, quantized: bool) -> Path:
    """The checkpoint as a torch artifact's weights file in `layout` (compile's writer)."""
    import torch

    from neuronctl.backends.torch.config import args_from_config
    from neuronctl.backends.torch.quantize import QuantizedCheckpoint
    from neuronctl.backends.torch.weights import GRAPH_WEIGHTS, write_graph_weights
    from neuronctl.checkpoints import open_checkpoint

    checkpoint = open_checkpoint(str(ckpt))
    if quantized:
        spec = argparse.Namespace(quantization_type="per_channel_symmetric")
        checkpoint = QuantizedCheckpoint.wrap(checkpoint, spec)  # type: ignore[arg-type]
    weights_dir = out / f"{'int8' if quantized else 'bf16'}-{layout}"
    if not (weights_dir / GRAPH_WEIGHTS).is_file():
        write_graph_weights(checkpoint, args_from_config(checkpoint.config), torch.bfloat16,
                            quantized, layout == "blocked", weights_dir / GRAPH_WEIGHTS)
    (weights_dir / "config.json").write_text(json.dumps(checkpoint.config))
    return weights_dir


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--measure":
        print(json.dumps(measure(Path(sys.argv[2]), sys.argv[3], sys.argv[4] == "int8")))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/neuronctl-bench-load"))
    parser.add_argument("--quick", action="store_true")
    opts = parser.parse_args()
    from decode import make_checkpoint

    from neuronctl.backends.torch.host import cpu_flags, kernel_runs_on

    ckpt = make_checkpoint(opts.work / "smollm2-135m-shape")
    import torch

    from neuronctl.backends.torch.linear import can_pack

    # The layouts this host's graphs can take: blocked where the kernel runs, packed where
    # oneDNN packs bf16 (a CPU with bf16 units).
    layouts = [lay for lay in LAYOUTS
               if (lay != "blocked" or kernel_runs_on(cpu_flags()))
               and (lay != "packed" or can_pack(torch.bfloat16))]
    print(json.dumps({"layouts": layouts}), flush=True)
    worst = 0.0
    for quantized in [False] if opts.quick else [False, True]:
        for layout in layouts:
            if quantized and layout == "packed":
                continue  # int8 graphs never take oneDNN-packed weights
            weights_dir = write_weights(ckpt, opts.work / "weights", layout, quantized)
            done = subprocess.run([sys.executable, __file__, "--measure", str(weights_dir),
                                   layout, "int8" if quantized else "bf16"],
                                  capture_output=True, text=True)
            if done.returncode:
                print(json.dumps({"int8": quantized, "layout": layout,
                                  "failed": done.stderr.strip().splitlines()[-1:]}))
                continue
            row = {"int8": quantized, **json.loads(done.stdout)}
            worst = max(worst, row["peak_over_weights"])
            print(json.dumps(row), flush=True)
    verdict = "met" if worst <= TARGET else "NOT met"
    print(f"peak load RSS over the weights, worst case: {worst:.2f}x (target <= {TARGET}x: "
          f"{verdict}); packed counts oneDNN's copy of a tied head beside the embedding table")


if __name__ == "__main__":
    main()
