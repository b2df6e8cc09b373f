"""neuron_config.json, the torch backend's native description of an artifact.

`write` records the spec, the numerics (the matmul and attention kernels, in words), the KV
cache layout and the graph files; the manifest's `ops` is the record components read, this
file is for people (neuronctl never reads it back).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuronctl.backends.base import NEURON_CONFIG

if TYPE_CHECKING:
    from neuronctl.backends.torch.config import ModelArgs
    from neuronctl.spec import BuildSpec
    from neuronctl.store.manifest import OpChoice


def write(
    staging: Path, spec: BuildSpec, args: ModelArgs, jobs: list[Any], ops: OpChoice
) -> None:
    """The backend-native description: spec, KV layout and graph files (relative paths)."""
    data = {
        "backend": "torch",
        "neuron_config": spec.model_dump(mode="json"),
        # The kernels chosen for this host (config.Numerics): weights and KV cache are
        # stored in `storage`, activations and matmuls run in `compute`.
        "numerics": {
            "storage": str(spec.dtype),
            "compute": compute_words(ops),
            "quantized": "int8 " + spec.quantization_type if spec.quantized else None,
            "matmul": matmul_choice(ops, spec.quantized),
            "attention": attention_choice(jobs, args),
        },
        "kv_cache": {
            "layout": ["batch_size", "num_key_value_heads", "seq_len", "head_dim"],
            "shape": [spec.batch_size, args.num_kv_heads, spec.seq_len, args.head_dim],
            "layers": args.num_layers,
            "dtype": str(spec.dtype),
        },
        "graphs": {job.name: job.relpath for job in jobs},
        "graph_inputs": {
            "context_encoding": "weights, inv_freq, k_cache[L], v_cache[L], token_ids[P,bucket],"
            " lengths[P], slots[P] -> logits[P,vocab] (graph name suffix xP when P > 1)",
            "token_generation": "weights, inv_freq, k_cache[L], v_cache[L], token_ids[B],"
            " positions[B] -> logits[B,vocab]",
        },
    }
    (staging / NEURON_CONFIG).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def compute_words(ops: OpChoice) -> str:
    """The graphs' compute dtype: one, or per row count where the op choice differs
    ("float32 at 1 row; bfloat16 at 64, 128 rows")."""
    if len(ops.computes) == 1:
        return next(iter(ops.computes))
    by_dtype: dict[str, list[str]] = {}
    for row in ops.rows:
        by_dtype.setdefault(row.compute, []).append(str(row.rows))
    return "; ".join(f"{dtype} at {', '.join(rows)} row{'s' if rows != ['1'] else ''}"
                     for dtype, rows in by_dtype.items())


def attention_choice(jobs: list[Any], args: Any) -> str:
    """How the graphs attend, in words (neuron_config numerics)."""
    from neuronctl.backends.torch import kernel

    if jobs[0].carries_kernel and kernel.attention_fits(args.head_dim, jobs[0].numerics.storage):
        return (
            "neuronctl::attend for token generation (AVX2+FMA; the cache read as stored, "
            "float32 softmax); masked batched matmuls for context encoding"
        )
    return "masked batched matmuls, the cache widened to the compute dtype"


MATMULS = {
    "kernel": "neuronctl's kernel (AVX2+FMA; weights widened in registers, float32 "
              "accumulation)",
    "onednn": "oneDNN on prepacked weights",
    "aten": "aten",
    "gemv": "inductor fused GEMV",
}


def matmul_choice(ops: OpChoice, quantized: bool) -> str:
    """The matmul kernels an artifact's graphs use, in words (neuron_config numerics; the
    manifest's `ops` is the record)."""
    kernel = MATMULS["kernel"]
    if quantized:
        kernel = ("neuronctl's kernel (AVX2; int8 weights times activations rounded to int16 "
                  "per row, int32 sums, float32 scales)")
    words = {**MATMULS, "kernel": kernel}
    if quantized:
        words["aten"] = "aten (int8 weight-only kernel for token generation)"
    rows = "; ".join(f"{row.rows} rows: {words[row.path]}" for row in ops.rows)
    return f"{ops.layout} weights, chosen by {ops.chosen_by}; {rows}"
