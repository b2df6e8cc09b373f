"""Lazy access to the NxD Inference SDK (neuronx_distributed_inference).

Nothing here imports the SDK at module import: it is only on Neuron hosts (and CPU build hosts
with the Neuron pip repository configured).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from neuronctl.backends.neuron import install_hint, sdk_versions
from neuronctl.errors import BackendUnavailableError

PACKAGES = ("neuronx-cc", "neuronx-distributed-inference", "torch-neuronx")
INSTALL = install_hint(PACKAGES)
ROOT = "neuronx_distributed_inference"

# HF model_type -> candidate (module, model class, InferenceConfig class), first importable
# wins. Mistral uses the Llama classes: NxDI had no mistral module before SDK 2.28 and vLLM's
# NxDI loader maps MistralForCausalLM to NeuronLlamaForCausalLM, so the artifact is what vLLM
# expects. HF's Gemma3ForCausalLM config has model_type "gemma3_text"; its NxDI classes exist
# from SDK 2.28 (model_classes names the upgrade when they are missing).
MODEL_CLASSES: dict[str, list[tuple[str, str, str]]] = {
    "llama": [("models.llama.modeling_llama", "NeuronLlamaForCausalLM", "LlamaInferenceConfig")],
    "mistral": [
        ("models.llama.modeling_llama", "NeuronLlamaForCausalLM", "LlamaInferenceConfig")
    ],
    "mixtral": [
        ("models.mixtral.modeling_mixtral", "NeuronMixtralForCausalLM", "MixtralInferenceConfig")
    ],
    "dbrx": [("models.dbrx.modeling_dbrx", "NeuronDbrxForCausalLM", "DbrxInferenceConfig")],
    "qwen2": [("models.qwen2.modeling_qwen2", "NeuronQwen2ForCausalLM", "Qwen2InferenceConfig")],
    "qwen3": [("models.qwen3.modeling_qwen3", "NeuronQwen3ForCausalLM", "Qwen3InferenceConfig")],
    "qwen3_moe": [
        (
            "models.qwen3_moe.modeling_qwen3_moe",
            "NeuronQwen3MoeForCausalLM",
            "Qwen3MoeInferenceConfig",
        )
    ],
    "gemma3_text": [
        ("models.gemma3.modeling_gemma3", "NeuronGemma3ForCausalLM", "Gemma3InferenceConfig")
    ],
}
# Mixture-of-experts model types (their NeuronConfig class derives from MoENeuronConfig). Not
# used to pick the class: the InferenceConfig class names it (get_neuron_config_cls); kept as
# the documented list the docs read.
MOE_MODEL_TYPES = frozenset({"mixtral", "dbrx", "qwen3_moe"})


def unavailable(what: str) -> BackendUnavailableError:
    return BackendUnavailableError(
        f"{what} is not installed: the nxdi backend needs the Neuron SDK", INSTALL
    )


def versions() -> dict[str, str]:
    return sdk_versions(PACKAGES, unavailable)


def module(name: str = "") -> ModuleType:
    full = f"{ROOT}.{name}" if name else ROOT
    try:
        return importlib.import_module(full)
    except ImportError as exc:
        if exc.name and (exc.name == ROOT or exc.name.startswith(ROOT + ".")):
            raise unavailable(exc.name) from None
        raise


def model_classes(model_type: str) -> tuple[Any, Any]:
    """(model class, InferenceConfig class) for an HF model_type."""
    module("")  # a clear BackendUnavailableError when the SDK is missing
    for mod_name, model_cls, config_cls in MODEL_CLASSES.get(model_type, []):
        try:
            mod = importlib.import_module(f"{ROOT}.{mod_name}")
        except ImportError:
            continue
        if hasattr(mod, model_cls) and hasattr(mod, config_cls):
            return getattr(mod, model_cls), getattr(mod, config_cls)
    raise BackendUnavailableError(
        f"this NxD Inference has no model class for model_type {model_type!r}",
        "supported: " + ", ".join(MODEL_CLASSES) + "; upgrade neuronx-distributed-inference",
    )


def neuron_config(model_type: str, kwargs: Mapping[str, Any]) -> Any:
    """The NeuronConfig class the model's InferenceConfig asks for, built from kwargs.

    `get_neuron_config_cls()` is what NxDI's own `InferenceConfig.load` uses, so the config
    compiled is the one load() rebuilds: NeuronDbrxConfig (forces fused_qkv), Qwen2/Qwen3's own
    subclasses, MoENeuronConfig for Mixtral / Qwen3-MoE.
    """
    _model_cls, config_cls = model_classes(model_type)
    return config_cls.get_neuron_config_cls()(**kwargs)


def inference_config(
    model_type: str, kwargs: Mapping[str, Any], model_path: str | None, hf_config: Any = None
) -> Any:
    """`XInferenceConfig(NeuronConfig(**kwargs), load_config=load_pretrained_config(...))`
    from a model directory, or from an in-memory HF config (`model_path` None)."""
    _model_cls, config_cls = model_classes(model_type)
    load_pretrained_config = module("utils.hf_adapter").load_pretrained_config
    if model_path is None:
        load_config = load_pretrained_config(hf_config=hf_config)
    else:
        load_config = load_pretrained_config(model_path)
    return config_cls(neuron_config(model_type, kwargs), load_config=load_config)


def inference_config_json(
    kwargs: Mapping[str, Any], config: Mapping[str, Any], model_path: str | None = None
) -> str:
    """InferenceConfig.to_json_string() as vLLM builds it for `--model model_path` (used for
    its md5 directory name). The JSON holds the HF config's `_name_or_path`, the path vLLM was
    given, so without a local `model_path` the result is stable but not vLLM's.

    Raises ImportError when the SDK is missing (callers fall back to an approximation).
    """
    try:
        module("")
    except BackendUnavailableError as exc:
        raise ImportError(str(exc)) from None
    model_type = str(config.get("model_type"))
    if model_path is not None and (Path(model_path) / "config.json").is_file():
        return str(inference_config(model_type, kwargs, model_path).to_json_string())
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = AutoConfig.for_model(model_type, **fields)  # _name_or_path "": no path, no drift
    return str(inference_config(model_type, kwargs, None, hf_config).to_json_string())
