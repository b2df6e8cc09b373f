"""`neuronctl install` throughput vs a plain copy of the same files, from a shared mount.

    python bench/install.py [--size-mb 256] [--repeat 3] [--json]

A synthetic signed artifact (random bytes: weight shards and graphs) is pushed to a file://
remote. Then, alternating, each repeat times
  copy:     shutil.copytree of the remote artifact directory (no verification at all);
  install:  store.install.install into an empty directory: signature check, download of every
            file with its sha256, rename into place, the record, manifest.json last (the host
            checks are skipped: the artifact is synthetic);
  rerun:    install again into the finished directory: nothing is downloaded, every file is
            re-hashed.
The best of the repeats of each is reported, with install / copy as a ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import ec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from neuronctl.store.install import install  # noqa: E402
from neuronctl.store.remote.client import open_remote  # noqa: E402
from neuronctl.store.signing import Signer, TrustedKey, TrustPolicy, key_id  # noqa: E402
from tests.test_remote import make_artifact  # noqa: E402

_KEY = ec.generate_private_key(ec.SECP256R1())
SIGNER = Signer(_KEY, key_id(_KEY.public_key()))
TRUST = TrustPolicy((TrustedKey(_KEY.public_key(), SIGNER.key_id, "bench"),))


def files(size_mb: int) -> dict[str, bytes]:
    shard = size_mb * 2**20 // 4
    out = {f"weights/tp{i}_sharded_checkpoint.safetensors": os.urandom(shard) for i in range(4)}
    out.update({f"graphs/g{i}.pt2": os.urandom(2**20) for i in range(4)})
    return out


def timed(work: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    work(*args)
    return time.perf_counter() - start


def quiet_install(url: str, dest: Path) -> None:
    install(url, dest, TRUST, lambda manifest: [], lambda line: None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        artifact = make_artifact(root / "build", files(args.size_mb))
        open_remote(str(root / "remote")).push(artifact, signer=SIGNER)
        source = root / "remote" / "neuron-compiled-artifacts" / artifact.name
        url = f"{(root / 'remote').as_uri()}/{artifact.name}"
        total = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
        best = {"copy": float("inf"), "install": float("inf"), "rerun": float("inf")}
        for i in range(args.repeat):
            copy_to, dest = root / f"copy{i}", root / f"dest{i}"
            best["copy"] = min(best["copy"], timed(shutil.copytree, source, copy_to))
            best["install"] = min(best["install"], timed(quiet_install, url, dest))
            best["rerun"] = min(best["rerun"], timed(quiet_install, url, dest))
            shutil.rmtree(copy_to)
            shutil.rmtree(dest)
    result = {
        "bytes": total,
        "cpu": platform.processor() or platform.machine(),
        **{f"{k}_s": round(v, 3) for k, v in best.items()},
        "install_over_copy": round(best["install"] / best["copy"], 2),
        "install_mb_s": round(total / 2**20 / best["install"], 1),
    }
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
