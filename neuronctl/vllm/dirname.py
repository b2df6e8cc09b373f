"""The `<model>/neuron-compiled-artifacts/<md5>` directory name vLLM B's NxDI loader computes
for a build (what `neuronctl hash --vllm` prints): where a recompile would go."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from neuronctl.errors import UsageError
from neuronctl.spec import BuildSpec

# The on-device sampling both vLLM B's and vllm-neuron's NxDI loaders compile by default
# (_get_default_neuron_config: OnDeviceSamplingConfig(dynamic=True, deterministic=False)); the
# nxdi backend builds with it unless told otherwise (spec.NXDI_DEFAULT_SAMPLING).
VLLM_SAMPLING = {"dynamic": True, "deterministic": False}


def b_neuron_config(spec: BuildSpec) -> dict[str, Any]:
    """The NeuronConfig kwargs vLLM B derives from neuronctl's own B launch of this spec: its
    `_get_default_neuron_config` (vllm model_loader/neuronx_distributed.py) over
    --tensor-parallel-size, --max-num-seqs, --max-model-len (capped at max_context_length,
    see rules._plan_b) and --dtype, with no --override-neuron-config (neuronctl passes none)."""
    max_model_len = spec.effective_max_context_length()
    return {
        "tp_degree": spec.tp_degree,
        "ctx_batch_size": 1,
        "batch_size": spec.batch_size,
        "max_context_length": max_model_len,
        "seq_len": max_model_len,
        "enable_bucketing": True,
        "is_continuous_batching": True,
        "quantized": False,
        "torch_dtype": spec.dtype,
        "padding_side": "right",
        "on_device_sampling_config": dict(VLLM_SAMPLING),
        "sequence_parallel_enabled": True,
        "lora_serving_config": None,
    }


def no_vllm_dirname(spec: BuildSpec) -> str | None:
    """Why vLLM computes no `<model>/neuron-compiled-artifacts/<md5>` name for this build, or
    None when it does (generation B's NxDI loader, without NEURON_COMPILED_ARTIFACTS)."""
    if spec.backend == "torch":
        return "vLLM cannot load a torch-backend artifact (build with --backend nxdi)"
    if spec.backend == "tnx":
        return (
            "vLLM's Transformers NeuronX path has no such directory (it reuses NEFFs "
            "through the compile cache)"
        )
    if spec.draft_model:
        return "vLLM B hashes a speculation config neuronctl does not reproduce"
    return None


def vllm_dirname_exact(
    spec: BuildSpec, config: Mapping[str, Any], model_path: str | None = None
) -> tuple[str, bool]:
    """The md5 directory name vLLM B's NxDI loader computes under
    `<model>/neuron-compiled-artifacts/` for `--model model_path` (default spec.model) and
    neuronctl's B launch of `spec`, and whether it is exact.

    vLLM hashes `InferenceConfig.to_json_string()` of the config it builds from its own
    defaults and `--model`, which includes that path as `_name_or_path` (load_weights). So the
    name is exact only with the SDK installed and `model_path` the local directory vLLM is
    given, spelled the same way. vLLM deletes that directory before loading and recompiles
    into it, so it names where a recompile goes, never an artifact to reuse. vllm-neuron
    (generation C) hashes the same way but is always given NEURON_COMPILED_ARTIFACTS here.
    """
    from neuronctl.backends import nxdi_inference_config_json

    why = no_vllm_dirname(spec)
    if why:
        raise UsageError(f"no vLLM directory name: {why}")
    kwargs = b_neuron_config(spec)
    path = model_path if model_path is not None else spec.model
    try:
        text = nxdi_inference_config_json(kwargs, config, path)
        exact = path is not None and Path(path).joinpath("config.json").is_file()
    except ImportError:
        data = {**dict(config), "neuron_config": kwargs}
        text = json.dumps(data, indent=2, sort_keys=True)
        exact = False
    return hashlib.md5(text.encode()).hexdigest(), exact


def vllm_dirname(spec: BuildSpec, config: Mapping[str, Any], model_path: str | None = None) -> str:
    return vllm_dirname_exact(spec, config, model_path)[0]
