"""The command line and variables that start vLLM over an artifact: the OpenAI server, the
offline generate program (offline.py) or just the environment, from the generation's plan."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuronctl.errors import NeuronctlError
from neuronctl.store.manifest import Manifest
from neuronctl.vllm.artifact import artifact_spec, framework_for
from neuronctl.vllm.detect import VllmTarget, dotted, require_target
from neuronctl.vllm.rules import plan_launch
from neuronctl.vllm_generations import Generation

# The 0.3/0.5 CLI's --block-size choices; 0.6.x-neuron has [8, 16, 32].
OLD_BLOCK_SIZES = (8, 16, 32, 128)


@dataclass
class VllmLaunch:
    argv: list[str]
    env: dict[str, str]  # only the variables neuronctl sets; merged over os.environ by the caller
    target: VllmTarget | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        t = self.target
        return {
            "generation": t.generation.letter if t else None,
            "vllm_target": t.generation.value if t else None,
            "vllm_version": dotted(t.vllm) if t else None,
            "plugin_version": dotted(t.plugin) if t and t.plugin else None,
            "detected": t.detected if t else None,
            "argv": self.argv,
            "env": self.env,
            "notes": self.notes,
        }


def cli_target(
    manifest: Manifest, requested: str | VllmTarget | None, framework: str | None = None
) -> VllmTarget:
    """For the CLI: what is wrong with the artifact first, then which vLLM."""
    framework_for(manifest, framework)
    artifact_spec(manifest)
    return require_target(requested)


def _flag_value(value: Any) -> str:
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(value)


def _flags(args: Mapping[str, Any]) -> list[str]:
    argv: list[str] = []
    for name, value in args.items():
        if value == {} and name == "override_neuron_config":
            continue
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, bool):
            argv.append(flag if value else f"--no-{name.replace('_', '-')}")
        else:
            argv += [flag, _flag_value(value)]
    return argv


def serve_launch(
    artifact: Path,
    manifest: Manifest,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    framework: str | None = None,
    target: str | VllmTarget | None = None,
    extra_args: Sequence[str] = (),
) -> VllmLaunch:
    """The OpenAI-compatible vLLM server over the artifact (the api_server module works in
    every generation, `vllm serve` only in newer ones)."""
    plan = plan_launch(artifact, manifest, target, framework)
    args = dict(plan.args)
    if plan.serve_max_model_len is not None:
        args["max_model_len"] = plan.serve_max_model_len
    if plan.target.generation is Generation.TNX_FORK and "block_size" in args:
        if args["block_size"] not in OLD_BLOCK_SIZES:
            raise NeuronctlError(
                f"vLLM {dotted(plan.target.vllm)}'s CLI cannot take --block-size "
                f"{args['block_size']} (choices {list(OLD_BLOCK_SIZES)}) and TNx needs it equal "
                "to max_model_len",
                "use `neuronctl generate --engine vllm` (offline, no CLI) or vLLM 0.6.x-neuron",
            )
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *_flags(args)]
    argv += ["--host", host, "--port", str(port)]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    argv += list(extra_args)
    return VllmLaunch(argv=argv, env=plan.env, target=plan.target, notes=plan.notes)


def generate_launch(
    artifact: Path,
    manifest: Manifest,
    prompts_file: Path,
    *,
    framework: str | None = None,
    target: str | VllmTarget | None = None,
    sampling: Mapping[str, Any] | None = None,
) -> VllmLaunch:
    """Offline LLM(...).generate over the prompts in `prompts_file` (one per line, or JSONL
    with {"prompt": ...}); prints one JSON line per prompt: {prompt, text, token_ids}."""
    plan = plan_launch(artifact, manifest, target, framework)
    args = {k: v for k, v in plan.args.items() if v != {} or k != "override_neuron_config"}
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
    if plan.max_prompt_tokens is not None:
        argv += ["--max-prompt-tokens", str(plan.max_prompt_tokens)]
    notes = [n for n in plan.notes if not n.startswith("--max-model-len")]
    return VllmLaunch(argv=argv, env=plan.env, target=plan.target, notes=notes)


def env_exports(
    artifact: Path,
    manifest: Manifest,
    framework: str | None = None,
    target: str | VllmTarget | None = None,
) -> dict[str, str]:
    """The variables that make this generation of vLLM reuse the artifact."""
    return plan_launch(artifact, manifest, target, framework).env
