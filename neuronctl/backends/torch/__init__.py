"""The embedded torch backend: neuronctl's own Llama-family model, one graph per bucket.

Runs on any CPU. `build` writes the weights in the form the graphs take (weights.py),
writes neuron_config.json and traces one context-encoding graph per context bucket and one
token-generation graph per token-generation bucket (torch.export, then AOTInductor with
`--compiler inductor`). `load` maps the weights and returns a TorchRunner.
docs/torch-backend.md explains the model; docs/architecture.md lists the modules beside it.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuronctl.backends.base import BuildRequest, BuildResult
from neuronctl.backends.torch import host, versions
from neuronctl.checks import Check
from neuronctl.errors import BuildError, CheckpointError, SpecError

if TYPE_CHECKING:
    from neuronctl.backends.torch.config import ModelArgs
    from neuronctl.backends.torch.graphs import GraphJob
    from neuronctl.backends.torch.runner import TorchRunner
    from neuronctl.checkpoints import Checkpoint
    from neuronctl.spec import BuildSpec
    from neuronctl.store.manifest import Manifest, OpChoice


class TorchBackend:
    name = "torch"

    def versions(self, spec: BuildSpec | None = None) -> dict[str, str]:
        """What `spec`'s graphs depend on (graph_versions); without a spec, everything a torch
        artifact can depend on."""
        if spec is None:
            return versions.all_versions()
        return versions.graph_versions(str(spec.compiler), str(spec.dtype), spec.quantized)

    def architectures(self) -> Mapping[str, str]:
        from neuronctl.families import architectures

        return architectures("torch")

    def check(self, spec: BuildSpec, config: Mapping[str, Any]) -> None:
        from neuronctl.backends.torch.config import args_from_config

        check_build_spec(spec, args_from_config(config))

    def build(self, request: BuildRequest) -> BuildResult:
        """config.json is parsed here, once: everything below takes its ModelArgs. The spec
        has passed `check` (base.Backend.build): from here the walk goes straight on, to the
        op choice (opchoice.py), the graph jobs and their graphs (graphs.py)."""
        from neuronctl.backends.torch import kernel, neuron_config, opchoice
        from neuronctl.backends.torch.config import args_from_config
        from neuronctl.backends.torch.graphs import build_graphs, graph_jobs, graph_timeout
        from neuronctl.backends.torch.weights import GRAPH_WEIGHTS, write_graph_weights

        spec, staging = request.spec, request.staging
        args = args_from_config(request.checkpoint.config)
        # A bad timeout variable fails now, not after the compiles it would time.
        graph_timeout()
        kernel.build_timeout()
        check_tensors(request.checkpoint, args)
        donor = request.reuse_graphs_from
        # A donor's graphs were compiled for its choice: adopt it, never measure again.
        ops = donor_choice(donor) if donor else opchoice.choose(opchoice.spec_inputs(spec, args))
        jobs = graph_jobs(spec, args, staging, ops)
        if donor is not None:
            graphs = copy_graphs(donor, staging, jobs)
        else:
            graphs = build_graphs(jobs, request.jobs, request.progress)
        neuron_config.write(staging, spec, args, jobs, ops)
        if jobs[0].carries_kernel:
            carry_kernel(staging)
        checkpoint = request.checkpoint
        if spec.quantized:
            from neuronctl.backends.torch.quantize import QuantizedCheckpoint

            checkpoint = QuantizedCheckpoint.wrap(checkpoint, spec)
        write_graph_weights(
            checkpoint, args, opchoice.TORCH_DTYPES[str(spec.dtype)], bool(spec.quantized),
            ops.layout == opchoice.BLOCKED, staging / "weights" / GRAPH_WEIGHTS,
            request.progress,
        )
        return BuildResult(graphs=graphs, graphs_reused=donor is not None,
                           extra=build_facts(spec, ops), ops=ops)

    def load(self, path: Path, manifest: Manifest) -> TorchRunner:
        from neuronctl.backends.torch.runner import TorchRunner

        # The runner copies every graph and library, hashed against the manifest, and scans
        # export graphs' copies: what it checked is what it loads.
        return TorchRunner(path, manifest.spec, manifest.architecture, manifest.graphs,
                           ops=manifest.ops, versions=manifest.backend_versions,
                           files=manifest.files)

    def host_checks(self, manifest: Manifest) -> list[Check]:
        here = {"cpu_isa": host.cpu_isa(), "cpu_half_units": host.half_units()}
        return host.host_checks(manifest, here)


def check_build_spec(spec: BuildSpec, args: ModelArgs) -> None:
    """Refuse a spec this backend cannot build exactly for the model `args` describes."""
    from neuronctl.backends.torch.config import check_args

    check_args(args, spec.seq_len)
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


def check_tensors(checkpoint: Checkpoint, args: ModelArgs) -> None:
    """Every tensor the graphs read exists with the shape the config implies."""
    names = set(checkpoint.tensor_names())
    from neuronctl.backends.torch.layout import expected_shapes

    for name, shape in expected_shapes(args).items():
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


def donor_choice(donor: Path) -> OpChoice:
    """The choice a graph donor's graphs were compiled for: its manifest's record (a torch
    manifest of this format always has one; find_graph_donor only offers such donors)."""
    from neuronctl.store.manifest import read_manifest

    recorded = read_manifest(donor).ops
    if recorded is None:
        raise BuildError(f"graph donor {donor} records no op choice", "recompile it")
    return recorded


def carry_kernel(staging: Path) -> None:
    """The artifact carries the library of neuronctl ops its graphs call, built here, so that
    serving never compiles (it is code the manifest lists, like AOTInductor's own libraries)."""
    from neuronctl.backends.torch import kernel

    target = staging / kernel.artifact_library()
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(kernel.load(), target)


def copy_graphs(donor: Path, staging: Path, jobs: list[GraphJob]) -> list[str]:
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


def build_facts(spec: BuildSpec, ops: OpChoice) -> dict[str, Any]:
    """What the build host was and did; `compute_dtype` the graphs' (one, or each row
    count's where the op choice gave them different ones)."""
    import torch

    from neuronctl.backends.torch.neuron_config import compute_words

    facts: dict[str, Any] = {
        "torch_threads": torch.get_num_threads(),
        "cpu_isa": host.cpu_isa(),
        "cpu_half_units": host.half_units(),
        "compute_dtype": compute_words(ops),
    }
    if spec.compiler == "inductor":
        facts["cxx"] = _cxx_version()
    return facts


def _cxx_version() -> str:
    from neuronctl.backends.torch import internals

    try:
        return internals.cpp_compiler()
    except Exception:
        return "unknown"


__all__ = ["TorchBackend"]
