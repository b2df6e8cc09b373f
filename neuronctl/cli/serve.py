"""`neuronctl serve`: an OpenAI-compatible server over an artifact (built-in engine or vLLM)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import typer

from neuronctl.cli._common import (
    ENGINES,
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
    from neuronctl.runnable import ArtifactToRun
    from neuronctl.store.signing import TrustPolicy
    from neuronctl.vllm.detect import VllmTarget
    from neuronctl.vllm.launch import VllmLaunch

ORDER = 40
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
    uvicorn_log_level: str = typer.Option(
        "info",
        "--uvicorn-log-level",
        help="The HTTP server's log level (uvicorn's, as vLLM's flag of the same name): "
        + " | ".join(LOG_LEVELS) + ". neuronctl's own is `neuronctl --log-level LEVEL serve`.",
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

    With --engine vllm the same API key, host, port, model name and uvicorn log level reach vLLM's
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
    if uvicorn_log_level.lower() not in LOG_LEVELS:
        raise UsageError(
            f"--uvicorn-log-level: unknown level {uvicorn_log_level!r}",
            "use " + " | ".join(LOG_LEVELS),
        )
    if vllm_target and engine != "vllm":
        raise UsageError("--vllm-target only applies to --engine vllm")
    if engine == "vllm":
        refuse_builtin_only(ctx)
    from neuronctl.runnable import artifact_to_run
    from neuronctl.store.signing import TrustPolicy

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
    given = ctx.get_parameter_source("uvicorn_log_level") is not ParameterSource.DEFAULT
    settings = ServeSettings(
        host=host,
        port=port,
        api_key=api_key,
        served_model_name=served_model_name,
        uvicorn_log_level=uvicorn_log_level.lower(),
        log_level_given=given,
        max_queue=max_queue,
        max_body_bytes=max_body_bytes,
        max_prompt_chars=max_prompt_chars or None,
        dry_run=dry_run,
        json_out=json_out,
    )
    if engine == "vllm":
        _serve_vllm(target, settings, launch_for, policy)
    else:
        _serve_builtin(target, settings, policy)


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
class ServeSettings:
    """How `serve` serves, whichever engine: what it passes on to the server, besides the
    artifact, and how it reports."""

    host: str
    port: int
    api_key: str | None
    served_model_name: str | None
    uvicorn_log_level: str
    log_level_given: bool  # vLLM < 0.6 has no --uvicorn-log-level: passed on only when given
    max_queue: int  # the built-in server's limits (vLLM has no flag for them)
    max_body_bytes: int
    max_prompt_chars: int | None
    dry_run: bool
    json_out: bool


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
    run: ArtifactToRun, settings: ServeSettings, vllm_target: VllmTarget | None,
    policy: TrustPolicy,
) -> None:
    from neuronctl.cli._common import say_vouch
    from neuronctl.store.signing import check_origin
    from neuronctl.vllm.launch import cli_target, serve_launch

    path, manifest = run.path, run.read_manifest()
    assert path is not None
    say_vouch(check_origin(path, manifest, policy))  # vLLM loads the artifact's code itself
    target = cli_target(manifest, vllm_target)
    launch = serve_launch(
        path,
        manifest,
        host=settings.host,
        port=settings.port,
        served_model_name=settings.served_model_name,
        api_key=settings.api_key,
        log_level=settings.uvicorn_log_level if settings.log_level_given else None,
        target=target,
    )
    if settings.dry_run:
        print_launch(launch, settings.json_out)
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


def _serve_builtin(run: ArtifactToRun, settings: ServeSettings, policy: TrustPolicy) -> None:
    from neuronctl.backends import prepare_load

    path = run.path
    assert path is not None
    prepare_load(path)  # on another core, while this one imports the server and torch
    from neuronctl.engine.loader import make_engine, open_artifact
    from neuronctl.server.app import Limits
    from neuronctl.server.run import run_server

    # Validated just before: the load judges the manifest the checks read.
    loaded = open_artifact(path, validate=False, policy=policy, manifest=run.manifest)
    name = settings.served_model_name or loaded.model_name
    runner = loaded.runner
    url = f"http://{settings.host}:{settings.port}/v1"
    plan = {
        "artifact": str(path),
        "served_model_name": name,
        "url": url,
        "batch_size": runner.batch_size,
        "seq_len": runner.seq_len,
        "max_prompt_tokens": min(runner.max_context_length, max(runner.context_buckets)),
        "max_queue": settings.max_queue,
        "auth": settings.api_key is not None,
        "trusted": loaded.vouch.describe() if loaded.vouch else None,
    }
    if settings.dry_run:
        print_plan(plan, settings.json_out)
        return
    from neuronctl.cli._common import say_vouch

    say_vouch(loaded.vouch)

    def banner() -> None:  # once the port is bound: a busy port never prints it
        err_console.print(
            f"serving [bold]{name}[/bold] from {path} on {url} "
            f"({runner.batch_size} slots x {runner.seq_len} tokens)",
            soft_wrap=True,
        )

    run_server(
        make_engine(loaded, settings.max_queue),
        loaded,
        served_model_name=name,
        host=settings.host,
        port=settings.port,
        api_key=settings.api_key,
        max_model_len=runner.seq_len,
        log_level=settings.uvicorn_log_level,
        limits=Limits(settings.max_body_bytes, settings.max_prompt_chars),
        on_ready=banner,
    )


def register(app: typer.Typer) -> None:
    app.command("serve")(serve_command)
