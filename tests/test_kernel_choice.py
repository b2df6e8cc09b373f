"""Which graphs use neuronctl's CPU ops, and what the artifact says about them: decisions
made in Python from the job and the CPU flags given, so they run on every host (the kernel's
numerics, in test_kernel.py, need an AVX2+FMA CPU and a C++ compiler)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from neuronctl.backends.torch import kernel
from neuronctl.backends.torch.config import Numerics, args_from_config
from neuronctl.backends.torch.graphs import CONTEXT, TOKEN_GEN, GraphJob, module_for
from tests.helpers import make_checkpoint, read_config


def test_by_the_rules_only_float32_compute_on_avx2_inductor_graphs_use_the_kernel(
    tmp_path: Path,
) -> None:
    from neuronctl.backends.torch import opchoice
    from neuronctl.spec import ModelShape, finalize, resolve_spec

    config = read_config(make_checkpoint(tmp_path / "ckpt", "llama"))
    flags = "sse4_2 avx avx2 fma"

    def layout(compute: str = "float32", flags: str = flags, **spec: object) -> str:
        base = {"model": "m", "compiler": "inductor", "dtype": "float32", "seq_len": 64,
                "batch_size": 1, **spec}
        finalized = finalize(resolve_spec(base, None, {})[0], ModelShape.from_config(config))
        numerics = Numerics(getattr(torch, finalized.dtype), getattr(torch, compute))
        args = args_from_config(config)
        target = opchoice.inputs_for(finalized, args, numerics, (1, 64), flags)
        return opchoice.by_rules(target).layout

    # float32 compute: fp32 weights, and bf16 or int8 ones on a CPU without bf16 units
    assert layout() == "blocked"
    assert layout("bfloat16", dtype="bfloat16") == "plain"  # bf16 units: bf16 kernels
    assert layout(compiler="export") == "plain"
    assert layout(flags="sse4_2 avx") == "plain"
    config["vocab_size"] = 321
    assert layout() == "plain"


def test_a_blocked_job_multiplies_by_the_kernel_in_both_graphs(tmp_path: Path) -> None:
    config = read_config(make_checkpoint(tmp_path / "ckpt", "llama"))
    for kind, batch in ((CONTEXT, 1), (TOKEN_GEN, 2), (TOKEN_GEN, 8), (TOKEN_GEN, 16)):
        job = GraphJob(kind, 64, args_from_config(config), batch, 128, "bfloat16", "inductor",
                       str(tmp_path),
                       compute="float32", layout="blocked", carries_kernel=True, path="kernel")
        assert module_for(job).linear is kernel.linear
        assert not job.packed
        if kind == TOKEN_GEN:
            assert module_for(job).fused_attention


def test_the_artifact_names_its_matmul_and_attention_kernels(tmp_path: Path) -> None:
    from neuronctl.backends.torch.neuron_config import attention_choice, matmul_choice
    from neuronctl.store.manifest import OpChoice, RowChoice

    config = read_config(make_checkpoint(tmp_path / "ckpt", "llama"))
    job = GraphJob(TOKEN_GEN, 64, args_from_config(config), 1, 128, "bfloat16", "inductor",
                   str(tmp_path),
                   compute="float32", quantized=True, layout="blocked", carries_kernel=True,
                   path="kernel")
    ops = OpChoice(layout="blocked", rows=[RowChoice(rows=1, path="kernel", compute="float32")],
                   chosen_by="rules")
    assert "int16" in matmul_choice(ops, quantized=True)
    assert "widened in registers" in matmul_choice(ops, quantized=False)
    args = args_from_config(config)
    assert attention_choice([job], args).startswith("neuronctl::attend")


def test_the_kernel_digest_covers_every_file_the_library_is_built_from() -> None:
    # A header the sources include but the digest leaves out would let a changed kernel keep
    # its graph key, and old artifacts would call new code.
    from neuronctl.backends.torch.versions import KERNEL_SOURCES

    names = {source.name for source in KERNEL_SOURCES}
    for source in KERNEL_SOURCES:
        included = re.findall(r'^#include "([^"]+)"', source.read_text(), flags=re.M)
        assert set(included) <= names, source.name
    assert {"gemv.cpp", "attention.cpp", "simd.h"} <= names


def test_each_graph_is_traced_in_its_row_counts_compute_dtype(tmp_path: Path) -> None:
    # A measured choice may give token generation float32 (the kernel) and a context bucket
    # bf16 (aten's bf16 GEMM on the same plain weights): the jobs, neuron_config and the
    # build facts say so per row count.
    from neuronctl.backends.torch.graphs import graph_jobs
    from neuronctl.backends.torch.neuron_config import compute_words
    from neuronctl.spec import ModelShape, finalize, resolve_spec
    from neuronctl.store.manifest import OpChoice, RowChoice

    config = read_config(make_checkpoint(tmp_path / "ckpt", "llama"))
    base = {"model": "m", "compiler": "inductor", "dtype": "bfloat16", "seq_len": 64,
            "batch_size": 1, "context_buckets": "16,32", "token_gen_buckets": "64"}
    spec = finalize(resolve_spec(base, None, {})[0], ModelShape.from_config(config))
    ops = OpChoice(layout="plain", chosen_by="measure", rows=[
        RowChoice(rows=1, path="kernel", compute="float32"),
        RowChoice(rows=16, path="aten", compute="bfloat16"),
        RowChoice(rows=32, path="aten", compute="bfloat16")])
    jobs = {job.name: job for job in graph_jobs(spec, args_from_config(config), tmp_path, ops)}
    assert jobs["token_generation_64"].numerics.compute == torch.float32
    assert jobs["token_generation_64"].linear is kernel.linear
    assert jobs["context_encoding_16"].numerics.compute == torch.bfloat16
    assert module_for(jobs["context_encoding_32"]).compute == torch.bfloat16
    assert all(job.carries_kernel for job in jobs.values())  # attention by the kernel's op
    assert compute_words(ops) == "float32 at 1 row; bfloat16 at 16, 32 rows"
    assert compute_words(ops.model_copy(update={"rows": ops.rows[1:]})) == "bfloat16"
