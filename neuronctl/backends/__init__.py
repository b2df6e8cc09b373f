"""Backend registry, and the few backend services other layers use, behind one door.

Backends import lazily: the Neuron SDK is only on Neuron hosts. Nothing outside
`backends/<name>/` imports a backend's internals (the import contract in pyproject.toml
enforces it): it asks `get_backend` for a Backend, or calls one of the functions below.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuronctl.backends.base import Backend
from neuronctl.errors import UsageError

if TYPE_CHECKING:
    from neuronctl.spec import BuildSpec

# name -> "module:attribute" of a zero-argument factory returning a Backend.
BACKEND_FACTORIES = {
    "torch": "neuronctl.backends.torch:TorchBackend",
    "nxdi": "neuronctl.backends.nxdi:NxdiBackend",
    "tnx": "neuronctl.backends.tnx:TnxBackend",
}


def get_backend(name: str) -> Backend:
    target = BACKEND_FACTORIES.get(name)
    if target is None:
        raise UsageError(f"unknown backend {name!r}", "use one of: " + ", ".join(BACKEND_FACTORIES))
    module_name, attr = target.split(":")
    factory = getattr(importlib.import_module(module_name), attr)
    backend: Backend = factory()
    return backend


def prepare_load(artifact: Path) -> None:
    """Start what loading `artifact` can do before torch is imported, on another thread:
    the torch backend maps its weights file and faults it in (torch/arena.py) while the
    caller's `import torch` keeps one core busy for seconds. Reads nothing but the weights
    (not even the manifest: the reuse checks read it once), runs no code of the artifact: the
    load rule still applies to the load itself."""
    from neuronctl.backends.torch.arena import map_early

    map_early(artifact)


def check_accuracy(
    artifact: Path, checkpoint: Path, mode: str, backend: str = "torch"
) -> dict[str, Any]:
    """`compile --check-accuracy`: the artifact against transformers (torch backend only)."""
    if backend != "torch":
        raise UsageError(
            "--check-accuracy runs on the torch backend here; on Neuron use inference_demo"
        )
    from neuronctl.backends.torch.accuracy import compare_with_transformers as run

    return run(artifact, checkpoint, mode).as_dict()


def nxdi_neuron_config(spec: BuildSpec) -> dict[str, Any]:
    """The NxD Inference NeuronConfig kwargs a spec compiles to (vLLM's override)."""
    from neuronctl.backends.nxdi.config import neuron_config_kwargs

    return neuron_config_kwargs(spec)


def nxdi_inference_config_json(
    kwargs: Mapping[str, Any], config: Mapping[str, Any], model_path: str | None = None
) -> str:
    """NxDI's InferenceConfig.to_json_string() as vLLM builds it for `--model model_path`;
    raises ImportError without the SDK."""
    from neuronctl.backends.nxdi.sdk import inference_config_json

    return inference_config_json(kwargs, config, model_path)


def tnx_neuron_config(spec: BuildSpec) -> dict[str, Any]:
    """The Transformers NeuronX NeuronConfig kwargs a spec compiles to."""
    from neuronctl.backends.tnx.config import neuron_config_kwargs

    return neuron_config_kwargs(spec)


def tnx_vllm_override(spec: BuildSpec) -> dict[str, Any]:
    """What vLLM's Transformers NeuronX path takes as --override-neuron-config."""
    from neuronctl.backends.tnx.config import vllm_override

    return vllm_override(spec)


def payload_problem(root: Path, manifest: Any) -> str | None:
    """validate --deep: a graph that should be pure data but carries code (a pickle), or None."""
    from neuronctl.backends.torch.safeload import artifact_problem

    return artifact_problem(root, manifest)
