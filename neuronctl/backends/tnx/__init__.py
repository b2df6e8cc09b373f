"""Transformers NeuronX backend (transformers-neuronx); the SDK imports lazily.

build: XForSampling.from_pretrained(ckpt, batch_size, tp_degree, n_positions=token-gen buckets,
       context_length_estimate=context buckets, amp, neuron_config=NeuronConfig(...)) with the
       NeuronConfig vLLM's TNx loader builds for the same flags (tnx/config.py), .to_neuron(),
       then .save(staging, sharded_weights=True): one <hlo hash>.neff per compiled kernel and
       pre-sharded weights. to_neuron() runs with NEURON_COMPILE_CACHE_URL pointing into the
       artifact, so vLLM's TNx path (which never calls load(dir) and relies on the persistent
       cache) finds the same NEFFs there (see neuronctl/vllm/rules.py; not confirmed on a host).
       TNx's save() writes its own config object as config.json, without `architectures`
       (base.py); it is replaced by the checkpoint's config.json plus is_presharded_checkpoint,
       which both TNx's from_pretrained (AutoConfig) and vLLM (`--model`) read.
load:  from_pretrained(path, same arguments) + .load(path) + .to_neuron(); TNx raises
       FileNotFoundError ("Could not find a matching NEFF...") if anything differs.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from neuronctl.backends.base import BuildRequest, BuildResult
from neuronctl.backends.neuron import (
    SlotFill,
    cc_flags_env,
    env_var,
    install_hint,
    last_logits,
    sdk_failure,
    sdk_versions,
)
from neuronctl.backends.nxdi import NxdiBackend
from neuronctl.backends.tnx import config as tnx_config
from neuronctl.checks import Check
from neuronctl.errors import BackendUnavailableError, BuildError, NeuronctlError

if TYPE_CHECKING:
    from neuronctl.spec import BuildSpec
    from neuronctl.store.manifest import Manifest

PACKAGES = ("neuronx-cc", "transformers-neuronx", "torch-neuronx")
INSTALL = install_hint(PACKAGES)
COMPILE_CACHE = "neuron-compile-cache"  # the same name as neuronctl.vllm.rules TNX_COMPILE_CACHE


def unavailable(what: str) -> BackendUnavailableError:
    return BackendUnavailableError(
        f"{what} is not installed: the tnx backend needs the Neuron SDK", INSTALL
    )


def sdk() -> Any:
    try:
        return importlib.import_module("transformers_neuronx")
    except ImportError as exc:
        if exc.name and exc.name.startswith("transformers_neuronx"):
            raise unavailable("transformers-neuronx") from None
        raise


def compile_cache_env(path: Path) -> AbstractContextManager[None]:
    return env_var("NEURON_COMPILE_CACHE_URL", str(path))


# NeuronConfig keys that take a config object, built from a dict as vLLM's TNx loader does
# (_get_neuron_config_after_override); the classes live in transformers_neuronx.config.
SUB_CONFIG_CLASSES = {
    "continuous_batching": "ContinuousBatchingConfig",
    "quant": "QuantizationConfig",
    "kv_cache_quant": "KVCacheQuantizationConfig",
    "on_device_generation": "GenerationConfig",
}


def make_neuron_config(tnx: Any, spec: BuildSpec) -> Any:
    kwargs = tnx_config.neuron_config_kwargs(spec)
    classes = importlib.import_module(f"{tnx.__name__}.config")
    for key, cls_name in SUB_CONFIG_CLASSES.items():
        if isinstance(kwargs.get(key), dict):
            kwargs[key] = getattr(classes, cls_name)(**kwargs[key])
    if isinstance(kwargs.get("sparse_attn"), dict):
        kwargs["sparse_attn"] = tnx.SparseAttnConfig(**kwargs["sparse_attn"])
    return tnx.NeuronConfig(**kwargs)


def model_class(tnx: Any, model_type: str) -> Any:
    return getattr(tnx, tnx_config.MODEL_TYPES[model_type])


def write_presharded_config(model_path: Path, staging: Path) -> None:
    """The checkpoint's config.json (architectures included) with TNx's pre-sharded flag."""
    config = json.loads((model_path / "config.json").read_text())
    config["is_presharded_checkpoint"] = True
    (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


class TnxBackend:
    name = "tnx"

    def versions(self, spec: BuildSpec | None = None) -> dict[str, str]:
        # Every compiled result depends on the whole SDK.
        return sdk_versions(PACKAGES, unavailable)

    def architectures(self) -> Mapping[str, str]:
        from neuronctl.families import architectures

        return architectures("tnx")

    def check(self, spec: BuildSpec, config: Mapping[str, Any]) -> None:
        tnx_config.check(spec, config)

    def _model(self, path: Path, spec: BuildSpec, model_type: str) -> Any:
        tnx = sdk()
        return model_class(tnx, model_type).from_pretrained(
            str(path),
            neuron_config=make_neuron_config(tnx, spec),
            **tnx_config.from_pretrained_kwargs(spec),
        )

    def build(self, request: BuildRequest) -> BuildResult:
        spec, staging = request.spec, request.staging
        model_path = Path(request.checkpoint.path)
        self.check(spec, request.checkpoint.config)
        tick = request.progress.task("Transformers NeuronX compile", total=None)
        with sdk_failure("Transformers NeuronX"):
            model = self._model(model_path, spec, str(request.checkpoint.config["model_type"]))
            with cc_flags_env(spec.cc_flags), compile_cache_env(staging / COMPILE_CACHE):
                model.to_neuron()
            model.save(str(staging), sharded_weights=True)
        tick(1)
        graphs = sorted(p.name for p in staging.glob("*.neff"))
        if not graphs:
            raise BuildError("Transformers NeuronX saved no .neff files")
        write_presharded_config(model_path, staging)
        from neuronctl.checkpoints.hub import copy_model_files  # tokenizer; keeps TNx's config.json

        copy_model_files(model_path, staging)
        return BuildResult(graphs=graphs, extra={"NEURON_CC_FLAGS": spec.cc_flags})

    def load(self, path: Path, manifest: Manifest) -> TnxRunner:
        spec = manifest.spec
        model = self._model(path, spec, str(manifest.shape.model_type))
        model.load(str(path))
        try:
            with cc_flags_env(spec.cc_flags), compile_cache_env(path / COMPILE_CACHE):
                model.to_neuron()
        except FileNotFoundError as exc:
            raise NeuronctlError(
                f"Transformers NeuronX found no matching NEFF in {path}: {exc}",
                "the SDK version or a setting differs from the build; run `neuronctl validate`",
            ) from None
        if spec.on_device_sampling:
            # Per batch line, as vLLM's runner does per request: the spec's values.
            model.update_generation_config(
                sdk().GenerationConfig(**tnx_config.runtime_generation_config(spec))
            )
        return TnxRunner(model, spec, manifest.shape.vocab_size or 0)

    def host_checks(self, manifest: Manifest) -> list[Check]:
        return NxdiBackend().host_checks(manifest)


class TnxRunner:
    """TNx continuous batching: forward(input_ids, cache_ids=positions, start_ids=slots), as
    vLLM's TNx integration calls it; returns the last position's logits (not confirmed)."""

    def __init__(self, model: Any, spec: BuildSpec, vocab_size: int) -> None:
        self.model = model
        self.batch_size = spec.batch_size
        self.seq_len = spec.seq_len
        self.max_context_length = spec.effective_max_context_length()
        self.context_buckets = list(spec.context_buckets)  # type: ignore[arg-type]
        self.token_gen_buckets = list(spec.token_gen_buckets)  # type: ignore[arg-type]
        self.vocab_size = vocab_size
        # With on-device generation the model returns token ids, not logits.
        self.on_device_sampling = spec.on_device_sampling is not None
        self.fill = SlotFill(self.batch_size, self.seq_len)

    def prefill(self, slot: int, token_ids: Sequence[int]) -> torch.Tensor:
        n = len(token_ids)
        out = self.model.forward(
            torch.tensor([list(token_ids)], dtype=torch.int64),
            cache_ids=torch.arange(n, dtype=torch.int64).unsqueeze(0),
            start_ids=torch.tensor([slot], dtype=torch.int64),
        )
        self.fill.prefilled(slot, n)
        return last_logits(out, 1, self.vocab_size, self.on_device_sampling)[0]

    def decode(self, token_ids: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        # Idle slots (-1) write at their own next free position: never into a live sequence
        # (a slot prefilled this step is idle in this decode).
        pos = self.fill.positions(positions)
        out = self.model.forward(
            torch.tensor(list(token_ids), dtype=torch.int64).unsqueeze(1),
            cache_ids=torch.tensor(pos, dtype=torch.int64).unsqueeze(1),
            start_ids=torch.arange(self.batch_size, dtype=torch.int64),
        )
        return last_logits(out, self.batch_size, self.vocab_size, self.on_device_sampling)
