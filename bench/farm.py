"""The build farm's wall time: N tiny builds of one plan on a local two-worker Ray cluster
(`neuronctl compile --plan FILE --ray ...`, one CPU per task) against the same builds run one
after another (`neuronctl compile --plan FILE --entry I`), each with every core (compile's
default) and each with one, in the same run; the ratio is against the faster of the two.

Both modes run the same `neuronctl compile --plan FILE --entry I --remote URL` child
processes (fleet/farm.py's task), each into a fresh store and file:// remote. The plan is a
tiny random Llama at the tests' smallest spec (2 graphs), one entry per batch size, so no
two entries share a graph key (a graph reused from the store would be no compile at all). A
first build, untimed, warms the host's caches (the matmul kernel, the compilers' own). The
matmul path is chosen by the ISA rules (`NEURONCTL_OP_CHOICE=rules`): timing the ops while
another build compiles would measure the other build.

  python bench/farm.py [--builds 4] [--json]    (needs `pip install 'neuronctl[ray]'`)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ["NEURONCTL_OP_CHOICE"] = "rules"
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))

SPEC = {
    "compiler": "export", "dtype": "float32", "seq_len": 64, "max_context_length": 32,
    "context_buckets": [32], "token_gen_buckets": [64],
}  # fmt: skip
WORKERS = 2


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return platform.processor()
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name = fields.get("Model name", platform.processor()).strip()
    family, model = fields.get("CPU family", "?").strip(), fields.get("Model", "?").strip()
    return f"{name} (family {family} model {model}), {os.cpu_count()} CPUs"


def write_plan(work: Path, builds: int) -> Path:
    from tests.helpers import make_checkpoint

    make_checkpoint(work / "llama", "llama")
    spec = "\n".join(f"{k} = {json.dumps(v)}" for k, v in SPEC.items())
    sizes = ", ".join(str(b) for b in range(1, builds + 2))  # the last: the warm-up's
    path = work / "builds.toml"
    path.write_text(f'[defaults]\n{spec}\n\n[[build]]\nmodel = "./llama"\n'
                    f"matrix = {{ batch_size = [{sizes}] }}\n")  # fmt: skip
    return path


def jobs(plan: Path, work: Path, mode: str, cpus: int) -> list[Any]:
    from neuronctl.fleet.farm import farm_jobs

    return farm_jobs(
        plan, remote_url=(work / f"remote-{mode}").as_uri(), store_dir=work / f"store-{mode}",
        cpus=cpus,
    )  # fmt: skip


def checked(results: list[dict[str, Any]]) -> None:
    for r in results:
        if r["returncode"] != 0:
            sys.exit(f"a build failed:\n{r['log'][-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--builds", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import ray

    from neuronctl.fleet.farm import Farm, FarmOptions, compile_task
    from neuronctl.store.remote.client import open_remote

    with tempfile.TemporaryDirectory(prefix="neuronctl-bench-farm-") as tmp:
        work = Path(tmp)
        plan = write_plan(work, args.builds)
        cores = os.cpu_count() or 1
        warm = jobs(plan, work, "warm", cores)[-1]
        checked([compile_task(warm)])

        serial: dict[int, float] = {}  # --jobs -> wall time of the builds one after another
        for cpus in sorted({cores, 1}, reverse=True):
            chosen = jobs(plan, work, f"serial-{cpus}", cpus)[: args.builds]
            started = time.monotonic()
            checked([compile_task(job) for job in chosen])
            serial[cpus] = time.monotonic() - started
        serial_s = min(serial.values())

        t0 = time.monotonic()
        ray.init(address="local", num_cpus=WORKERS, include_dashboard=False,
                 log_to_driver=False, _node_ip_address="127.0.0.1")  # fmt: skip
        ray_start_s = time.monotonic() - t0
        try:
            farmed = jobs(plan, work, "farm", 1)[: args.builds]
            started = time.monotonic()
            remote = open_remote((work / "remote-farm").as_uri())
            results = Farm(farmed, remote, FarmOptions(work / "logs", poll_s=0.2)).run()
            farm_s = time.monotonic() - started
        finally:
            ray.shutdown()
        failed = [r for r in results if r.status == "failed"]
        if failed:
            sys.exit(f"a farm build failed: {failed[0].reason} (log {failed[0].log})")

    load = os.getloadavg()[0]
    report = {
        "cpu": cpu_name(),
        "load_end": load,
        "builds": args.builds,
        "sequential_s": {f"jobs_{c}": round(t, 1) for c, t in serial.items()},
        "farm_s": round(farm_s, 1),
        "speedup": round(serial_s / farm_s, 2),
        "ray_start_s": round(ray_start_s, 1),
        "workers": WORKERS,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"CPU: {report['cpu']}; load average at the end {report['load_end']:.1f}")
    for cpus, seconds in serial.items():
        print(f"{args.builds} builds one after another (--jobs {cpus} each): {seconds:.1f} s")
    print(f"{args.builds} builds on local Ray, {WORKERS} workers (1 CPU each): {farm_s:.1f} s "
          f"(Ray's own start, not counted: {ray_start_s:.1f} s)")  # fmt: skip
    print(f"farm speedup over the faster of those: {serial_s / farm_s:.2f}x")


if __name__ == "__main__":
    main()
