"""A bystander's latency while hostile requests run: no client takes more than its share.

Compiles a tiny random llama (batch 4, the compiler users get by default: inductor),
starts the real `neuronctl serve` on 127.0.0.1 and sends one steady stream of small
completions (the bystander: 8 prompt tokens, 16 new tokens, one at a time, from 127.0.0.2).
For each hostile load, in one run: the bystander alone (its baseline, measured just before,
so the host's other work weighs on both alike), then the bystander while one attacker (one
address, 127.0.0.3) keeps several connections busy with the hostile request, each sent again
as soon as it is answered; the phase starts with the attacker's first answer, so a
client's burst of refusals before it is paced falls in it:

  cpu_burn           no request: a process spinning on the load tools' cores (the control)
  logit_bias_flood   450,000 logit_bias entries, 6.6 MB (refused, 400)
  logit_bias_cap     1024 logit_bias entries, the cap, 64 new tokens (served)
  prompts_flood      259 prompts in one completion (refused, 400)
  prompts_cap        64 prompts, the cap, 32 new tokens each (served beside the bystander)
  messages_flood     180,000 empty chat messages, 5 MB (refused, 400)
  messages_cap       1024 empty chat messages, the cap (templated, then served or refused)

The attacker writes prebuilt request bytes on raw sockets (asyncio, one process), as a load
tool would: its own CPU per request is a send and a read, not an HTTP client's Python. Every
phase notes the host's load average (the host may be shared).

The server runs on the first half of the cores this process may use and the bystander and
attacker on the other half, as clients on other machines would: on a 2-core host an attacker
process sharing the server's cores took a core from it whatever the server did (a process
that only spins, sending nothing, made the bystander 2.1x slower at p50 and 4x at p99). The
cpu_burn row shows the split holds: it should be near 1.0x. With one core there is no split
(a warning says so).

Target: the bystander's median and p99 latency within 2x of its baseline under each flood
(the three loads refused: the hostile requests as reported). The three `_cap` loads are what
a client may still send, and is served: reported beside them with no target, since the
attacker's connections then hold most of the batch's slots and its rows share every step
(on this tiny model a step's cost is mostly per row, so its rows weigh more than they would
on a real one).

  python bench/hostile.py [--requests 40] [--connections 4] [--compiler inductor|export]
                          [--artifact DIR] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
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
BYSTANDER_ADDRESS, ATTACKER_ADDRESS = "127.0.0.2", "127.0.0.3"  # Linux routes all of 127/8
FLOODS = ("logit_bias_flood", "prompts_flood", "messages_flood")  # the target's loads
KINDS = ["cpu_burn", "logit_bias_flood", "logit_bias_cap", "prompts_flood", "prompts_cap",
         "messages_flood", "messages_cap"]  # fmt: skip


def compile_tiny(work: Path, compiler: str) -> Path:
    ckpt = make_checkpoint(work / "tiny-llama", "llama", hidden_size=128, num_layers=4,
                           num_heads=4, num_kv_heads=2, intermediate_size=256)  # fmt: skip
    code = "from neuronctl.cli.main import main; main()"
    result = subprocess.run(
        [sys.executable, "-c", code, "compile", str(ckpt), "--compiler", compiler,
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
        bias = {str(i): 1.0 for i in range(450_000)}  # ~6.6 MB, under the body limit
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


def raw_request(port: int, kind: str) -> bytes:
    path, body = hostile_body(kind)
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
    return head.encode() + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """(status, whether the server keeps the connection) of one HTTP/1.1 response."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
    if "content-length" in headers:
        await reader.readexactly(int(headers["content-length"]))
    else:  # chunked (a stream): read to the last chunk
        while True:
            size = int((await reader.readline()).strip() or b"0", 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    return status, headers.get("connection") != "close"


def orphaned(parent: int) -> bool:
    """Whether the bench that started this process is gone (a killed bench left its
    attacker spinning, and every later measurement on the host paid for it)."""
    return os.getppid() != parent


async def connection(port: int, request: bytes, stop: Any, counts: Any, parent: int) -> None:
    """One hostile connection: the request again as soon as it is answered, reconnecting
    whenever the server closes."""
    while not stop.is_set() and not orphaned(parent):
        try:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, local_addr=(ATTACKER_ADDRESS, 0), limit=1 << 20
            )
        except OSError:
            await asyncio.sleep(0.01)
            continue
        try:
            keep = True
            while keep and not stop.is_set() and not orphaned(parent):
                writer.write(request)
                # The server may answer (and close) before it has read the whole body.
                drained = asyncio.ensure_future(writer.drain())
                drained.add_done_callback(lambda f: f.cancelled() or f.exception())
                status, keep = await read_response(reader)
                drained.cancel()
                with counts.get_lock():
                    counts[0 if status == 200 else 1 if status < 429 else 2] += 1
        except (OSError, asyncio.IncompleteReadError, ValueError):
            # A server that closes with the body unread resets the connection, and the
            # kernel may drop its answer with it: the request was refused all the same.
            with counts.get_lock():
                counts[3] += 1
        finally:
            writer.close()


def attacker(
    port: int, kind: str, connections: int, stop: Any, counts: Any, parent: int
) -> None:
    if kind == "cpu_burn":
        while not stop.is_set() and not orphaned(parent):
            sum(range(100_000))
        return
    request = raw_request(port, kind)

    async def run() -> None:
        await asyncio.gather(
            *(connection(port, request, stop, counts, parent) for _ in range(connections))
        )

    asyncio.run(run())


def bystander(port: int, requests: int) -> list[float]:
    """Latency (ms) of `requests` small completions, one after the other."""
    body = {"prompt": "the quick brown fox", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    out = []
    transport = httpx.HTTPTransport(local_address=BYSTANDER_ADDRESS)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600, transport=transport) as c:
        for _ in range(requests):
            started = time.perf_counter()
            c.post("/v1/completions", json=body).raise_for_status()
            out.append((time.perf_counter() - started) * 1000)
    return out


def phase(port: int, requests: int) -> dict[str, Any]:
    latencies = bystander(port, requests)
    return {**latency_stats(latencies), "load_average_1m": round(os.getloadavg()[0], 2)}


def wait_for_attack(sender: Any, counts: Any, kind: str) -> None:
    """Until the attacker has its first answer: the phase then starts with the requests a
    client may have refused before it is paced (a fixed 2 s wait, shorter than the attacker's
    start on a busy host, put that burst at a random point of the phase, or outside it)."""
    if kind == "cpu_burn":  # sends nothing: started and spinning is all there is
        time.sleep(2.0)
        return
    deadline = time.monotonic() + 120
    while not sum(counts[:]):
        if not sender.is_alive() or time.monotonic() > deadline:
            raise SystemExit(f"the {kind} attacker never got an answer")
        time.sleep(0.01)


def under_load(port: int, kind: str, requests: int, connections: int) -> dict[str, Any]:
    print(f"bystander under {kind} ...", file=sys.stderr, flush=True)
    ctx = multiprocessing.get_context("spawn")
    stop, counts = ctx.Event(), ctx.Array("i", 4)
    sender = ctx.Process(target=attacker, args=(port, kind, connections, stop, counts, os.getpid()))
    sender.start()
    try:
        wait_for_attack(sender, counts, kind)
        row = phase(port, requests)
    finally:
        stop.set()
        sender.join(60)
        if sender.is_alive():
            sender.kill()
    time.sleep(1.0)  # what the attacker left in flight ends before the next baseline
    return {**row, "hostile_ok": counts[0], "hostile_refused": counts[1],
            "hostile_429": counts[2], "hostile_reset": counts[3]}  # fmt: skip


def compare(kind: str, alone: dict[str, Any], loaded: dict[str, Any]) -> dict[str, Any]:
    p50_x = loaded["latency_ms_p50"] / alone["latency_ms_p50"]
    p99_x = loaded["latency_ms_p99"] / alone["latency_ms_p99"]
    met = p50_x <= TARGET and p99_x <= TARGET
    return {"load": kind, "baseline": alone, "under_load": loaded, "p50_x": round(p50_x, 2),
            "p99_x": round(p99_x, 2), "targeted": kind in FLOODS,
            "within_target": met}  # fmt: skip


def report(rows: list[dict[str, Any]]) -> None:
    print(f"{'load':17} {'solo p50/p99 ms':>16} {'load p50/p99 ms':>16} {'p50 x':>6} "
          f"{'p99 x':>6} {'loadavg':>8}  hostile ok/400/429/reset")  # fmt: skip
    for row in rows:
        solo, hit = row["baseline"], row["under_load"]
        print(f"{row['load']:17} {solo['latency_ms_p50']:7.0f}/{solo['latency_ms_p99']:<8.0f} "
              f"{hit['latency_ms_p50']:7.0f}/{hit['latency_ms_p99']:<8.0f} "
              f"{row['p50_x']:6.2f} {row['p99_x']:6.2f} {hit['load_average_1m']:8.2f}  "
              f"{hit['hostile_ok']}/{hit['hostile_refused']}/{hit['hostile_429']}"
              f"{over(row)}")  # fmt: skip
    targeted = [row for row in rows if row["targeted"]]
    if targeted:
        verdict = "met" if all(row["within_target"] for row in targeted) else "NOT met"
        print(f"target (p50 and p99 within {TARGET}x of the solo baseline under each flood): "
              f"{verdict}")  # fmt: skip


def over(row: dict[str, Any]) -> str:
    if row["within_target"]:
        return ""
    return "  OVER TARGET" if row["targeted"] else f"  over {TARGET}x (served: no target)"


def split_cores() -> tuple[set[int] | None, set[int] | None]:
    """(the server's cores, the load tools'): the first half and the rest."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        print("warning: one core: the server and the load share it", file=sys.stderr)
        return None, None
    half = len(cores) // 2
    return set(cores[:half]), set(cores[half:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40, help="bystander requests per phase")
    parser.add_argument("--connections", type=int, default=4, help="attacker connections")
    parser.add_argument("--kinds", nargs="+", default=KINDS, choices=KINDS)
    parser.add_argument("--compiler", default="inductor", choices=["inductor", "export"])
    parser.add_argument("--artifact", type=Path, help="reuse a compiled batch-4 artifact")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="neuronctl-bench-hostile-") as tmp:
        artifact = args.artifact or compile_tiny(Path(tmp), args.compiler)
        port = free_port()
        server_cores, load_cores = split_cores()
        server = start_server(artifact, port, server_cores)
        if load_cores:
            os.sched_setaffinity(0, load_cores)  # the bystander and attacker processes inherit it
        try:
            bystander(port, 3)  # warm-up: first graph loads
            rows = []
            for kind in args.kinds:
                alone = phase(port, args.requests)
                rows.append(compare(kind, alone, under_load(port, kind, args.requests,
                                                            args.connections)))  # fmt: skip
        finally:
            server.terminate()
            server.wait(60)
    if args.json:
        print(json.dumps({"target_x": TARGET, "connections": args.connections,
                          "server_cores": sorted(server_cores or []), "rows": rows},
                         indent=2))  # fmt: skip
        return
    report(rows)


if __name__ == "__main__":
    main()
