"""A bystander's latency while hostile requests run: no request takes more than its share.

Compiles a tiny random llama (export graphs, batch 4), starts the real `neuronctl serve` on
127.0.0.1 and sends one steady stream of small completions (the bystander: 8 prompt tokens,
16 new tokens, one at a time). First alone (the baseline), then while each hostile load runs
in its own process, two senders each, one load after the other, all in the same run:

  logit_bias_flood   450,000 logit_bias entries, 6 MB (refused, 400)
  logit_bias_cap     1024 logit_bias entries, the cap, 64 new tokens (served)
  prompts_flood      259 prompts in one completion (refused, 400)
  prompts_cap        64 prompts, the cap, 32 new tokens each (served beside the bystander)
  messages_flood     180,000 empty chat messages, 5 MB (refused, 400)
  messages_cap       1024 empty chat messages, the cap (templated, then served or refused)

Target: the bystander's median and p99 latency within 2x of its baseline under each load.

  python bench/hostile.py [--requests 30] [--artifact DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.serve import free_port, start_server  # noqa: E402
from neuronctl.engine.bench import latency_stats  # noqa: E402
from tests.helpers import make_checkpoint  # noqa: E402

TARGET = 2.0
BATCH = 4
SENDERS = 2  # hostile processes per load


def compile_tiny(work: Path) -> Path:
    ckpt = make_checkpoint(work / "tiny-llama", "llama", hidden_size=128, num_layers=4,
                           num_heads=4, num_kv_heads=2, intermediate_size=256)  # fmt: skip
    code = "from neuronctl.cli.main import main; main()"
    result = subprocess.run(
        [sys.executable, "-c", code, "compile", str(ckpt), "--compiler", "export",
         "--dtype", "float32", "--batch-size", str(BATCH), "--seq-len", "256",
         "--max-context-length", "128", "--context-buckets", "128",
         "--token-gen-buckets", "256", "--store", str(work / "store"), "--json"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if result.returncode:
        raise SystemExit(f"compile failed:\n{result.stderr}")
    return Path(json.loads(result.stdout)["path"])


def hostile_body(kind: str) -> tuple[str, bytes]:
    """(path, body) of one hostile request."""
    if kind == "logit_bias_flood":
        bias = {str(i): 1.0 for i in range(450_000)}  # ~6 MB, under the body limit
        body: dict[str, Any] = {"prompt": "hi", "max_tokens": 120, "logit_bias": bias}
    elif kind == "logit_bias_cap":
        bias = {"0" * (i // 200) + str(i % 200): 1.0 for i in range(1024)}
        body = {"prompt": "hi", "max_tokens": 64, "logit_bias": bias}
    elif kind == "prompts_flood":
        body = {"prompt": ["tell me a story"] * 259, "max_tokens": 32}
    elif kind == "prompts_cap":
        body = {"prompt": ["tell me a story"] * 64, "max_tokens": 32, "ignore_eos": True}
    elif kind == "messages_flood":
        body = {"messages": [{"role": "user", "content": ""}] * 180_000, "max_tokens": 8}
    else:  # messages_cap
        body = {"messages": [{"role": "user", "content": ""}] * 1024, "max_tokens": 8}
    path = "/v1/chat/completions" if "messages" in kind else "/v1/completions"
    return path, json.dumps(body).encode()


def attack(port: int, kind: str, stop: Any, counts: Any) -> None:
    """One hostile sender: the same request again and again until told to stop."""
    path, body = hostile_body(kind)
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        while not stop.is_set():
            status = client.post(path, content=body, headers=headers).status_code
            with counts.get_lock():
                counts[0 if status == 200 else 1] += 1


def bystander(port: int, requests: int) -> list[float]:
    """Latency (ms) of `requests` small completions, one after the other."""
    body = {"prompt": "the quick brown fox", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    out = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        for _ in range(requests):
            started = time.perf_counter()
            client.post("/v1/completions", json=body).raise_for_status()
            out.append((time.perf_counter() - started) * 1000)
    return out


def under_load(port: int, kind: str, requests: int) -> dict[str, Any]:
    print(f"bystander under {kind} ...", file=sys.stderr, flush=True)
    ctx = multiprocessing.get_context("spawn")
    stop, counts = ctx.Event(), ctx.Array("i", 2)
    senders = [ctx.Process(target=attack, args=(port, kind, stop, counts)) for _ in range(SENDERS)]
    for sender in senders:
        sender.start()
    time.sleep(2.0)  # the senders are built and sending
    try:
        latencies = bystander(port, requests)
    finally:
        stop.set()
        for sender in senders:
            sender.join(120)
            if sender.is_alive():
                sender.kill()
    return {"load": kind, "hostile_served": counts[0], "hostile_refused": counts[1],
            **latency_stats(latencies)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=30, help="bystander requests per phase")
    parser.add_argument("--artifact", type=Path, help="reuse a compiled batch-4 artifact")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    kinds = ["logit_bias_flood", "logit_bias_cap", "prompts_flood", "prompts_cap",
             "messages_flood", "messages_cap"]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="neuronctl-bench-hostile-") as tmp:
        artifact = args.artifact or compile_tiny(Path(tmp))
        port = free_port()
        server = start_server(artifact, port)
        try:
            bystander(port, 3)  # warm-up: first graph loads
            alone = {"load": "none (baseline)", **latency_stats(bystander(port, args.requests))}
            rows = [alone] + [under_load(port, kind, args.requests) for kind in kinds]
        finally:
            server.terminate()
            server.wait(60)
    base50, base99 = alone["latency_ms_p50"], alone["latency_ms_p99"]
    for row in rows:
        row["p50_x"] = round(row["latency_ms_p50"] / base50, 2)
        row["p99_x"] = round(row["latency_ms_p99"] / base99, 2)
        row["within_target"] = row["p50_x"] <= TARGET and row["p99_x"] <= TARGET
    if args.json:
        print(json.dumps({"target_x": TARGET, "rows": rows}, indent=2))
        return
    print(f"{'load':18} {'p50 ms':>8} {'p99 ms':>8} {'p50 x':>6} {'p99 x':>6}  hostile ok/refused")
    for row in rows:
        print(f"{row['load']:18} {row['latency_ms_p50']:8.0f} {row['latency_ms_p99']:8.0f} "
              f"{row['p50_x']:6.2f} {row['p99_x']:6.2f}  "
              f"{row.get('hostile_served', '-')}/{row.get('hostile_refused', '-')}"
              f"{'' if row['within_target'] else '  OVER TARGET'}")  # fmt: skip


if __name__ == "__main__":
    main()
