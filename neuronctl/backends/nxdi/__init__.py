"""NxD Inference backend (neuronx-distributed-inference); the SDK imports lazily.

build: NeuronConfig(**kwargs) -> XInferenceConfig(load_config=load_pretrained_config(ckpt))
       -> NeuronXForCausalLM(ckpt, config).compile(staging), with save_sharded_checkpoint=True,
       so staging holds exactly what NxDI's load() and vLLM's NEURON_COMPILED_ARTIFACTS loading
       read: neuron_config.json, model.pt, weights/tp{rank}_sharded_checkpoint.safetensors.
load:  NeuronXForCausalLM(path).load(path) -> NxdiRunner.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuronctl.backends.base import NEURON_CONFIG, BuildRequest, BuildResult
from neuronctl.backends.neuron import cc_flags_env, sdk_failure
from neuronctl.backends.nxdi import sdk
from neuronctl.backends.nxdi.config import check_override, neuron_config_kwargs
from neuronctl.checks import Check
from neuronctl.errors import BuildError, NeuronctlError, SpecError
from neuronctl.sharding import shard_file

if TYPE_CHECKING:
    from neuronctl.backends.base import Runner
    from neuronctl.spec import BuildSpec
    from neuronctl.store.manifest import Manifest

GRAPH = "model.pt"


def shard_name(rank: int) -> str:
    """Where NxD Inference's save_sharded_checkpoint writes a rank's weights."""
    return f"weights/{shard_file(rank)}"


def remove_path(path: Path) -> None:
    """Remove a scratch path whether the SDK left a directory or a file there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def expected_files(tp_degree: int) -> list[str]:
    return [NEURON_CONFIG, GRAPH, *(shard_name(r) for r in range(tp_degree))]


class NxdiBackend:
    name = "nxdi"

    def versions(self, spec: BuildSpec | None = None) -> dict[str, str]:
        # Every compiled result depends on the whole SDK.
        return sdk.versions()

    def architectures(self) -> Mapping[str, str]:
        from neuronctl.families import architectures

        return architectures("nxdi")

    def check(self, spec: BuildSpec, config: Mapping[str, Any]) -> None:
        model_type = config.get("model_type")
        if model_type not in sdk.MODEL_CLASSES:
            raise SpecError(
                "backend",
                f"the nxdi backend has no model class for model_type {model_type!r}",
                "supported: " + ", ".join(sdk.MODEL_CLASSES),
            )
        check_override(spec.override_neuron_config)

    def build(self, request: BuildRequest) -> BuildResult:
        spec, staging = request.spec, request.staging
        model_path = Path(request.checkpoint.path)
        model_type = str(request.checkpoint.config.get("model_type"))
        kwargs = neuron_config_kwargs(spec)
        quant_dir = staging.parent / f"{staging.name}.quantized"
        if spec.quantized:
            # NxDI asserts without quantized_checkpoints_path. save_quantized_state_dict writes
            # safetensors into it when it is an existing directory and torch.save()s one file
            # there otherwise (application_base.py), so it is created first. The artifact's
            # sharded weights are what load() reads: the directory is scratch.
            remove_path(quant_dir)
            quant_dir.mkdir(parents=True)
            kwargs["quantized_checkpoints_path"] = str(quant_dir)
        tick = request.progress.task("NxD Inference compile", total=None)
        try:
            with sdk_failure("NxD Inference"), cc_flags_env(spec.cc_flags):
                self._compile(model_type, model_path, kwargs, spec, staging)
        finally:
            remove_path(quant_dir)
        tick(1)
        missing = [f for f in expected_files(spec.tp_degree) if not (staging / f).is_file()]
        if missing:
            raise BuildError(
                f"NxD Inference compile did not write {', '.join(missing)}",
                "check that this NxD Inference honours save_sharded_checkpoint",
            )
        from neuronctl.checkpoints.hub import copy_model_files  # the tokenizer, saved beside

        copy_model_files(model_path, staging)
        return BuildResult(graphs=[GRAPH], extra={"NEURON_CC_FLAGS": spec.cc_flags})

    def _compile(
        self,
        model_type: str,
        model_path: Path,
        kwargs: dict[str, Any],
        spec: BuildSpec,
        staging: Path,
    ) -> None:
        model_cls, _config_cls = sdk.model_classes(model_type)
        config = sdk.inference_config(model_type, kwargs, str(model_path))
        if spec.draft_model:
            config.fused_spec_config = fused_spec_config(model_cls, model_type, kwargs, spec)
        if spec.quantized:
            model_cls.save_quantized_state_dict(str(model_path), config)
        model = model_cls(str(model_path), config)
        model.compile(str(staging))

    def load(self, path: Path, manifest: Manifest) -> Runner:
        from neuronctl.backends.nxdi.runner import NxdiRunner

        model_type = str(manifest.shape.model_type)
        model_cls, _ = sdk.model_classes(model_type)
        missing = [
            f for f in expected_files(manifest.spec.tp_degree) if not (path / f).is_file()
        ]
        if missing:
            # NxDI itself would raise FileNotFoundError / ValueError deep in load().
            raise NeuronctlError(f"{path} lacks {', '.join(missing)}", "run `neuronctl validate`")
        # With no config given, NxDI reads neuron_config.json from the path (not confirmed);
        # the weights are the pre-sharded ones, so the original checkpoint is not needed.
        model = model_cls(str(path))
        model.load(str(path))
        return NxdiRunner(model, manifest.spec, manifest.shape.vocab_size or 0)

    def host_checks(self, manifest: Manifest) -> list[Check]:
        from neuronctl.doctor import neuron_cores

        tp = manifest.spec.tp_degree
        cores, how = neuron_cores()
        return [
            Check(
                "cores",  # validate's capacity check then stays quiet: said once
                cores >= tp,
                f"tp degree {tp}, {cores} NeuronCores here ({how})"
                + ("" if cores >= tp else ": use a larger Inf2/Trn1 instance"),
            )
        ]


def fused_spec_config(
    model_cls: Any, model_type: str, kwargs: Mapping[str, Any], spec: BuildSpec
) -> Any:
    """The draft model of fused speculation (NxDI's FusedSpecNeuronConfig; not confirmed)."""
    from neuronctl.checkpoints import open_checkpoint

    draft = open_checkpoint(str(spec.draft_model))
    draft_kwargs = {**kwargs, "speculation_length": 0, "enable_fused_speculation": False}
    draft_config = sdk.inference_config(model_type, draft_kwargs, str(draft.path))
    config_mod = sdk.module("models.config")
    return config_mod.FusedSpecNeuronConfig(
        model_cls._model_cls, draft_config=draft_config, draft_model_path=str(draft.path)
    )
