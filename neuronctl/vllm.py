"""Launch vLLM over a neuronctl artifact with exactly the values it was compiled with.

vLLM's Neuron integration checks nothing: a launch whose settings differ from the artifact's,
or one without NEURON_COMPILED_ARTIFACTS, recompiles (and in the default path deletes the
directory first). So every flag and variable here is read from the artifact's manifest, none
from defaults.

Facts used (shared/NEURON_FACTS.md and the seeds):
- VLLM_NEURON_FRAMEWORK picks NxD Inference or Transformers NeuronX.
- NxDI: NEURON_COMPILED_ARTIFACTS names the compiled directory; when it loads, its
  neuron_config.json wins. We still pass the whole NeuronConfig as --override-neuron-config so
  that a fallback recompile (vLLM does one when the load raises FileNotFoundError/ValueError)
  compiles the same thing.
- TNx: buckets come from NEURON_CONTEXT_LENGTH_BUCKETS / NEURON_TOKEN_GEN_BUCKETS, quantization
  from NEURON_QUANT_DTYPE (with --quantization neuron_quant, seed 002), and block_size must
  equal max_model_len (seed 000). vLLM's TNx path reuses compiled NEFFs through the persistent
  compile cache, so the tnx backend fills one inside the artifact and we point
  NEURON_COMPILE_CACHE_URL at it (not confirmed end to end on a Neuron host).

`python -m neuronctl.vllm generate ...` is the small offline program `generate_launch` runs.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from neuronctl.errors import NeuronctlError, UsageError
from neuronctl.spec import BuildSpec
from neuronctl.store.manifest import Manifest

NXDI = "neuronx-distributed-inference"
TNX = "transformers-neuronx"
FRAMEWORK_BACKENDS = {NXDI: "nxdi", TNX: "tnx"}
FRAMEWORK_ALIASES = {"nxdi": NXDI, "tnx": TNX, NXDI: NXDI, TNX: TNX}
# neuronctl's quantization dtype -> vLLM's NEURON_QUANT_DTYPE spelling.
QUANT_ENV = {"int8": "s8", "f8e4m3fn": "f8e4m3fn"}
TNX_COMPILE_CACHE = "neuron-compile-cache"  # inside a tnx artifact (backends/tnx COMPILE_CACHE)


@dataclass
class VllmLaunch:
    argv: list[str]
    env: dict[str, str]  # only the variables neuronctl sets; merged over os.environ by the caller


def artifact_spec(manifest: Manifest) -> BuildSpec:
    try:
        spec = BuildSpec.model_validate(manifest.spec)
    except ValidationError as exc:
        raise NeuronctlError(
            f"the artifact's manifest has an unreadable spec: {exc.errors()[0]['msg']}"
        ) from None
    if spec.dtype == "auto" or "auto" in (spec.context_buckets, spec.token_gen_buckets):
        raise NeuronctlError("the artifact's manifest spec is not finalized (has 'auto' values)")
    return spec


def framework_for(manifest: Manifest, framework: str | None = None) -> str:
    """The vLLM framework that can load this artifact; `framework` may only confirm it."""
    native = {v: k for k, v in FRAMEWORK_BACKENDS.items()}.get(manifest.backend)
    if native is None:
        raise UsageError(
            f"this artifact was built by the {manifest.backend!r} backend, which vLLM cannot load",
            "serve it with `neuronctl serve` (built-in engine) or rebuild with --backend nxdi",
        )
    if framework is None:
        return native
    wanted = FRAMEWORK_ALIASES.get(framework)
    if wanted is None:
        raise UsageError(f"unknown framework {framework!r}", "use nxdi or tnx")
    if wanted != native:
        # vLLM would fail to load it with the other library and recompile.
        raise UsageError(
            f"this artifact was compiled for {native}, not {wanted}",
            f"use --framework {manifest.backend} or rebuild with "
            f"--backend {FRAMEWORK_BACKENDS[wanted]}",
        )
    return native


def _ints(values: Sequence[int]) -> str:
    return ",".join(str(v) for v in values)


def env_exports(
    artifact: Path, manifest: Manifest, framework: str | None = None
) -> dict[str, str]:
    """The variables that make vLLM reuse the artifact instead of recompiling."""
    fw = framework_for(manifest, framework)
    spec = artifact_spec(manifest)
    root = artifact.resolve()
    env = {
        "NEURON_COMPILED_ARTIFACTS": str(root),
        "VLLM_NEURON_FRAMEWORK": fw,
        "NEURON_CONTEXT_LENGTH_BUCKETS": _ints(spec.context_buckets),  # type: ignore[arg-type]
        "NEURON_TOKEN_GEN_BUCKETS": _ints(spec.token_gen_buckets),  # type: ignore[arg-type]
    }
    if spec.quantized:
        env["NEURON_QUANT_DTYPE"] = QUANT_ENV[spec.quantization_dtype]
    cc_flags = spec.cc_flags or str(manifest.host.get("NEURON_CC_FLAGS", ""))
    if cc_flags:
        env["NEURON_CC_FLAGS"] = cc_flags
    if fw == TNX:
        env["NEURON_COMPILE_CACHE_URL"] = str(root / TNX_COMPILE_CACHE)
    return env


def override_neuron_config(spec: BuildSpec, framework: str) -> dict[str, Any]:
    if framework == NXDI:
        from neuronctl.backends.nxdi.config import neuron_config_kwargs

        return neuron_config_kwargs(spec)
    from neuronctl.backends.tnx.config import vllm_override

    return vllm_override(spec)


def engine_args(artifact: Path, manifest: Manifest, framework: str | None = None) -> dict[str, Any]:
    """vLLM engine arguments (LLM(...) keywords; the CLI flags are their dashed names)."""
    fw = framework_for(manifest, framework)
    spec = artifact_spec(manifest)
    args: dict[str, Any] = {
        # The artifact holds config.json and the tokenizer, so it is the model directory too.
        "model": str(artifact.resolve()),
        "device": "neuron",
        "tensor_parallel_size": spec.tp_degree,
        "max_num_seqs": spec.batch_size,
        "max_model_len": spec.seq_len,
        # Neuron keeps one contiguous KV block per sequence; TNx requires block_size ==
        # max_model_len (seed 000) and the NxDI integration sizes blocks the same way (seed 002).
        "block_size": spec.seq_len,
        "dtype": spec.dtype,
        "override_neuron_config": override_neuron_config(spec, fw),
    }
    if spec.draft_model:
        args["speculative_model"] = spec.draft_model
        args["num_speculative_tokens"] = spec.num_speculative_tokens
        args["speculative_max_model_len"] = spec.seq_len
    if fw == TNX and spec.quantized:
        args["quantization"] = "neuron_quant"
    return args


def _flag_value(value: Any) -> str:
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(value)


def serve_launch(
    artifact: Path,
    manifest: Manifest,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    framework: str | None = None,
    extra_args: Sequence[str] = (),
) -> VllmLaunch:
    """The OpenAI-compatible vLLM server over the artifact (the api_server module works in
    every vLLM version the seeds cover, `vllm serve` only in newer ones)."""
    args = engine_args(artifact, manifest, framework)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    for name, value in args.items():
        argv += [f"--{name.replace('_', '-')}", _flag_value(value)]
    argv += ["--host", host, "--port", str(port)]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    argv += list(extra_args)
    return VllmLaunch(argv=argv, env=env_exports(artifact, manifest, framework))


def generate_launch(
    artifact: Path,
    manifest: Manifest,
    prompts_file: Path,
    *,
    framework: str | None = None,
    sampling: Mapping[str, Any] | None = None,
) -> VllmLaunch:
    """Offline LLM(...).generate over the prompts in `prompts_file` (one per line, or JSONL
    with {"prompt": ...}); prints one JSON line per prompt: {prompt, text, token_ids}."""
    args = engine_args(artifact, manifest, framework)
    argv = [
        sys.executable,
        "-m",
        "neuronctl.vllm",
        "generate",
        "--engine-args",
        json.dumps(args, sort_keys=True),
        "--prompts",
        str(prompts_file.resolve()),
        "--sampling",
        json.dumps(dict(sampling or {}), sort_keys=True),
    ]
    return VllmLaunch(argv=argv, env=env_exports(artifact, manifest, framework))


def vllm_dirname_exact(spec: BuildSpec, config: Mapping[str, Any]) -> tuple[str, bool]:
    """The md5 directory name vLLM's NxDI path computes under
    `<model>/neuron-compiled-artifacts/`, and whether it is exact.

    vLLM hashes `InferenceConfig.to_json_string()` = json.dumps(to_dict, indent=2,
    sort_keys=True) of the config it builds: its default NeuronConfig with
    override_neuron_config merged over it (we pass the whole NeuronConfig as the override).
    With the SDK installed the real InferenceConfig is built and the name is exact. Without it,
    to_dict is approximated as the HF config plus {"neuron_config": kwargs}: NeuronConfig.to_dict
    also lists every default we do not set, so this name is NOT the one vLLM would compute.
    """
    from neuronctl.backends.nxdi.config import neuron_config_kwargs

    kwargs = neuron_config_kwargs(spec)
    try:
        from neuronctl.backends.nxdi.sdk import inference_config_json

        text = inference_config_json(kwargs, config)
        exact = True
    except ImportError:
        data = {**dict(config), "neuron_config": kwargs}
        text = json.dumps(data, indent=2, sort_keys=True)
        exact = False
    return hashlib.md5(text.encode()).hexdigest(), exact


def vllm_dirname(spec: BuildSpec, config: Mapping[str, Any]) -> str:
    return vllm_dirname_exact(spec, config)[0]


# --- the offline program generate_launch runs (inside the vLLM environment) ---


def read_prompts(path: Path) -> list[str]:
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if path.suffix != ".jsonl":
        return lines
    prompts = []
    for line in lines:
        item = json.loads(line)
        prompts.append(item if isinstance(item, str) else item["prompt"])
    return prompts


def _generate_main(argv: Sequence[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m neuronctl.vllm generate")
    parser.add_argument("--engine-args", required=True)
    parser.add_argument("--prompts", required=True, type=Path)
    parser.add_argument("--sampling", default="{}")
    opts = parser.parse_args(argv)
    from vllm import LLM, SamplingParams  # only present on the serving host

    llm = LLM(**json.loads(opts.engine_args))
    prompts = read_prompts(opts.prompts)
    outputs = llm.generate(prompts, SamplingParams(**json.loads(opts.sampling)))
    for prompt, out in zip(prompts, outputs, strict=True):
        first = out.outputs[0]
        row = {"prompt": prompt, "text": first.text, "token_ids": list(first.token_ids)}
        sys.stdout.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["generate"]:
        sys.exit("usage: python -m neuronctl.vllm generate --engine-args JSON --prompts FILE")
    sys.exit(_generate_main(sys.argv[2:]))
