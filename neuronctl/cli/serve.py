"""`neuronctl serve`: an OpenAI-compatible server over an artifact (built-in engine or vLLM)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from neuronctl.cli._common import (
    AllowUnsignedOpt,
    ArtifactArg,
    ArtifactsOpt,
    ConfigOpt,
    JsonOpt,
    StoreOpt,
    TrustKeyOpt,
    console,
    err_console,
    one_artifact,
    print_json,
    with_spec_options,
)
from neuronctl.cli._typer_internals import ParameterSource
from neuronctl.errors import UsageError
from neuronctl.vllm.detect import TARGET_HELP as VLLM_TARGET_HELP

if TYPE_CHECKING:
    from neuronctl.store.signing import TrustPolicy
    from neuronctl.vllm.detect import VllmTarget
    from neuronctl.vllm.launch import VllmLaunch

ORDER = 40
ENGINES = ("builtin", "vllm")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


@with_spec_options
def serve_command(
    spec_flags: dict[str, Any],
    ctx: typer.Context,
    artifact: ArtifactArg = None,
    artifacts: ArtifactsOpt = None,
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to bind (0.0.0.0: all)."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="TCP port."),
    api_key: str | None = typer.Option(
        None,
        "--api-key",
        envvar="NEURONCTL_API_KEY",
        help="Require 'Authorization: Bearer KEY' on /v1 (default: $NEURONCTL_API_KEY; "
        "vLLM gets it as $VLLM_API_KEY, never on its command line).",
        show_default=False,
    ),
    served_model_name: str | None = typer.Option(
        None,
        "--served-model-name",
        help="Model id clients send (default: the model the artifact was compiled from).",
        show_default=False,
    ),
    max_queue: int = typer.Option(
        256,
        "--max-queue",
        min=0,
        help="Requests allowed to wait for a slot; beyond it, 429 (builtin only).",
    ),
    max_body_bytes: int = typer.Option(
        8 * 1024 * 1024,
        "--max-body-bytes",
        min=1,
        help="Largest request body; beyond it, 413 (builtin only).",
    ),
    max_prompt_chars: int = typer.Option(
        0,
        "--max-prompt-chars",
        min=0,
        help="Longest prompt text; beyond it, 400 (0: 32 per prompt token, at least 65536; "
        "builtin only).",
    ),
    engine: str = typer.Option("builtin", "--engine", help="builtin | vllm."),
    vllm_target: str | None = typer.Option(
        None, "--vllm-target", help="With --engine vllm: " + VLLM_TARGET_HELP, show_default=False
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Validate and print what would run, without serving."
    ),
    compile_if_missing: bool = typer.Option(
        False,
        "--compile-if-missing",
        help="If the artifact is missing or not reusable, compile --model first (opt-in).",
    ),
    model: str | None = typer.Option(
        None,
        "--model",
        help="Checkpoint to compile with --compile-if-missing (spec from the flags / -c).",
        show_default=False,
    ),
    config: ConfigOpt = None,
    store: StoreOpt = None,
    log_level: str = typer.Option(
        "info", "--log-level", help="uvicorn log level: " + " | ".join(LOG_LEVELS) + "."
    ),
    trust_key: TrustKeyOpt = None,
    allow_unsigned: AllowUnsignedOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Serve an artifact over the OpenAI API, as vLLM's server does: /v1/models,
    /v1/completions, /v1/chat/completions (streaming with stream=true), /health, /ping,
    /version, /tokenize, /detokenize, /metrics (vllm:* names), /docs.

    serve never compiles unless --compile-if-missing is given: a missing or non-reusable
    artifact exits 1 with the reasons. SIGTERM stops accepting, finishes in-flight requests
    and exits 0. A full queue answers 429.

    With --engine vllm the same API key, host, port, model name and log level reach vLLM's
    server; --max-queue, --max-body-bytes and --max-prompt-chars, which it has no flag for,
    are refused. --dry-run prints the launch to paste on the serving host (`python3`, the
    key as $VLLM_API_KEY, never its value).

    Examples:

      neuronctl serve ./neuron-compiled-artifacts/3f2a... --port 8000

      NEURONCTL_API_KEY=secret neuronctl serve --host 0.0.0.0

      neuronctl serve --engine vllm --dry-run --json

      neuronctl serve --engine vllm --vllm-target plugin@0.4.1 --dry-run

    Exit codes: 0 stopped cleanly, 1 artifact missing / not reusable / server failed,
    2 usage error.
    """
    if engine not in ENGINES:
        raise UsageError(f"--engine: unknown engine {engine!r}", "use builtin or vllm")
    if log_level.lower() not in LOG_LEVELS:
        raise UsageError(
            f"--log-level: unknown level {log_level!r}", "use " + " | ".join(LOG_LEVELS)
        )
    log_level = log_level.lower()
    if vllm_target and engine != "vllm":
        raise UsageError("--vllm-target only applies to --engine vllm")
    if engine == "vllm":
        refuse_builtin_only(ctx)
    from neuronctl.store.signing import TrustPolicy
    from neuronctl.target import artifact_to_run

    launch_for, serving_host = named_target(vllm_target, dry_run)
    policy = TrustPolicy.load(trust_key, allow_unsigned)
    target = artifact_to_run(
        one_artifact(ctx, artifact, artifacts),
        spec_flags=spec_flags,
        config=config,
        store=store,
        compile_if_missing=compile_if_missing,
        model=model,
        dry_run=dry_run,
        policy=policy,
        serving_host=serving_host,
    )
    if target.path is None:  # a dry run that would pull or compile first: nothing to load
        print_plan(target.plan(), json_out)
        return
    path = target.path
    if engine == "vllm":
        from neuronctl.cli._common import say_vouch
        from neuronctl.engine.loader import vouch_for

        say_vouch(vouch_for(path, policy))  # vLLM loads the artifact's code itself
        given = ctx.get_parameter_source("log_level") is not ParameterSource.DEFAULT
        server = VllmServer(host, port, api_key, served_model_name, log_level if given else None)
        _serve_vllm(path, server, launch_for, dry_run, json_out)
        return
    from neuronctl.backends import prepare_load

    prepare_load(path)  # on another core, while this one imports the server and torch
    from neuronctl.server.app import Limits

    limits = Limits(max_body_bytes, max_prompt_chars or None)
    _serve_builtin(
        path, host, port, api_key, served_model_name, max_queue, dry_run, json_out, log_level,
        limits, policy,
    )  # fmt: skip


# The built-in server's own limits: vLLM's OpenAI server has no such flag in any generation
# (entrypoints/openai/cli_args.py), so they are refused rather than silently dropped.
BUILTIN_ONLY = {
    "max_queue": "--max-queue (vLLM queues every request it is sent, without a cap)",
    "max_body_bytes": "--max-body-bytes (vLLM's server has no request-size limit)",
    "max_prompt_chars": "--max-prompt-chars (vLLM caps prompts in tokens, by --max-model-len)",
}


def refuse_builtin_only(ctx: typer.Context) -> None:
    for name, why in BUILTIN_ONLY.items():
        if ctx.get_parameter_source(name) is not ParameterSource.DEFAULT:
            raise UsageError(
                f"{why} applies to --engine builtin only",
                "leave it out with --engine vllm, or put a proxy in front of vLLM",
            )


@dataclass(frozen=True)
class VllmServer:
    """What `serve` passes on to vLLM's server, besides the artifact."""

    host: str
    port: int
    api_key: str | None
    served_model_name: str | None
    log_level: str | None  # only when given: vLLM < 0.6 has no --uvicorn-log-level


def named_target(vllm_target: str | None, dry_run: bool) -> tuple[VllmTarget | None, bool]:
    """The vLLM named by --vllm-target, and whether this host is the one that serves it. The
    name is read first: a typo is a usage error, whatever the artifact's state. A dry run for
    a named vLLM only prints its launch, so this host need not be the serving host."""
    from neuronctl.vllm.detect import parse_target

    target = parse_target(vllm_target) if vllm_target else None
    serving_host = not (dry_run and target is not None)
    if not serving_host:
        err_console.print(
            "dry run for --vllm-target: skipping the checks of the serving host (Neuron SDK "
            "versions, NeuronCores, NEURON_CC_FLAGS); run without --dry-run there",
            soft_wrap=True,
        )
    return target, serving_host


def _serve_vllm(
    path: Path, server: VllmServer, vllm_target: VllmTarget | None, dry_run: bool, json_out: bool
) -> None:
    from neuronctl.store.manifest import read_manifest
    from neuronctl.vllm.launch import cli_target, serve_launch

    manifest = read_manifest(path)
    target = cli_target(manifest, vllm_target)
    launch = serve_launch(
        path,
        manifest,
        host=server.host,
        port=server.port,
        served_model_name=server.served_model_name,
        api_key=server.api_key,
        log_level=server.log_level,
        target=target,
    )
    if dry_run:
        print_launch(launch, json_out)
        return
    _print_notes(launch)
    from neuronctl.store.lease import hold

    hold(path, across_exec=True)  # vLLM holds the lease on: gc keeps what it serves
    # exec, so that signals (SIGTERM from an orchestrator) reach vLLM directly.
    os.execvpe(launch.argv[0], launch.argv, {**os.environ, **launch.env})


def print_plan(plan: dict[str, Any], json_out: bool) -> None:
    if json_out:
        print_json(plan)
    else:
        console.print(" ".join(f"{k}={v}" for k, v in plan.items()), soft_wrap=True)


def print_launch(launch: VllmLaunch, json_out: bool) -> None:
    """What would run, to paste on the serving host: the generation (stderr), the exports
    and the command (vllm.launch.shell_lines: no secret, no path of this host's Python)."""
    from neuronctl.vllm.launch import shell_lines

    if json_out:
        print_json(launch.as_dict())
        return
    _print_notes(launch)
    for line in shell_lines(launch):
        console.print(line, soft_wrap=True, highlight=False, markup=False)


def _print_notes(launch: VllmLaunch) -> None:
    if launch.target is not None:
        err_console.print(f"vLLM generation {launch.target.describe()}", soft_wrap=True)
    for note in launch.notes:
        err_console.print(f"note: {note}", soft_wrap=True, markup=False)


def _serve_builtin(
    path: Path,
    host: str,
    port: int,
    api_key: str | None,
    served_model_name: str | None,
    max_queue: int,
    dry_run: bool,
    json_out: bool,
    log_level: str,
    limits: Any,
    policy: TrustPolicy,
) -> None:
    from neuronctl.engine.loader import make_engine, open_artifact
    from neuronctl.server.run import run_server

    loaded = open_artifact(path, validate=False, policy=policy)  # validated just before
    name = served_model_name or loaded.model_name
    runner = loaded.runner
    plan = {
        "artifact": str(path),
        "served_model_name": name,
        "url": f"http://{host}:{port}/v1",
        "batch_size": runner.batch_size,
        "seq_len": runner.seq_len,
        "max_prompt_tokens": min(runner.max_context_length, max(runner.context_buckets)),
        "max_queue": max_queue,
        "auth": api_key is not None,
        "trusted": loaded.vouch.describe() if loaded.vouch else None,
    }
    if dry_run:
        print_plan(plan, json_out)
        return
    from neuronctl.cli._common import say_vouch

    say_vouch(loaded.vouch)

    def banner() -> None:  # once the port is bound: a busy port never prints it
        err_console.print(
            f"serving [bold]{name}[/bold] from {path} on {plan['url']} "
            f"({runner.batch_size} slots x {runner.seq_len} tokens)",
            soft_wrap=True,
        )

    run_server(
        make_engine(loaded, max_queue),
        loaded,
        served_model_name=name,
        host=host,
        port=port,
        api_key=api_key,
        max_model_len=runner.seq_len,
        log_level=log_level,
        limits=limits,
        on_ready=banner,
    )


def register(app: typer.Typer) -> None:
    app.command("serve")(serve_command)
