"""Benchmark: streaming TP sharding of a generated >= 2 GB Llama-shaped checkpoint.

Prints the sharding run's peak RSS against the bound (2x the largest single tensor + 300 MB,
whatever the model size) and its throughput as a ratio to `cp` of the same files, timed in the
same run on the same (warm) page cache. Exits 1 if either target is missed.

    python bench/shard.py [--gb 2.2] [--tp 2] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

MB = 1024 * 1024

# Run in a fresh process so its peak RSS is the sharder's alone.
# VmHWM (not ru_maxrss, which a child inherits from its parent across fork and exec).
SHARD_SCRIPT = """
import json, os, sys, time
from pathlib import Path
import torch
from neuronctl.checkpoints import open_checkpoint
from neuronctl.sharding import shard_checkpoint

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

src, out, tp = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
base = hwm()
start = time.perf_counter()
shard_checkpoint(open_checkpoint(str(src)), tp, torch.bfloat16, out)
os.sync()
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "peak_rss": hwm(), "baseline_rss": base}))
"""


def llama_config(layers: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": layers,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }


def layer_tensors(i: int, c: dict) -> dict[str, torch.Tensor]:
    h, inter = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    p = f"model.layers.{i}."
    shapes = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (h, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, h),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
    }
    return {p + k: rand(s) for k, s in shapes.items()}


def rand(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float32).to(torch.bfloat16)


def layer_bytes(c: dict) -> int:
    h, inter = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    return 2 * (2 * h + 2 * h * h + 2 * kv * h + 3 * inter * h)


def generate(root: Path, gigabytes: float) -> tuple[list[Path], int]:
    """Write an index-sharded checkpoint of about `gigabytes`; return files, largest tensor."""
    probe = llama_config(1)
    embed = probe["vocab_size"] * probe["hidden_size"] * 2
    layers = max(1, math.ceil((gigabytes * 1024**3 - 2 * embed) / layer_bytes(probe)))
    config = llama_config(layers)
    (root / "config.json").write_text(json.dumps(config))
    weight_map: dict[str, str] = {}
    files = []

    def flush(tensors: dict[str, torch.Tensor]) -> None:
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(tensors, str(root / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        files.append(root / name)

    v, h = config["vocab_size"], config["hidden_size"]
    flush({"model.embed_tokens.weight": rand((v, h))})
    for start in range(0, layers, 4):  # a few layers per file, like real checkpoints
        tensors: dict[str, torch.Tensor] = {}
        for i in range(start, min(start + 4, layers)):
            tensors |= layer_tensors(i, config)
        flush(tensors)
    flush({"model.norm.weight": rand((h,)), "lm_head.weight": rand((v, h))})
    index = {"metadata": {}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    largest = max(embed, config["intermediate_size"] * h * 2)
    return files, largest


def time_cp(files: list[Path], dest: Path) -> float:
    dest.mkdir()
    start = time.perf_counter()
    subprocess.run(["cp", *map(str, files), str(dest)], check=True)
    os.sync()  # both timings include getting the bytes to disk
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.2, help="checkpoint size (default 2.2)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None, help="where temp files go")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="neuronctl-bench-", dir=args.dir))
    try:
        src = tmp / "model"
        src.mkdir()
        t0 = time.perf_counter()
        files, largest = generate(src, args.gb)
        total = sum(f.stat().st_size for f in files)
        print(
            f"generated {total / 1024**3:.2f} GiB in {len(files)} files "
            f"({time.perf_counter() - t0:.0f} s); largest tensor {largest / MB:.0f} MiB"
        )
        os.sync()  # don't let the generator's dirty pages slow down whichever runs first
        cp_seconds = time_cp(files, tmp / "copy")
        shutil.rmtree(tmp / "copy")  # keep disk use at source + shards
        os.sync()
        run = subprocess.run(
            [sys.executable, "-c", SHARD_SCRIPT, str(src), str(tmp / "weights"), str(args.tp)],
            check=True,
            capture_output=True,
            text=True,
        )
        result = json.loads(run.stdout.strip().splitlines()[-1])
        return report(result, cp_seconds, total, largest, args.tp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def report(result: dict, cp_seconds: float, total: int, largest: int, tp: int) -> int:
    bound = 2 * largest + 300 * MB
    peak, base = result["peak_rss"], result["baseline_rss"]
    ratio = cp_seconds / result["seconds"]
    print(
        f"shard tp={tp}: {result['seconds']:.1f} s ({total / MB / result['seconds']:.0f} MiB/s); "
        f"cp: {cp_seconds:.1f} s ({total / MB / cp_seconds:.0f} MiB/s)"
    )
    print(f"throughput ratio to cp: {ratio:.2f} (target >= 0.5)")
    print(
        f"peak RSS: {peak / MB:.0f} MiB (after imports: {base / MB:.0f} MiB); "
        f"bound 2 x {largest / MB:.0f} MiB + 300 MiB = {bound / MB:.0f} MiB"
    )
    ok = peak <= bound and ratio >= 0.5
    print("OK" if ok else "TARGET MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
