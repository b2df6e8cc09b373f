"""Ray Serve's cost: decode tokens/s through Ray Serve's HTTP proxy against the same replica's
`neuronctl serve` directly, in the same run.

Compiles the SmolLM2-135M-shaped random checkpoint of bench/serve.py (or takes --artifact),
puts it on a file:// remote, starts a local Ray cluster on 127.0.0.1 with the RayService
target's application (neuronctl.fleet.rayserve) at one replica, and streams completions at
concurrency 1 and 4 to the proxy and to that replica's own server on its loopback port,
alternating. Prints output tokens/s of each path and proxy / direct.

  python bench/rayserve.py [--artifact DIR] [--json]    (needs `pip install "ray[serve]"`)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
NEURONCTL = [sys.executable, "-m", "neuronctl.cli.main"]


def bench_serve() -> Any:
    """bench/serve.py's compile and load generator, reused as they are."""
    spec = importlib.util.spec_from_file_location("bench_serve", REPO / "bench" / "serve.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return platform.processor()
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def install_argv() -> list[str]:
    """`neuronctl install` where this neuronctl has it, else a plain copy stands in."""
    probe = subprocess.run([*NEURONCTL, "install", "--help"], capture_output=True)
    if probe.returncode == 0:
        return [*NEURONCTL, "install", "--allow-unsigned"]
    copy = "import shutil, sys; shutil.copytree(sys.argv[1][7:], sys.argv[2], dirs_exist_ok=True)"
    return [sys.executable, "-c", copy]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, help="reuse a compiled batch-8 artifact")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import ray
    from ray import serve

    from neuronctl.fleet.rayserve import app, free_port
    from neuronctl.store.remote.client import open_remote

    sb = bench_serve()
    with tempfile.TemporaryDirectory(prefix="neuronctl-bench-ray-") as tmp:
        work = Path(tmp)
        seq_len = args.prompt_len + args.max_tokens
        artifact = args.artifact or sb.compile_artifact(
            work, "export", "float32", seq_len, args.prompt_len
        )
        remote = open_remote((work / "remote").as_uri())
        pushed = remote.push(artifact)
        argv = [*NEURONCTL, "serve", "/mnt/models", "--host", "127.0.0.1", "--port", "0",
                "--served-model-name", "bench", "--allow-unsigned",
                "--uvicorn-log-level", "warning"]
        proxy_port = free_port()
        ray.init(address="local", num_cpus=2, include_dashboard=False,
                 _node_ip_address="127.0.0.1")  # fmt: skip
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": proxy_port})
            serve.run(app({"source_uri": pushed.url, "argv": argv, "install": install_argv(),
                           "served_model_name": "bench", "num_replicas": 1}),
                      name="bench", route_prefix="/")  # fmt: skip
            direct_port = serve.get_app_handle("bench").server_port.remote().result()
            rows = []
            for c in (1, 4):
                runs = {}
                for path, port in (("direct", direct_port), ("proxy", proxy_port),
                                   ("direct2", direct_port), ("proxy2", proxy_port)):  # fmt: skip
                    runs[path] = asyncio.run(sb.load(port, c, 2 * c, args.prompt_len,
                                                     args.max_tokens, seed=c))  # fmt: skip
                direct = (runs["direct"]["output_tokens_per_s"]
                          + runs["direct2"]["output_tokens_per_s"]) / 2  # fmt: skip
                proxy = (runs["proxy"]["output_tokens_per_s"]
                         + runs["proxy2"]["output_tokens_per_s"]) / 2  # fmt: skip
                rows.append({"concurrency": c, "direct_tokens_per_s": round(direct, 2),
                             "proxy_tokens_per_s": round(proxy, 2),
                             "proxy_over_direct": round(proxy / direct, 3)})  # fmt: skip
        finally:
            serve.shutdown()
            ray.shutdown()
    report = {"cpu": cpu_name(), "ray": ray.__version__, "runs": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"CPU: {report['cpu']}, Ray {report['ray']}")
    for row in rows:
        print(f"concurrency {row['concurrency']}: direct {row['direct_tokens_per_s']} tok/s, "
              f"through Ray Serve {row['proxy_tokens_per_s']} tok/s, "
              f"ratio {row['proxy_over_direct']}")


if __name__ == "__main__":
    main()
