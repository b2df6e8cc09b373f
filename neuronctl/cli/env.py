"""`neuronctl env ARTIFACT`: the exports that make vLLM reuse an artifact as-is."""

from __future__ import annotations

import shlex
from enum import StrEnum
from typing import Annotated

import typer

from neuronctl.cli._common import ArtifactArg, ArtifactsOpt, StoreOpt, one_artifact, print_json
from neuronctl.vllm.detect import TARGET_HELP

ORDER = 45

HELP = (
    "Print the environment that makes vLLM load ARTIFACT (a KEY, unique key prefix or PATH, "
    "as every command takes it) instead of recompiling.\n\n"
    "Without NEURON_COMPILED_ARTIFACTS, vLLM's Neuron integration falls into its default path, "
    "<model>/neuron-compiled-artifacts/<md5>/, which it deletes and recompiles on every start "
    "(15-60 minutes for a real model). Which variables a vLLM reads depends on its generation "
    "(the installed one, or --vllm-target): NxD Inference artifacts get "
    "NEURON_COMPILED_ARTIFACTS, Transformers NeuronX ones their buckets, quantization and "
    "compile cache; every value comes from the artifact's manifest. The flags vLLM needs too "
    "are printed by `neuronctl serve --engine vllm --dry-run`.\n\n"
    "Examples:\n\n"
    '  eval "$(neuronctl env ./neuron-compiled-artifacts/3f2a...)"\n\n'
    "  neuronctl env $ART --vllm-target plugin@0.4.1 --shell fish | source\n\n"
    "  neuronctl env $ART --json\n\n"
    "Exit codes: 0 ok, 1 ARTIFACT is not found or that vLLM cannot reuse it, 2 usage error "
    "(e.g. a framework the artifact was not compiled for, no vLLM installed and no "
    "--vllm-target)."
)


class Shell(StrEnum):
    bash = "bash"
    fish = "fish"


def fish_quote(value: str) -> str:
    # In fish single quotes only \\ and \' are escapes (POSIX shlex.quote is wrong there).
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def exports_text(env: dict[str, str], shell: Shell) -> str:
    if shell is Shell.fish:
        return "".join(f"set -gx {k} {fish_quote(v)}\n" for k, v in env.items())
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())


def env_command(
    ctx: typer.Context,
    artifact: ArtifactArg = None,
    artifacts: ArtifactsOpt = None,
    framework: Annotated[
        str | None,
        typer.Option(
            "--framework",
            help="nxdi | tnx (default: the backend the artifact was built with; another one "
            "is refused because vLLM would recompile).",
            show_default=False,
        ),
    ] = None,
    vllm_target: Annotated[
        str | None, typer.Option("--vllm-target", help=TARGET_HELP, show_default=False)
    ] = None,
    shell: Annotated[Shell, typer.Option("--shell", help="Output syntax.")] = Shell.bash,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print the variables as one JSON object.")
    ] = False,
    store: StoreOpt = None,
) -> None:
    from neuronctl.store.manifest import read_manifest
    from neuronctl.store.resolve import resolve_artifact
    from neuronctl.vllm.launch import cli_target, env_exports

    path = resolve_artifact(one_artifact(ctx, artifact, artifacts), store, fetch=False)  # no pull
    manifest = read_manifest(path)  # first: a clear error when it is not an artifact
    env = env_exports(path, manifest, framework, cli_target(manifest, vllm_target, framework))
    if json_out:
        print_json(env)
    else:
        typer.echo(exports_text(env, shell), nl=False)


def register(app: typer.Typer) -> None:
    app.command("env", help=HELP)(env_command)
