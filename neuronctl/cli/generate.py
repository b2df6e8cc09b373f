"""`neuronctl generate`: offline generation from an artifact, all prompts batched together."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from neuronctl.cli._common import (
    ENGINES,
    AllowUnsignedOpt,
    ArtifactArg,
    ArtifactsOpt,
    JsonOpt,
    StoreOpt,
    TrustKeyOpt,
    console,
    err_console,
    one_artifact,
    say_vouch,
)
from neuronctl.errors import UsageError
from neuronctl.prompts import Prompt, collect_prompts, params_for
from neuronctl.vllm.detect import TARGET_HELP as VLLM_TARGET_HELP

if TYPE_CHECKING:  # the engine imports torch: keep it off every command's start-up
    from neuronctl.engine.engine import RequestHandle
    from neuronctl.engine.request import Event, RequestOutput
    from neuronctl.engine.sampling import SamplingParams
    from neuronctl.store.signing import TrustPolicy
    from neuronctl.vllm.launch import VllmLaunch

ORDER = 35


def generate_command(
    ctx: typer.Context,
    artifact: ArtifactArg = None,
    artifacts: ArtifactsOpt = None,
    prompt: list[str] | None = typer.Option(
        None, "--prompt", "-p", help="A prompt; repeat for several.", show_default=False
    ),
    file: Path | None = typer.Option(
        None, "--file", help="Prompts, one per line ('-': stdin).", show_default=False
    ),
    jsonl: Path | None = typer.Option(
        None,
        "--jsonl",
        help='JSON lines: {"prompt": ...} or {"messages": [...]}, optionally with '
        "max_tokens, temperature, top_k, top_p, seed, stop, ignore_eos.",
        show_default=False,
    ),
    max_tokens: int | None = typer.Option(
        64, "--max-tokens", min=1, help="Most new tokens per prompt."
    ),
    temperature: float = typer.Option(0.0, "--temperature", min=0, help="0 = greedy."),
    top_k: int = typer.Option(-1, "--top-k", help="-1 = the artifact's global top_k (256)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass, (0, 1]."),
    seed: int | None = typer.Option(
        None, "--seed", help="Sampling seed (same seed, same output).", show_default=False
    ),
    stop: list[str] | None = typer.Option(
        None, "--stop", help="Stop string; repeat for several.", show_default=False
    ),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep going past EOS."),
    chat: bool = typer.Option(False, "--chat", help="Wrap prompts in the chat template."),
    stream: bool = typer.Option(False, "--stream", help="Print tokens as they come."),
    engine: str = typer.Option("builtin", "--engine", help="builtin | vllm."),
    vllm_target: str | None = typer.Option(
        None, "--vllm-target", help="With --engine vllm: " + VLLM_TARGET_HELP, show_default=False
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="With --engine vllm: print the command instead of running it."
    ),
    store: StoreOpt = None,
    trust_key: TrustKeyOpt = None,
    allow_unsigned: AllowUnsignedOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Generate text from an artifact; every prompt goes through the engine together
    (continuous batching over the artifact's slots).

    With --json: one JSON object per prompt per line (text, token_ids, finish_reason,
    timings); with --stream too, one line per token as it comes, then those objects.

    Examples:

      neuronctl generate $DIR -p "The capital of France is" --max-tokens 16

      neuronctl generate --file prompts.txt --temperature 0.8 --top-p 0.95 --seed 1 --json

      neuronctl generate --chat -p "Say hi" --stream

    Exit codes: 0 ok, 1 artifact missing / not reusable / generation failed, 2 usage error.
    """
    if engine not in ENGINES:
        raise UsageError(f"--engine: unknown engine {engine!r}", "use builtin or vllm")
    prompts = collect_prompts(prompt or [], file, jsonl, chat)
    ref = one_artifact(ctx, artifact, artifacts)
    if engine == "builtin" and not (dry_run or vllm_target):
        prepare_before_torch(ref, store)
    from neuronctl.engine.sampling import SamplingParams  # imports torch

    params = SamplingParams(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        max_tokens=max_tokens,
        stop=tuple(stop or ()),
        ignore_eos=ignore_eos,
    )
    from neuronctl.store.signing import TrustPolicy

    policy = TrustPolicy.load(trust_key, allow_unsigned)
    named = Named(ref, store, policy)
    if engine == "vllm":
        _generate_vllm(named, prompts, params, vllm_target, dry_run, json_out)
        return
    if dry_run or vllm_target:
        raise UsageError("--dry-run and --vllm-target only apply to --engine vllm")
    _generate_builtin(named, prompts, params, stream, json_out)


@dataclass(frozen=True)
class Named:
    """The artifact the user named, and where and how to look it up."""

    ref: str | None
    store: Path | None
    policy: TrustPolicy


def prepare_before_torch(ref: str | None, store: Path | None) -> None:
    """Start what loading a local artifact can do without torch (backends.prepare_load), on
    another core, while this one imports torch. A URL or a bad name: nothing here; loading
    pulls it or says what is wrong."""
    from neuronctl.backends import prepare_load
    from neuronctl.errors import NeuronctlError
    from neuronctl.store.resolve import is_url, open_store

    if not ref or is_url(ref):
        return
    try:
        path = open_store(store).resolve(ref)
        if path.is_dir():
            prepare_load(path)
    except (NeuronctlError, OSError):
        return  # the load finds it again and says what is wrong


def _generate_builtin(
    named: Named, prompts: list[Prompt], params: SamplingParams, stream: bool, json_out: bool
) -> None:
    from neuronctl.engine.loader import running
    from neuronctl.runnable import open_artifact_to_run

    loaded = open_artifact_to_run(named.ref, store=named.store, policy=named.policy)
    say_vouch(loaded.vouch)
    ids = [
        loaded.encode_chat(p.messages) if p.messages is not None else loaded.encode(p.text or "")
        for p in prompts
    ]

    def consume(index: int, handle: RequestHandle) -> RequestOutput:
        return _consume(index, prompts[index], handle, stream, json_out)

    with running(loaded) as engine:
        started = time.perf_counter()
        outputs = engine.generate(ids, [params_for(p, params) for p in prompts], consume)
        elapsed = time.perf_counter() - started
    failed = [o for o in outputs if o.finish_reason == "error"]
    if not json_out:
        tokens = sum(len(o.token_ids) for o in outputs)
        err_console.print(
            f"[dim]{plural(len(outputs), 'prompt')}, {plural(tokens, 'token')} in {elapsed:.2f} s "
            f"({tokens / elapsed if elapsed else 0:.1f} tokens/s)[/dim]"
        )
    if failed:
        from neuronctl.errors import NeuronctlError

        raise NeuronctlError(f"generation failed for {len(failed)} prompt(s): {failed[0].error}")


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _print_event(index: int, event: Event, json_out: bool) -> None:
    if json_out:
        line = {"index": index, "token_id": event.token_id, "text": event.text}
        sys.stdout.write(json.dumps(line) + "\n")
    elif event.text:
        sys.stdout.write(event.text)
    sys.stdout.flush()


def _consume(
    index: int, prompt: Prompt, handle: RequestHandle, stream: bool, json_out: bool
) -> RequestOutput:
    """Prompts print in order; later ones keep generating in the batch meanwhile."""
    if stream and not json_out:
        console.rule(f"[bold]{_short(prompt.label())}[/bold]", align="left")
    # Without --stream only the output is printed: result() is not woken at every token.
    output = (
        handle.follow(lambda event: _print_event(index, event, json_out))
        if stream
        else handle.result()
    )
    if json_out:
        sys.stdout.write(
            json.dumps({"index": index, "prompt": prompt.label(), **output.as_dict()}) + "\n"
        )
    elif stream:
        sys.stdout.write("\n")
    else:
        console.rule(f"[bold]{_short(prompt.label())}[/bold]", align="left")
        console.print(output.text, markup=False, highlight=False)
    sys.stdout.flush()
    return output


def _short(text: str, width: int = 60) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _generate_vllm(
    chosen: Named,
    prompts: list[Prompt],
    params: SamplingParams,
    vllm_target: str | None,
    dry_run: bool,
    json_out: bool,
) -> None:
    from neuronctl.cli.serve import named_target, print_launch, print_plan
    from neuronctl.runnable import artifact_to_run
    from neuronctl.store.signing import check_origin
    from neuronctl.vllm.launch import cli_target, generate_launch, run_with_prompts

    if any(p.messages is not None for p in prompts):
        raise UsageError("--engine vllm takes plain prompts (no --chat / messages)")
    named, serving_host = named_target(vllm_target, dry_run)
    run = artifact_to_run(
        chosen.ref,
        store=chosen.store,
        dry_run=dry_run,
        policy=chosen.policy,
        serving_host=serving_host,
    )
    if run.path is None:  # --dry-run with a URL not pulled yet: nothing is fetched
        print_plan(run.plan(), json_out)
        return
    path, manifest = run.path, run.read_manifest()
    target = cli_target(manifest, named)
    say_vouch(check_origin(path, manifest, chosen.policy))
    sampling = {
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "max_tokens": params.max_tokens,
        "seed": params.seed,
        "stop": list(params.stop) or None,
        "ignore_eos": params.ignore_eos,
    }
    sampling = {k: v for k, v in sampling.items() if v is not None}

    def launch_for(prompts_file: Path | None) -> VllmLaunch:
        return generate_launch(path, manifest, prompts_file, sampling=sampling, target=target)

    lines = "".join(json.dumps({"prompt": p.text}) + "\n" for p in prompts)
    if dry_run:  # to paste on the serving host: the prompts go with it, on standard input
        launch = launch_for(None)
        launch.stdin = lines
        print_launch(launch, json_out)
        return
    code = run_with_prompts(lines, launch_for)
    if code:
        raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command("generate")(generate_command)
