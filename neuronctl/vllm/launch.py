"""The command line and variables that start vLLM over an artifact: the OpenAI server, the
offline generate program (offline.py) or just the environment, from the generation's plan."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuronctl.errors import NeuronctlError, UsageError
from neuronctl.store.manifest import Manifest, Source, served_name
from neuronctl.vllm.artifact import artifact_spec, framework_for
from neuronctl.vllm.detect import VllmTarget, dotted, require_target
from neuronctl.vllm.rules import STDIN, plan_launch
from neuronctl.vllm_generations import Generation

# The 0.3/0.5 CLI's --block-size choices; 0.6.x-neuron has [8, 16, 32].
OLD_BLOCK_SIZES = (8, 16, 32, 128)
# Every generation's OpenAI server reads the key from this variable as well as --api-key
# (api_server.py: `envs.VLLM_API_KEY or args.api_key`, upstreaming-to-vllm v0.6.x-neuron :436,
# neuron-2.24-vllm-v0.7.2 :688, main dd417b3 :1063), so it never shows in `ps`.
API_KEY_ENV = "VLLM_API_KEY"
# --uvicorn-log-level is in cli_args.py from 0.6 (v0.6.x-neuron cli_args.py:82) on.
UVICORN_LOG_LEVEL_FROM = (0, 6)
PYTHON = "python3"  # a printed launch runs in the serving host's Python, not this one
HEREDOC_END = "NEURONCTL_PROMPTS"  # never a JSONL line: those start with {


@dataclass
class VllmLaunch:
    argv: list[str]
    env: dict[str, str]  # only the variables neuronctl sets; merged over os.environ by the caller
    target: VllmTarget | None = None
    notes: list[str] = field(default_factory=list)
    secrets: frozenset[str] = frozenset()  # names in `env` whose values are never printed
    stdin: str | None = None  # what the command reads on its standard input (a dry run's)

    def as_dict(self) -> dict[str, Any]:
        """What a dry run prints: the secrets' names, never their values."""
        t = self.target
        return {
            "generation": t.generation.letter if t else None,
            "vllm_target": t.generation.value if t else None,
            "vllm_version": dotted(t.vllm) if t else None,
            "plugin_version": dotted(t.plugin) if t and t.plugin else None,
            "detected": t.detected if t else None,
            "argv": [PYTHON if self.argv[0] == sys.executable else self.argv[0], *self.argv[1:]],
            "env": {k: v for k, v in self.env.items() if k not in self.secrets},
            "secret_env": sorted(self.secrets),
            "stdin": self.stdin,
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


def _hub_name(manifest: Manifest) -> str | None:
    """The name the built-in server gives the model. A manifest made without validation
    (`Manifest.model_construct`, as the real-source harness builds one) may hold its source
    as a plain mapping, or none: then the artifact's folder names the model."""
    source = manifest.source
    if not isinstance(source, Source):
        return None
    return served_name(source.model, source.revision)


def serve_launch(
    artifact: Path,
    manifest: Manifest,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    api_key: str | None = None,
    log_level: str | None = None,
    framework: str | None = None,
    target: str | VllmTarget | None = None,
    extra_args: Sequence[str] = (),
) -> VllmLaunch:
    """The OpenAI-compatible vLLM server over the artifact (the api_server module works in
    every generation, `vllm serve` only in newer ones). Clients call the model by the name
    the built-in server gives it (the Hub id), not by the artifact's path; the API key goes
    in the environment, never on the command line."""
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
    name = served_model_name or _hub_name(manifest)
    argv += ["--served-model-name", name or artifact.resolve().name]
    if log_level is not None:
        if plan.target.vllm < UVICORN_LOG_LEVEL_FROM:
            raise UsageError(
                f"--uvicorn-log-level: vLLM {dotted(plan.target.vllm)} has no --uvicorn-log-level",
                "leave --uvicorn-log-level out for this vLLM",
            )
        argv += ["--uvicorn-log-level", log_level]
    argv += list(extra_args)
    env, secrets = dict(plan.env), set()
    if api_key:
        env[API_KEY_ENV] = api_key
        secrets.add(API_KEY_ENV)
    return VllmLaunch(
        argv, env, target=plan.target, notes=plan.notes, secrets=frozenset(secrets)
    )


def generate_launch(
    artifact: Path,
    manifest: Manifest,
    prompts_file: Path | None,
    *,
    framework: str | None = None,
    target: str | VllmTarget | None = None,
    sampling: Mapping[str, Any] | None = None,
) -> VllmLaunch:
    """Offline LLM(...).generate over the prompts in `prompts_file` (one per line, or JSONL
    with {"prompt": ...}; None: JSONL on standard input); prints one JSON line per prompt:
    {prompt, text, token_ids}."""
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
        STDIN if prompts_file is None else str(prompts_file.resolve()),
        "--sampling",
        json.dumps(dict(sampling or {}), sort_keys=True),
    ]
    if plan.max_prompt_tokens is not None:
        argv += ["--max-prompt-tokens", str(plan.max_prompt_tokens)]
    notes = [n for n in plan.notes if not n.startswith("--max-model-len")]
    return VllmLaunch(argv=argv, env=plan.env, target=plan.target, notes=notes)


def shell_lines(launch: VllmLaunch) -> list[str]:
    """The launch as lines to paste into a shell on the serving host: `python3` for this
    host's interpreter, `"$HOME"/...` for paths in this user's home (where the default store
    is on every host), each secret taken from that host's environment and never printed, and
    what the command reads on standard input as a here-document."""
    lines = []
    for name, value in sorted(launch.env.items()):
        if name in launch.secrets:
            lines.append(f'export {name}="${{{name}:?set {name} to the API key}}"')
        else:
            lines.append(f"export {name}={_home_relative(value)}")
    argv = [PYTHON if launch.argv[0] == sys.executable else launch.argv[0], *launch.argv[1:]]
    command = " ".join(_home_relative(arg) for arg in argv)
    if launch.stdin is None:
        return [*lines, command]
    return [*lines, f"{command} <<'{HEREDOC_END}'", *launch.stdin.splitlines(), HEREDOC_END]


def _home_relative(arg: str) -> str:
    """One shell word; a path under $HOME spelled from "$HOME"."""
    import shlex

    home = str(Path.home())
    if home != "/" and (arg == home or arg.startswith(home + "/")):
        rest = arg[len(home):]
        return '"$HOME"' + (shlex.quote(rest) if rest else "")
    return shlex.quote(arg)


def env_exports(
    artifact: Path,
    manifest: Manifest,
    framework: str | None = None,
    target: str | VllmTarget | None = None,
) -> dict[str, str]:
    """The variables that make this generation of vLLM reuse the artifact."""
    return plan_launch(artifact, manifest, target, framework).env


def run_with_prompts(lines: str, launch_for: Callable[[Path | None], VllmLaunch]) -> int:
    """Run the vLLM program (`generate` with --engine vllm) over the prompts in a temporary
    file, removed when it exits; its exit status. SIGTERM and SIGHUP are passed on to it;
    Ctrl-C reaches it from the terminal."""
    import os
    import signal
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="neuronctl-prompts-") as folder:
        prompts_file = Path(folder) / "prompts.jsonl"
        prompts_file.write_text(lines)
        launch = launch_for(prompts_file)
        child = subprocess.Popen(launch.argv, env={**os.environ, **launch.env})
        forwarded = (signal.SIGTERM, signal.SIGHUP)
        previous = {sig: signal.signal(sig, lambda n, _: child.send_signal(n)) for sig in forwarded}
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            return child.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
