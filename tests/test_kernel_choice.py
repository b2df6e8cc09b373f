"""Which graphs use neuronctl's CPU ops, and what the artifact says about them: decisions
made in Python from the job and the CPU flags given, so they run on every host (the kernel's
numerics, in test_kernel.py, need an AVX2+FMA CPU and a C++ compiler)."""

from __future__ import annotations

import re
from pathlib import Path

from neuronctl.backends.torch import kernel, modeling
from neuronctl.backends.torch.graphs import CONTEXT, TOKEN_GEN, GraphJob, module_for, uses_kernel
from tests.helpers import make_checkpoint, read_config


def test_only_float32_compute_on_avx2_inductor_graphs_use_the_kernel(tmp_path: Path) -> None:
    args = modeling.args_from_config(read_config(make_checkpoint(tmp_path / "ckpt", "llama")))
    flags = "sse4_2 avx avx2 fma"
    # float32 compute: fp32 weights, and bf16 or int8 ones on a CPU without bf16 units
    assert uses_kernel("inductor", "float32", args, flags)
    assert not uses_kernel("inductor", "bfloat16", args, flags)  # bf16 units: bf16 kernels
    assert not uses_kernel("export", "float32", args, flags)
    assert not uses_kernel("inductor", "float32", args, "sse4_2 avx")
    odd = modeling.args_from_config({**read_config(tmp_path / "ckpt"), "vocab_size": 321})
    assert not uses_kernel("inductor", "float32", odd, flags)


def test_a_blocked_job_multiplies_by_the_kernel_in_both_graphs(tmp_path: Path) -> None:
    config = read_config(make_checkpoint(tmp_path / "ckpt", "llama"))
    for kind, batch in ((CONTEXT, 1), (TOKEN_GEN, 2), (TOKEN_GEN, 8), (TOKEN_GEN, 16)):
        job = GraphJob(kind, 64, config, batch, 128, "bfloat16", "inductor", str(tmp_path),
                       compute="float32", blocked=True)
        assert module_for(job).linear is kernel.linear
        assert not job.packed
        if kind == TOKEN_GEN:
            assert module_for(job).fused_attention


def test_the_artifact_names_its_matmul_and_attention_kernels(tmp_path: Path) -> None:
    from neuronctl.backends.torch import attention_choice, matmul_choice

    config = read_config(make_checkpoint(tmp_path / "ckpt", "llama"))

    def job(quantized: bool) -> GraphJob:
        return GraphJob(TOKEN_GEN, 64, config, 1, 128, "bfloat16", "inductor", str(tmp_path),
                        compute="float32", quantized=quantized, blocked=True)

    assert "int16" in matmul_choice([job(True)])
    assert "widened in registers" in matmul_choice([job(False)])
    args = modeling.args_from_config(config)
    assert attention_choice([job(True)], args).startswith("neuronctl::attend")


def test_the_kernel_digest_covers_every_file_the_library_is_built_from() -> None:
    # A header the sources include but the digest leaves out would let a changed kernel keep
    # its graph key, and old artifacts would call new code.
    from neuronctl.backends.torch import KERNEL_SOURCES

    names = {source.name for source in KERNEL_SOURCES}
    for source in KERNEL_SOURCES:
        included = re.findall(r'^#include "([^"]+)"', source.read_text(), flags=re.M)
        assert set(included) <= names, source.name
    assert {"gemv.cpp", "attention.cpp", "simd.h"} <= names
