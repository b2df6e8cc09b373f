"""Pull throughput vs a raw s3fs get of the same files, against a moto S3 server on 127.0.0.1.

    python bench/remote.py [--size-mb 520] [--repeat 3] [--json]

A synthetic artifact (random bytes: a few weight shards and graphs, >= 500 MB by default) is
pushed to a moto server running in its own process. Then, alternating, each repeat times
  raw:  s3fs `get` of every file of the artifact into an empty directory (what a hand-written
        `aws s3 cp --recursive` style download costs), and
  pull: `neuronctl artifacts pull` (RemoteStore.pull): signature check, download into staging,
        sha256 of every byte (while downloading, then again when the store records it), fsync,
        verify against the manifest, atomic rename under the per-key lock.
The ratio is pull throughput / raw throughput of the same run (target >= 0.8); the best of the
repeats of each is compared, since the server shares the machine with the client.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import ec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from neuronctl.store.local import Store  # noqa: E402
from neuronctl.store.manifest import Manifest, Source  # noqa: E402
from neuronctl.store.remote.client import open_remote  # noqa: E402
from neuronctl.store.signing import Signer, TrustedKey, TrustPolicy, key_id  # noqa: E402

# The pull path measured is the production one: a signed manifest, checked, then every byte.
_KEY = ec.generate_private_key(ec.SECP256R1())
SIGNER = Signer(_KEY, key_id(_KEY.public_key()))
TRUST = TrustPolicy((TrustedKey(_KEY.public_key(), SIGNER.key_id, "bench"),))

MB = 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, endpoint
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto server did not start")


def layout(size_mb: int) -> dict[str, int]:
    """Roughly an artifact's shape: a few big weight shards, graphs, small json files."""
    shards = 4
    graphs = 2
    graph_mb = max(1, size_mb // 10)
    shard_mb = max(1, (size_mb - graphs * graph_mb) // shards)
    files = {f"weights/tp{r}_sharded_checkpoint.safetensors": shard_mb * MB for r in range(shards)}
    files.update({f"graphs/bucket_{i}.pt2": graph_mb * MB for i in range(graphs)})
    files.update({"config.json": 700, "tokenizer.json": 2 * MB})
    return files


def make_artifact(root: Path, files: dict[str, int]) -> Path:
    manifest = Manifest(
        backend="torch",
        backend_versions={"torch": "bench"},
        spec={},
        keys={"graph_key": "g" * 64, "weights_key": "w" * 64, "artifact_key": "b" * 64},
        source=Source(digest="d" * 64),
        architecture={},
    )

    def build(staging: Path) -> Manifest:
        for rel, size in files.items():
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            with open(staging / rel, "wb") as f:
                for start in range(0, size, 16 * MB):
                    f.write(os.urandom(min(16 * MB, size - start)))
        return manifest

    return Store(root).publish("b" * 20, build).path


def raw_get(remote_url: str, dirname: str, rels: list[str], dest: Path) -> float:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
    base = remote_url.removeprefix("s3://") + f"/neuron-compiled-artifacts/{dirname}"
    for rel in rels:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    fs.get([f"{base}/{rel}" for rel in rels], [str(dest / rel) for rel in rels])
    return time.perf_counter() - started


def pull(remote_url: str, dirname: str, dest: Path) -> float:
    started = time.perf_counter()
    published = open_remote(remote_url).pull(dirname, Store(dest), policy=TRUST)
    elapsed = time.perf_counter() - started
    assert not published.cache_hit
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=520)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    moto, endpoint = start_moto()
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    work = Path(tempfile.mkdtemp(prefix="neuronctl-bench-remote-"))
    try:
        results = run(work, args.size_mb, args.repeat)
    finally:
        moto.kill()
        moto.wait()
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for name, value in results.items():
        print(f"{name:>24}: {value}")


def run(work: Path, size_mb: int, repeat: int) -> dict[str, object]:
    import boto3

    boto3.client("s3").create_bucket(Bucket="bench")
    url = "s3://bench/fleet"
    files = layout(size_mb)
    artifact = make_artifact(work / "src", files)
    total = sum(files.values())

    started = time.perf_counter()
    open_remote(url).push(artifact, signer=SIGNER)
    push_s = time.perf_counter() - started
    started = time.perf_counter()
    noop = open_remote(url).push(artifact, signer=SIGNER)
    repush_s = time.perf_counter() - started
    assert noop.noop

    raw_times, pull_times = [], []
    for i in range(repeat):
        raw_times.append(raw_get(url, artifact.name, list(files), work / f"raw{i}"))
        shutil.rmtree(work / f"raw{i}")
        pull_times.append(pull(url, artifact.name, work / f"pull{i}"))
        shutil.rmtree(work / f"pull{i}")
    raw_best, pull_best = min(raw_times), min(pull_times)
    return {
        "artifact_mb": round(total / MB, 1),
        "files": len(files),
        "push_mb_s": round(total / MB / push_s, 1),
        "repush_noop_s": round(repush_s, 3),
        "raw_get_s": [round(t, 2) for t in raw_times],
        "pull_s": [round(t, 2) for t in pull_times],
        "raw_get_mb_s": round(total / MB / raw_best, 1),
        "pull_mb_s": round(total / MB / pull_best, 1),
        "ratio_pull_to_raw": round(raw_best / pull_best, 3),
    }


if __name__ == "__main__":
    main()
