"""`neuronctl bench`: latency percentiles and throughput of an artifact, in-process."""

from __future__ import annotations

from typing import Any

import typer

from neuronctl.cli._common import (
    AllowUnsignedOpt,
    ArtifactArg,
    ArtifactsOpt,
    JsonOpt,
    StoreOpt,
    TrustKeyOpt,
    console,
    one_artifact,
    print_json,
    print_table,
    say_vouch,
)
from neuronctl.errors import NeuronctlError, UsageError

ORDER = 70


def bench_command(
    ctx: typer.Context,
    artifact: ArtifactArg = None,
    artifacts: ArtifactsOpt = None,
    concurrency: int = typer.Option(
        0, "--concurrency", min=0, help="Requests in flight (default: the artifact's batch size)."
    ),
    requests: int = typer.Option(32, "--requests", min=1, help="Requests to measure."),
    prompt_len: int = typer.Option(64, "--prompt-len", min=1, help="Prompt tokens per request."),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1, help="Output tokens per request."),
    warmup: int = typer.Option(1, "--warmup", min=0, help="Unmeasured requests first."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random prompts."),
    store: StoreOpt = None,
    trust_key: TrustKeyOpt = None,
    allow_unsigned: AllowUnsignedOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Measure an artifact: time to first token (TTFT), time per output token (TPOT),
    end-to-end latency percentiles and output tokens/s, with greedy decoding, random prompts
    and every request generating exactly --max-tokens tokens.

    The JSON report uses NxD Inference's benchmark fields (latency_ms_p50/p90/p95/p99/p100/avg,
    throughput) under e2e_model, ttft and tpot.

    Examples:

      neuronctl bench $DIR --concurrency 8 --requests 64

      neuronctl bench --prompt-len 128 --max-tokens 32 --json > report.json

    Exit codes: 0 ok, 1 artifact missing / not reusable / a request failed, 2 usage error.
    """
    from neuronctl.engine.bench import bench_engine
    from neuronctl.engine.loader import running
    from neuronctl.runnable import open_artifact_to_run
    from neuronctl.store.signing import TrustPolicy

    policy = TrustPolicy.load(trust_key, allow_unsigned)
    named = one_artifact(ctx, artifact, artifacts)
    loaded = open_artifact_to_run(named, store=store, policy=policy)
    say_vouch(loaded.vouch)
    runner = loaded.runner
    limit = min(runner.max_context_length, max(runner.context_buckets))
    if prompt_len > limit:
        raise UsageError(f"--prompt-len {prompt_len} is over the artifact's limit {limit}")
    if prompt_len + max_tokens > runner.seq_len:
        raise UsageError(
            f"--prompt-len + --max-tokens = {prompt_len + max_tokens} is over the artifact's "
            f"sequence length {runner.seq_len}"
        )
    with running(loaded) as engine:
        result = bench_engine(
            engine,
            runner.vocab_size,
            concurrency=concurrency or runner.batch_size,
            requests=requests,
            prompt_len=prompt_len,
            max_tokens=max_tokens,
            warmup=warmup,
            seed=seed,
        )
    result["artifact"] = str(loaded.path)
    result["config"]["batch_size"] = runner.batch_size
    if json_out:
        print_json(result)
    else:
        _render(result)
    if result["failed"]:
        raise NeuronctlError(f"{result['failed']} of {result['requests']} requests failed")


def _render(result: dict[str, Any]) -> None:
    def ms(stats: dict[str, Any], key: str) -> str:
        value = stats.get(key)
        return "-" if value is None else f"{value:.1f}"

    rows = [
        [name] + [ms(result[key], f"latency_ms_{p}") for p in ("p50", "p90", "p99", "avg")]
        for name, key in (("TTFT", "ttft"), ("TPOT", "tpot"), ("end-to-end", "e2e_model"))
    ]
    cfg = result["config"]
    title = (
        f"{cfg['requests']} requests, concurrency {cfg['concurrency']} "
        f"(batch {cfg['batch_size']}), prompt {cfg['prompt_len']}, {cfg['max_tokens']} new tokens"
    )
    print_table(title, ["ms", "p50", "p90", "p99", "avg"], rows)
    console.print(
        f"output: [bold]{result['output_tokens_per_s']:.1f} tokens/s[/bold], "
        f"{result['requests_per_s']:.2f} requests/s, {result['duration_s']:.2f} s"
    )


def register(app: typer.Typer) -> None:
    app.command("bench")(bench_command)
