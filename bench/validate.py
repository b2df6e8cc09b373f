"""Benchmark: `validate` on a generated >= 2 GB artifact.

    python bench/validate.py [--gb 2.0] [--shards 8] [--repeat 3] [--dir /tmp] [--json]

A synthetic torch-backend artifact (random weight shards and graphs, published with
Store.publish so its manifest is real) is validated:
  quick: quick_validate (stat only). Timed cold (first call in the process: includes importing
         the backend, i.e. torch) and warm (median of 20 calls): the target is well under a
         second whatever the artifact size, so the warm number must not grow with --gb.
  deep:  validate_artifact(deep=True), which re-hashes every byte, against `sha256sum` of the
         same files, alternating, best of --repeat each, on the same (warm) page cache. The
         ratio is deep throughput / sha256sum throughput (target >= 0.8); it is also reported
         with one hashing thread, to separate hashlib's speed from parallelism over files.
Exits 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from neuronctl.store.local import Store  # noqa: E402
from neuronctl.store.manifest import Manifest, Source  # noqa: E402

MB = 1024 * 1024
CHUNK = 64 * MB
QUICK_TARGET_S = 0.5  # "well under a second"
RATIO_TARGET = 0.8


def write_random(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(CHUNK, left)
            f.write(os.urandom(n))
            left -= n


def make_artifact(root: Path, total_bytes: int, shards: int) -> Path:
    from neuronctl.backends import get_backend

    backend = get_backend("torch")
    spec = {
        "model": "bench/synthetic", "revision": None, "backend": "torch", "tp_degree": 1,
        "batch_size": 1, "seq_len": 128, "max_context_length": 128, "dtype": "bfloat16",
        "context_buckets": [128], "token_gen_buckets": [128], "on_device_sampling": None,
        "quantized": False, "quantization_dtype": "int8",
        "quantization_type": "per_tensor_symmetric", "draft_model": None,
        "num_speculative_tokens": 0, "compiler": "export", "override_neuron_config": {},
        "cc_flags": "",
    }
    config = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 32,
              "num_key_value_heads": 8, "max_position_embeddings": 4096, "dtype": "bfloat16"}

    def build(staging: Path) -> Manifest:
        graph_bytes = 16 * MB
        shard_bytes = (total_bytes - 2 * graph_bytes) // shards
        for name in ("context_encoding_128", "token_generation_128"):
            write_random(staging / "graphs" / f"{name}.pt2", graph_bytes)
        for rank in range(shards):
            write_random(staging / "weights" / f"shard{rank}.safetensors", shard_bytes)
        (staging / "config.json").write_text(json.dumps(config))
        return Manifest(
            backend="torch",
            backend_versions=backend.versions(),
            spec=spec,
            keys={"graph_key": "0" * 64, "weights_key": "1" * 64, "artifact_key": "2" * 64},
            source=Source(model="bench/synthetic", digest="3" * 64),
            architecture=config,
            graphs=["graphs/context_encoding_128.pt2", "graphs/token_generation_128.pt2"],
        )

    return Store(root).publish("bench-validate", build).path


COLD = """
import sys, time
t = time.perf_counter()
from neuronctl.validate import quick_validate
r = quick_validate(sys.argv[1])
assert r.reusable, r.summary()
print(time.perf_counter() - t)
"""


def time_quick(path: Path) -> tuple[float, float]:
    """Cold: a fresh process (imports neuronctl and the backend, i.e. torch); warm: in-process."""
    from neuronctl.validate import quick_validate

    out = subprocess.run(
        [sys.executable, "-c", COLD, str(path)], check=True, capture_output=True, text=True,
        cwd=ROOT,
    ).stdout
    cold = float(out.strip().splitlines()[-1])
    warm = []
    for _ in range(20):
        started = time.perf_counter()
        quick_validate(path)
        warm.append(time.perf_counter() - started)
    return cold, statistics.median(warm)


def time_deep(path: Path, threads: int) -> float:
    import neuronctl.validate as validate_mod
    from neuronctl.validate import validate_artifact

    validate_mod.HASH_THREADS = threads
    started = time.perf_counter()
    report = validate_artifact(path, deep=True)
    elapsed = time.perf_counter() - started
    assert report.reusable, report.summary()
    return elapsed


def time_sha256sum(files: list[Path]) -> float:
    started = time.perf_counter()
    subprocess.run(["sha256sum", *map(str, files)], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0, help="artifact size in GiB")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to build it (a temp dir)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-validate-", dir=args.dir))
    try:
        started = time.perf_counter()
        path = make_artifact(work, int(args.gb * 1024 * MB), args.shards)
        setup_s = time.perf_counter() - started
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name != "manifest.json")
        total = sum(p.stat().st_size for p in files)
        quick_cold, quick_warm = time_quick(path)
        time_sha256sum(files)  # warm the page cache the same way for both
        deep, single, ref = [], [], []
        for _ in range(args.repeat):
            ref.append(time_sha256sum(files))
            deep.append(time_deep(path, threads=4))
            single.append(time_deep(path, threads=1))
        result = {
            "artifact_bytes": total,
            "files": len(files),
            "setup_s": round(setup_s, 1),
            "quick_cold_s": round(quick_cold, 3),
            "quick_warm_s": round(quick_warm, 4),
            "deep_s": round(min(deep), 2),
            "deep_mb_s": round(total / MB / min(deep)),
            "sha256sum_s": round(min(ref), 2),
            "sha256sum_mb_s": round(total / MB / min(ref)),
            "ratio": round(min(ref) / min(deep), 2),
            "ratio_one_thread": round(min(ref) / min(single), 2),
            "cpus": len(os.sched_getaffinity(0)),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ok = result["quick_warm_s"] < QUICK_TARGET_S and result["ratio"] >= RATIO_TARGET
    result["ok"] = ok
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"artifact: {total / MB / 1024:.2f} GiB in {len(files)} files "
              f"(generated in {setup_s:.0f} s)")
        print(f"quick validate: {quick_warm * 1000:.1f} ms warm (median of 20), "
              f"{quick_cold * 1000:.0f} ms cold incl. backend import; target < "
              f"{QUICK_TARGET_S * 1000:.0f} ms")
        print(f"deep validate: {result['deep_mb_s']} MB/s vs sha256sum {result['sha256sum_mb_s']} "
              f"MB/s: ratio {result['ratio']} (target >= {RATIO_TARGET}), "
              f"best of {args.repeat}, {result['cpus']} CPUs; one hashing thread: ratio "
              f"{result['ratio_one_thread']}")
        print("OK" if ok else "TARGET MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
