"""The NxD Inference NeuronConfig a finalized BuildSpec compiles to. Pure: no SDK import.

The same dict feeds `NeuronConfig(**kwargs)` at build time and vLLM's
`--override-neuron-config` at serve time, so a fallback recompile inside vLLM (which happens
when loading the artifact fails) would at least compile the same thing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from neuronctl.errors import SpecError
from neuronctl.spec import BuildSpec

# Keys the spec owns: overriding them would make the manifest lie about the artifact.
SPEC_OWNED = {
    "tp_degree": "--tp-degree",
    "batch_size": "--batch-size",
    "seq_len": "--seq-len",
    "max_context_length": "--max-context-length",
    "torch_dtype": "--dtype",
    "context_encoding_buckets": "--context-buckets",
    "token_generation_buckets": "--token-gen-buckets",
    "on_device_sampling_config": "--on-device-sampling",
    "quantized": "--quantized",
    "quantization_dtype": "--quantization-dtype",
    "quantization_type": "--quantization-type",
    "speculation_length": "--num-speculative-tokens",
    "save_sharded_checkpoint": "(always true: the artifact carries its weights)",
}


def check_override(override: Mapping[str, Any]) -> None:
    owned = [key for key in override if key in SPEC_OWNED]
    if owned:
        raise SpecError(
            "override_neuron_config." + ", ".join(owned),
            ("is" if len(owned) == 1 else "are") + " set by the build spec, not by the override",
            "use " + ", ".join(SPEC_OWNED[key] for key in owned)
            + " (`neuronctl config migrate` prints both)",
        )


def neuron_config_kwargs(spec: BuildSpec) -> dict[str, Any]:
    """NeuronConfig kwargs for a finalized spec, override_neuron_config merged last."""
    if spec.dtype == "auto" or "auto" in (spec.context_buckets, spec.token_gen_buckets):
        raise ValueError("neuron_config_kwargs needs a finalized spec")
    check_override(spec.override_neuron_config)
    sampling = spec.on_device_sampling.model_dump() if spec.on_device_sampling else None
    kwargs: dict[str, Any] = {
        "tp_degree": spec.tp_degree,
        "batch_size": spec.batch_size,
        # One prompt is context-encoded at a time into its slot (the Runner's prefill(slot)),
        # as vLLM's default NxDI config does.
        "ctx_batch_size": 1,
        "seq_len": spec.seq_len,
        "max_context_length": spec.effective_max_context_length(),
        "torch_dtype": spec.dtype,
        "enable_bucketing": True,
        "context_encoding_buckets": list(spec.context_buckets),
        "token_generation_buckets": list(spec.token_gen_buckets),
        "is_continuous_batching": True,
        "padding_side": "right",
        "on_device_sampling_config": sampling,
        "quantized": spec.quantized,
        "save_sharded_checkpoint": True,
    }
    if spec.quantized:
        kwargs["quantization_dtype"] = spec.quantization_dtype
        kwargs["quantization_type"] = spec.quantization_type
    if spec.draft_model:
        kwargs["speculation_length"] = spec.num_speculative_tokens
        kwargs["enable_fused_speculation"] = True
    kwargs.update(spec.override_neuron_config)
    return kwargs
