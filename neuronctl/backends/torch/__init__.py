"""The embedded torch backend: neuronctl's own Llama-family modeling, one graph per bucket.

Runs on any CPU. `build` shards the weights (Neuron's tp layout), writes neuron_config.json
and traces one context-encoding graph per context bucket and one token-generation graph per
token-generation bucket (torch.export, then AOTInductor with `--compiler inductor`). `load`
reassembles the weights and returns a TorchRunner. docs/torch-backend.md explains the model.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
from collections.abc import Mapping
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuronctl.backends.base import NEURON_CONFIG, BuildRequest, BuildResult
from neuronctl.checks import Check
from neuronctl.doctor import available_cpus
from neuronctl.errors import BuildError, CheckpointError, SpecError
from neuronctl.store.local import user_cache_store

if TYPE_CHECKING:
    from neuronctl.backends.torch import modeling, opchoice
    from neuronctl.backends.torch.runner import TorchRunner
    from neuronctl.checkpoints import Checkpoint
    from neuronctl.spec import BuildSpec
    from neuronctl.store.manifest import Manifest, OpChoice

# Bump when modeling.py or the graph signatures change what a graph computes or takes.
MODELING_VERSION = "6"
# neuronctl's own CPU ops, one library (kernel.py): the matmul and decode attention, and
# the header they share (in the digest, not compiled on its own).
KERNEL_SOURCES = tuple(Path(__file__).with_name(n) for n in ("simd.h", "gemv.cpp", "attention.cpp"))


@cache
def kernel_digest() -> str:
    """The source digest of neuronctl's CPU ops (kernel.py): a graph calling them depends on
    them, so it is part of the graph key (read without importing torch)."""
    h = hashlib.sha256()
    for source in KERNEL_SOURCES:
        h.update(source.name.encode() + b"\0" + source.read_bytes())
    return h.hexdigest()[:16]


# Inductor's x86 ISAs, best first (torch._inductor.cpu_vec_isa.supported_vec_isa_list): it
# generates code for the first whose capabilities the CPU has.
X86_ISAS = ("avx512 avx512_vnni amx_tile", "avx512 avx512_vnni", "avx512", "avx2")


def x86_capabilities(cpu_flags: str) -> set[str]:
    """The capabilities inductor reads on x86 (`x86_isa_checker`), from the CPU flags.

    As aten's at::cpu checks them (aten/src/ATen/cpu/Utils.cpp): avx512 needs the F, VL, BW
    and DQ subsets; avx512_vnni needs avx512 too; amx_tile is its own flag.
    """
    flags = set(cpu_flags.split())
    caps = set()
    if "avx2" in flags:
        caps.add("avx2")
    if {"avx512f", "avx512vl", "avx512bw", "avx512dq"} <= flags:
        caps.add("avx512")
        if "avx512_vnni" in flags:
            caps.add("avx512_vnni")
    if "amx_tile" in flags:
        caps.add("amx_tile")
    return caps


def is_x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


@cache
def cpu_isa() -> str:
    """The vector ISA inductor generates code for on this host (e.g. 'avx512 avx512_vnni').

    On x86 from the CPU flags, as inductor ranks them, without its compile probes: a key
    computed where no C++ compiler is installed (a CI runner's `plan`) is the key a builder on
    the same CPU computes. Elsewhere inductor's own pick (no compiler involved on arm64),
    cached per (torch, machine, CPU flags) in the user cache because it imports torch and
    `validate` must answer well under a second.
    """
    if is_x86():
        caps = x86_capabilities(_cpu_flags())
        return next((isa for isa in X86_ISAS if set(isa.split()) <= caps), "none")
    key = _host_fingerprint()
    cache_file = user_cache_store() / "cpu_isa.json"
    try:
        cached = json.loads(cache_file.read_text())
        if cached.get("key") == key:
            return str(cached["isa"])
    except (OSError, ValueError, KeyError):
        pass
    isa = _detect_isa()
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "isa": isa}))
        os.replace(tmp, cache_file)
    except OSError:
        pass  # a read-only cache only costs the probe next time
    return isa


def _detect_isa() -> str:
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        return str(pick_vec_isa()) or "none"
    except Exception:  # pragma: no cover - hosts inductor has no ISA for
        return "none"


@cache
def _cpu_flags() -> str:
    try:
        line = next(
            (
                line
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith(("flags", "Features"))
            ),
            "",
        )
        return line.partition(":")[2].strip()
    except OSError:
        return platform.processor()


def _host_fingerprint() -> str:
    text = f"{torch_version()}|{platform.machine()}|{_cpu_flags()}"
    return hashlib.sha256(text.encode()).hexdigest()


def half_units() -> str:
    """The half-precision dtypes this CPU computes natively: "bf16", "bf16 fp16" or "none".

    From the CPU flags (no torch import: versions() runs on every validate). x86 needs
    avx512_bf16 or AMX for bf16 and avx512_fp16 or AMX-FP16 for fp16; arm64 its BF16 and
    FP16 arithmetic features. Elsewhere the narrow dtypes are emulated, and a bf16 artifact
    computes in float32 (modeling.Numerics).
    """
    flags = set(_cpu_flags().split())
    units = []
    if flags & {"avx512_bf16", "amx_bf16", "bf16"}:
        units.append("bf16")
    if flags & {"avx512_fp16", "amx_fp16", "asimdhp"}:
        units.append("fp16")
    return " ".join(units) or "none"


def compute_dtype(dtype: str, quantized: bool, units: str) -> str:
    """The dtype an artifact computes in: its own where the CPU has units for it, else fp32.

    int8 weights always compute in float32 (they are widened inside the kernel).
    """
    unit = {"bfloat16": "bf16", "float16": "fp16"}.get(dtype)
    if quantized or unit is None or unit not in units.split():
        return "float32"
    return dtype


def torch_version() -> str:
    # Package metadata, not `import torch`: versions() runs on every validate.
    return metadata.version("torch")


def graph_versions(compiler: str, dtype: str, quantized: bool) -> dict[str, str]:
    """The versions an artifact's graphs depend on, and nothing else (part of the graph key).

    - torch and the modeling version, always;
    - `cpu_half_units` where the dtype is a half one the CPU may or may not compute in (they
      decide whether the graphs compute in it or in float32);
    - `cpu_isa` only for AOTInductor, which generates code for it (an exported program runs
      the same on every CPU);
    - `kernel`, the digest of neuronctl's ops, wherever the op choice may pick them
      (`kernel_may_run`): the choice is measured at build time and must not change the key.

    Read without importing torch or probing a compiler: validate and `plan` answer from it.
    """
    versions = {"torch": torch_version(), "modeling": MODELING_VERSION}
    if dtype in ("bfloat16", "float16") and not quantized:
        versions["cpu_half_units"] = half_units()
    if compiler == "inductor":
        versions["cpu_isa"] = cpu_isa()
        if kernel_may_run(compiler):
            versions["kernel"] = kernel_digest()
    return versions


def kernel_runs_on(cpu_flags: str) -> bool:
    """neuronctl's ops' instructions exist on this CPU (x86-64 with AVX2 and FMA)."""
    return is_x86() and {"avx2", "fma"} <= set(cpu_flags.split())


def kernel_may_run(compiler: str) -> bool:
    """Whether graphs compiled here may call neuronctl's ops (opchoice decides, from the
    model's shapes and timings too): AOTInductor on a CPU the kernel runs on, whatever the
    compute dtype (the kernel computes in float32 and rounds its result to it)."""
    return compiler == "inductor" and kernel_runs_on(_cpu_flags())


def cpu_runs(isa: str) -> bool:
    """An x86 ISA inductor compiled for ("avx2", "avx512 avx512_vnni", ...) runs on this CPU.

    From the CPU's own capabilities, as inductor checks them before its compile probes: a
    host that serves compiled code needs the instructions, not a compiler (without one,
    `supported_isas()` answers "none").
    """
    if isa == "none":
        return True
    here = x86_capabilities(_cpu_flags()) if is_x86() else set()
    return bool(here) and set(isa.split()) <= here


def supported_isas() -> set[str]:
    try:
        from torch._inductor.cpu_vec_isa import valid_vec_isa_list

        return {str(isa) for isa in valid_vec_isa_list()} | {"none"}
    except Exception:  # pragma: no cover
        return {"none"}


class TorchBackend:
    name = "torch"

    def versions(self, spec: BuildSpec | None = None) -> dict[str, str]:
        """What `spec`'s graphs depend on (graph_versions); without a spec, everything a torch
        artifact can depend on."""
        if spec is None:
            return {"torch": torch_version(), "modeling": MODELING_VERSION,
                    "kernel": kernel_digest(), "cpu_isa": cpu_isa(),
                    "cpu_half_units": half_units()}
        return graph_versions(str(spec.compiler), str(spec.dtype), spec.quantized)

    def architectures(self) -> Mapping[str, str]:
        from neuronctl.checkpoints.registry import ARCHITECTURES

        return ARCHITECTURES["torch"]

    def check(self, spec: BuildSpec, config: Mapping[str, Any]) -> None:
        from neuronctl.backends.torch import modeling  # imports torch: not on validate's path

        args = modeling.args_from_config(config)
        modeling.check_args(args, spec.seq_len)
        cores = available_cpus()
        if spec.tp_degree > cores:  # validate refuses such an artifact on this host
            raise SpecError(
                "tp_degree",
                f"tp degree {spec.tp_degree} needs {spec.tp_degree} CPU cores, this host has "
                f"{cores}: the artifact would never validate here",
                f"use --tp-degree {cores} or less",
            )
        if spec.compiler not in ("export", "inductor"):
            raise SpecError(
                "compiler", f"{spec.compiler!r} is not a torch compiler", "use inductor or export"
            )
        if spec.quantized and spec.quantization_dtype != "int8":
            raise SpecError(
                "quantization_dtype",
                f"the torch backend quantizes to int8, not {spec.quantization_dtype}",
                "use --quantization-dtype int8",
            )

    def build(self, request: BuildRequest) -> BuildResult:
        from neuronctl.backends.torch.graphs import DTYPES, build_graphs
        from neuronctl.sharding import shard_checkpoint

        spec, staging = request.spec, request.staging
        config = dict(request.checkpoint.config)
        self.check(spec, config)
        from neuronctl.backends.torch import modeling

        check_tensors(request.checkpoint, modeling.args_from_config(config))
        donor = request.reuse_graphs_from
        # A donor's graphs were compiled for its choice: adopt it, never measure again.
        ops = donor_choice(donor, spec, config) if donor else choose_ops(spec, config)
        jobs = graph_jobs(spec, config, staging, ops)
        if donor is not None:
            graphs = copy_graphs(donor, staging, jobs)
        else:
            graphs = build_graphs(jobs, request.jobs, request.progress)
        write_neuron_config(staging, spec, config, jobs, ops)
        if jobs[0].carries_kernel:
            carry_kernel(staging)
        checkpoint = request.checkpoint
        if spec.quantized:
            from neuronctl.backends.torch.quantize import QuantizedCheckpoint

            checkpoint = QuantizedCheckpoint.wrap(checkpoint, spec)
        shard_checkpoint(
            checkpoint,
            spec.tp_degree,
            DTYPES[str(spec.dtype)],
            staging / "weights",
            request.progress,
        )
        return BuildResult(graphs=graphs, graphs_reused=donor is not None,
                           extra=build_facts(spec), ops=ops)

    def load(self, path: Path, manifest: Manifest) -> TorchRunner:
        from neuronctl.backends.torch.runner import TorchRunner
        from neuronctl.backends.torch.safeload import check_artifact

        check_artifact(path, manifest)  # every graph, though each loads only when first used
        return TorchRunner(path, manifest.spec, manifest.architecture, manifest.graphs,
                           ops=manifest.ops, versions=manifest.backend_versions)

    def host_checks(self, manifest: Manifest) -> list[Check]:
        return host_checks(manifest, {"cpu_isa": cpu_isa(), "cpu_half_units": half_units()})


def check_tensors(checkpoint: Checkpoint, args: modeling.ModelArgs) -> None:
    """Every tensor the graphs read exists with the shape the config implies."""
    names = set(checkpoint.tensor_names())
    from neuronctl.backends.torch import modeling

    for name, shape in modeling.expected_shapes(args).items():
        if name not in names:
            raise CheckpointError(
                f"{checkpoint.ref} has no tensor {name}, which its config.json implies",
                "the checkpoint is incomplete or its config does not match its weights",
            )
        actual = tuple(checkpoint.tensor_info(name).shape)
        if actual != shape:
            raise CheckpointError(
                f"{checkpoint.ref}: {name} has shape {list(actual)}, config.json implies "
                f"{list(shape)}",
                "the checkpoint's config does not match its weights",
            )


def op_target(spec: BuildSpec, config: dict[str, Any]) -> opchoice.Target:
    from neuronctl.backends.torch import modeling, opchoice
    from neuronctl.backends.torch.graphs import DTYPES, graph_rows

    assert isinstance(spec.context_buckets, list)
    compute = compute_dtype(str(spec.dtype), spec.quantized, half_units())
    numerics = modeling.Numerics(DTYPES[str(spec.dtype)], DTYPES[compute], spec.quantized)
    rows = graph_rows(spec.context_buckets, spec.batch_size)
    args = modeling.args_from_config(config)
    return opchoice.target_for(spec, args, numerics, rows, _cpu_flags())


def choose_ops(spec: BuildSpec, config: dict[str, Any]) -> OpChoice:
    """The matmul paths of a fresh build (opchoice: measured here, or by the rules)."""
    from neuronctl.backends.torch import opchoice

    return opchoice.choose(op_target(spec, config))


def donor_choice(donor: Path, spec: BuildSpec, config: dict[str, Any]) -> OpChoice:
    """The choice a graph donor's graphs were compiled for: its manifest's record, or for a
    donor from before the record, the rules applied to the layout its neuron_config names."""
    from neuronctl.backends.torch import opchoice
    from neuronctl.store.manifest import read_manifest

    recorded = read_manifest(donor).ops
    if recorded is not None:
        return recorded
    from neuronctl.backends.torch.runner import _neuron_config

    layout = opchoice.legacy_layout(_neuron_config(donor))
    return opchoice.by_rules(op_target(spec, config), layout)


def graph_jobs(
    spec: BuildSpec, config: dict[str, Any], staging: Path, ops: OpChoice
) -> list[Any]:
    from neuronctl.backends.torch.graphs import CONTEXT, TOKEN_GEN, GraphJob, prompt_counts

    assert isinstance(spec.context_buckets, list) and isinstance(spec.token_gen_buckets, list)
    kinds = [(CONTEXT, b, n) for b in spec.context_buckets for n in prompt_counts(spec.batch_size)]
    kinds += [(TOKEN_GEN, b, 1) for b in spec.token_gen_buckets]
    compute = compute_dtype(str(spec.dtype), spec.quantized, half_units())
    jobs = []
    for kind, bucket, prompts in kinds:
        rows = spec.batch_size if kind == TOKEN_GEN else bucket * prompts
        jobs.append(GraphJob(
            kind,
            bucket,
            config,
            spec.batch_size,
            spec.seq_len,
            str(spec.dtype),
            str(spec.compiler),
            str(staging),
            compute=compute,
            quantized=spec.quantized,
            prompts=prompts,
            layout=ops.layout,
            path=ops.path_for(rows),
            carries_kernel="kernel" in ops.paths,
        ))
    return jobs


def carry_kernel(staging: Path) -> None:
    """The artifact carries the library of neuronctl ops its graphs call, built here, so that
    serving never compiles (it is code the manifest lists, like AOTInductor's own libraries)."""
    from neuronctl.backends.torch import kernel

    target = staging / kernel.artifact_library()
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(kernel.load(), target)


def copy_graphs(donor: Path, staging: Path, jobs: list[Any]) -> list[str]:
    """A fine-tune of the same architecture: the donor's graphs are exactly ours."""
    graphs = []
    for job in jobs:
        src = donor / job.relpath
        if not src.is_file():
            raise BuildError(f"graph donor {donor} lacks {job.relpath}")
        (staging / job.relpath).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, staging / job.relpath)
        graphs.append(job.relpath)
    return graphs


def write_neuron_config(
    staging: Path, spec: BuildSpec, config: dict[str, Any], jobs: list[Any], ops: OpChoice
) -> None:
    """The backend-native description: spec, KV layout and graph files (relative paths)."""
    from neuronctl.backends.torch import modeling

    args = modeling.args_from_config(config)
    numerics = jobs[0].numerics
    data = {
        "backend": "torch",
        "neuron_config": spec.model_dump(mode="json"),
        # The kernels chosen for this host (modeling.Numerics): weights and KV cache are
        # stored in `storage`, activations and matmuls run in `compute`.
        "numerics": {
            "storage": str(spec.dtype),
            "compute": str(numerics.compute).removeprefix("torch."),
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


def build_facts(spec: BuildSpec) -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {
        "torch_threads": torch.get_num_threads(),
        "cpu_isa": cpu_isa(),
        "cpu_half_units": half_units(),
        "compute_dtype": compute_dtype(str(spec.dtype), spec.quantized, half_units()),
    }
    if spec.compiler == "inductor":
        facts["cxx"] = _cxx_version()
    return facts


def _cxx_version() -> str:
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return str(get_cpp_compiler())
    except Exception:
        return "unknown"


def host_checks(manifest: Manifest, here: Mapping[str, str]) -> list[Check]:
    """What validate's generic version comparison cannot judge: the ISA and the cores.

    (torch and modeling versions are compared by validate from `versions()`.)
    """
    checks = []
    if manifest.spec.compiler == "inductor":
        checks.append(isa_check(manifest, here))
    checks.append(half_units_check(manifest, here))
    tp, cores = manifest.spec.tp_degree, available_cpus()
    checks.append(
        Check("cores", True, f"tp degree {tp}, {cores} cores")
        if tp <= cores
        else Check(
            "cores",
            False,
            f"tp degree {tp} needs {tp} cores, this host has {cores}; recompile with "
            f"--tp-degree {cores} or less",
        )
    )
    return checks


def half_units_check(manifest: Manifest, here: Mapping[str, str]) -> Check:
    """A bf16 (fp16) artifact built to compute natively needs a CPU with those units."""
    built_with = manifest.backend_versions.get("cpu_half_units", "none")
    spec = manifest.spec
    compute = compute_dtype(str(spec.dtype), bool(spec.quantized), built_with)
    units = here.get("cpu_half_units", "none")
    if compute == "float32" or compute_dtype(compute, False, units) == compute:
        return Check(
            "half-precision units", True, f"computes in {compute}; this host has {units} units"
        )
    return Check(
        "half-precision units",
        False,
        f"compiled to compute in {compute} on a CPU with {built_with} units, this host has "
        f"{units}; recompile here (it will compute in float32)",
    )


def isa_check(manifest: Manifest, here: Mapping[str, str]) -> Check:
    isa = manifest.backend_versions.get("cpu_isa", "none")
    if isa == here.get("cpu_isa"):  # the common case, answered from the cached probe
        return Check("cpu isa", True, f"{isa}, as compiled")
    if cpu_runs(isa):
        return Check("cpu isa", True, f"compiled for {isa}, which this CPU runs")
    supported = supported_isas()
    if isa in supported:
        return Check("cpu isa", True, f"compiled for {isa}, which this host supports")
    return Check(
        "cpu isa",
        False,
        f"compiled for {isa} ({manifest.host.get('machine', '?')}), this host "
        f"({platform.machine()}) supports {sorted(supported)}; recompile here or use "
        "--compiler export",
    )


__all__ = ["TorchBackend"]
