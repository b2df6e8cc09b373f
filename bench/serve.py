"""Serving throughput: output tokens/s at concurrency 8 vs 1 against one `neuronctl serve`.

Builds a random checkpoint with the SmolLM2-135M shape (30 layers, hidden 576, 9 heads, 3 KV
heads, intermediate 1536, vocab 49152, tied embeddings), compiles it with batch size 8, starts
the real server on 127.0.0.1, and streams completions at concurrency 1 and then 8 against the
same process in the same run. Target: concurrency 8 >= 3x the output tokens/s of 1.

Then the engine's overhead: the Runner of the same artifact is driven directly in
this process (greedy, no engine) at batch 1 and 8, and each served decode speed (1000 / TPOT
p50 per stream, times the concurrency) is printed as a ratio of it. Target: >= 0.9.

  python bench/serve.py [--compiler export|inductor] [--dtype float32|bfloat16] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from neuronctl.engine.bench import latency_stats, runner_decode_speed  # noqa: E402
from tests.helpers import make_checkpoint  # noqa: E402

SMOLLM2_135M = dict(
    hidden_size=576,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
)


def neuronctl(*args: str) -> subprocess.CompletedProcess[str]:
    code = "from neuronctl.cli.main import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=False
    )


def compile_artifact(work: Path, compiler: str, dtype: str, seq_len: int, prompt_len: int) -> Path:
    ckpt = make_checkpoint(work / "smollm2-135m-shape", "llama", **SMOLLM2_135M)
    started = time.perf_counter()
    result = neuronctl(
        "compile", str(ckpt), "--compiler", compiler, "--dtype", dtype, "--batch-size", "8",
        "--seq-len", str(seq_len), "--max-context-length", str(prompt_len),
        "--context-buckets", str(prompt_len), "--token-gen-buckets", str(seq_len),
        "--store", str(work / "store"), "--json",
    )  # fmt: skip
    if result.returncode:
        raise SystemExit(f"compile failed:\n{result.stderr}")
    print(f"compiled in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return Path(json.loads(result.stdout)["path"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(
    artifact: Path, port: int, cpus: set[int] | None = None
) -> subprocess.Popen[str]:
    """A `neuronctl serve` of `artifact` on 127.0.0.1:`port`, once healthy; on `cpus` only
    where given (its threads inherit the affinity)."""
    code = "from neuronctl.cli.main import main; main()"
    argv = [sys.executable, "-c", code, "serve", "--artifacts", str(artifact), "--port",
            str(port), "--served-model-name", "bench",
            "--uvicorn-log-level", "warning"]  # fmt: skip
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    proc = subprocess.Popen(argv, text=True, preexec_fn=pin)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not become healthy")


async def one_request(
    client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int
) -> dict[str, float]:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}  # fmt: skip
    started = time.perf_counter()
    times: list[float] = []
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for _ in chunk["choices"][0].get("token_ids", []):
                    times.append(time.perf_counter())
    return {
        "ttft": (times[0] - started) * 1000,
        "tpot": (times[-1] - times[0]) / max(len(times) - 1, 1) * 1000,
        "e2e": (times[-1] - started) * 1000,
        "tokens": len(times),
    }


async def load(port: int, concurrency: int, requests: int, prompt_len: int, max_tokens: int,
               seed: int) -> dict[str, Any]:  # fmt: skip
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(prompt_len)] for _ in range(requests)]
    url = f"http://127.0.0.1:{port}/v1/completions"
    queue = list(range(requests))
    results: list[dict[str, float]] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            i = queue.pop()
            results.append(await one_request(client, url, prompts[i], max_tokens))

    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one_request(client, url, prompts[0], 4)  # warm-up, not measured
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - started
    tokens = sum(int(r["tokens"]) for r in results)
    return {
        "concurrency": concurrency,
        "requests": requests,
        "duration_s": round(wall, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall, 2),
        "ttft": latency_stats([r["ttft"] for r in results]),
        "tpot": latency_stats([r["tpot"] for r in results]),
        "e2e_model": {
            **latency_stats([r["e2e"] for r in results]),
            "throughput": round(tokens / wall, 2),
        },  # fmt: skip
    }


def engine_overhead(
    artifact: Path, runs: list[dict[str, Any]], prompt_len: int, max_tokens: int
) -> list[dict[str, Any]]:
    """Served decode speed (from TPOT) against the Runner driven directly, batch 1 and 8."""
    from neuronctl.engine.loader import open_artifact

    runner = open_artifact(artifact).runner
    rows = []
    for run in runs:
        batch = run["concurrency"]
        alone = runner_decode_speed(runner, batch, prompt_len, max_tokens - 1)
        served = batch * 1000 / run["tpot"]["latency_ms_p50"]
        rows.append({
            "batch": batch, "served_tokens_per_s": round(served, 2),
            "runner_tokens_per_s": alone["tokens_per_s"],
            "ratio": round(served / alone["tokens_per_s"], 3),
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compiler", default="export", choices=["export", "inductor"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-slot", type=int, default=2, help="requests = this x c")
    parser.add_argument("--artifact", type=Path, help="reuse a compiled batch-8 artifact")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    seq_len = args.prompt_len + args.max_tokens
    with tempfile.TemporaryDirectory(prefix="neuronctl-bench-serve-") as tmp:
        artifact = args.artifact or compile_artifact(
            Path(tmp), args.compiler, args.dtype, seq_len, args.prompt_len
        )
        port = free_port()
        server = start_server(artifact, port)
        try:
            runs = [
                asyncio.run(
                    load(
                        port,
                        c,
                        max(2, args.requests_per_slot * c),
                        args.prompt_len,
                        args.max_tokens,
                        seed=c,
                    )
                )  # fmt: skip
                for c in (1, 8)
            ]
        finally:
            server.terminate()
            server.wait(60)
        overhead = engine_overhead(artifact, runs, args.prompt_len, args.max_tokens)
    ratio = runs[1]["output_tokens_per_s"] / runs[0]["output_tokens_per_s"]
    report = {
        "engine_vs_runner": overhead,
        "model": "SmolLM2-135M shape, random weights",
        "compiler": args.compiler,
        "dtype": args.dtype,
        "cpu_count": os.cpu_count(),
        "runs": runs,
        "speedup_c8_vs_c1": round(ratio, 2),
        "target_met": ratio >= 3,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for r in runs:
        print(
            f"concurrency {r['concurrency']}: {r['output_tokens_per_s']:8.1f} output tokens/s  "
            f"TTFT p50 {r['ttft']['latency_ms_p50']:.0f} ms  "
            f"TPOT p50 {r['tpot']['latency_ms_p50']:.1f} ms  "
            f"e2e p50/p99 {r['e2e_model']['latency_ms_p50']:.0f}/"
            f"{r['e2e_model']['latency_ms_p99']:.0f} ms"
        )
    print(f"speedup c8/c1: {ratio:.2f}x (target >= 3x: {'met' if ratio >= 3 else 'NOT met'})")
    for row in overhead:
        met = "met" if row["ratio"] >= 0.9 else "NOT met"
        print(
            f"batch {row['batch']}: served decode {row['served_tokens_per_s']:.1f} tokens/s, "
            f"Runner alone {row['runner_tokens_per_s']:.1f}: ratio {row['ratio']:.2f} "
            f"(target >= 0.9: {met})"
        )


if __name__ == "__main__":
    main()
