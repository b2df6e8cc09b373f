"""Pull from an OCI registry: neuronctl against oras-py's own pull, and what a killed pull
costs, against a real registry (Debian's docker-registry) on 127.0.0.1.

    python bench/oci.py [--size-mb 256] [--repeat 3] [--json]

A synthetic artifact (random bytes: weight shards, graphs, small json files) is pushed,
signed, to a registry with filesystem storage. Then, alternating, each repeat times
  oras: oras-py's `Registry.pull` of the same tag into an empty directory: every layer
        written by title, nothing hashed or verified (the `oras` Go CLI has no Debian or
        PyPI package, and building it needs a Go toolchain this host lacks: oras-py is the
        peer, same registry, same run);
  pull: `neuronctl artifacts pull` (OciStore.pull): signature check, every layer hashed
        against the signed sha256s, fsync, atomic publish;
  install: `neuronctl install oci://... DEST` (store.install.install; host checks skipped:
        the artifact is synthetic): the signature referrer, every layer hashed into DEST.
The ratio is oras-py time / neuronctl time of the best repeats (>= 1 means neuronctl is as
fast). Then a `neuronctl artifacts pull` subprocess is SIGKILLed once half of the artifact's
bytes are on disk, and the re-run's re-downloaded bytes are counted by neuronctl and, from
the server's side, by the registry's access log.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from remote import MB, SIGNER, TRUST, layout, make_artifact  # noqa: E402  (bench/remote.py)

from neuronctl.store.install import install  # noqa: E402
from neuronctl.store.local import Store  # noqa: E402
from neuronctl.store.remote.oci import BLOB_CACHE, OciStore  # noqa: E402
from tests.ociregistry import OciRegistry, registry_binary  # noqa: E402

PEER_NOTE = ("peer: oras-py Registry.pull (the oras Go CLI is not installed here: no Debian "
             "or PyPI package, and building it from the Go module proxy needs a Go toolchain "
             "this host lacks)")


def oras_pull(target: str, dest: Path) -> float:
    import oras.client

    client = oras.client.OrasClient(insecure=True)
    started = time.perf_counter()
    client.pull(target=target, outdir=str(dest))
    return time.perf_counter() - started


def neuronctl_pull(url: str, dirname: str, dest: Path) -> float:
    started = time.perf_counter()
    published = OciStore(url).pull(dirname, Store(dest), policy=TRUST)
    elapsed = time.perf_counter() - started
    assert not published.cache_hit
    return elapsed


def neuronctl_install(url: str, dest: Path) -> float:
    started = time.perf_counter()
    install(url, dest, TRUST, lambda manifest: [], lambda line: None)
    return time.perf_counter() - started


def on_disk(cache: Path) -> int:
    try:
        return sum(p.stat().st_size for p in cache.iterdir())
    except FileNotFoundError:
        return 0


def killed_at_half(url: str, dirname: str, total: int, registry: OciRegistry,
                   work: Path) -> dict[str, object]:
    """SIGKILL a CLI pull at 50 % of the bytes, re-run it, count what came again."""
    store = work / "killed"
    cache = store / "neuron-compiled-artifacts" / BLOB_CACHE
    proc = subprocess.Popen(
        [sys.executable, "-m", "neuronctl.cli.main", "artifacts", "pull", f"{url}:{dirname}",
         "--store", str(store)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    while on_disk(cache) < total // 2:
        if proc.poll() is not None:
            raise RuntimeError("the pull ended before half of it was on disk")
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    at_kill = on_disk(cache)
    verified = sum(p.stat().st_size for p in cache.iterdir() if ".partial-" not in p.name)
    before = registry.served_blob_bytes()
    remote = OciStore(url)
    remote.pull(dirname, Store(store), policy=TRUST)
    after = registry.served_blob_bytes()
    served_again = sum(after.get(d, 0) - before.get(d, 0) for d in after)
    return {
        "killed_at_mb": round(at_kill / MB, 1),
        "verified_at_kill_mb": round(verified / MB, 1),
        "rerun_downloaded_mb": round(remote.downloaded_bytes / MB, 1),
        "rerun_registry_sent_mb": round(served_again / MB, 1),
        "rerun_reused_mb": round(remote.reused_bytes / MB, 1),
        "rerun_fraction_of_artifact": round(remote.downloaded_bytes / total, 3),
    }


def run(work: Path, registry: OciRegistry, size_mb: int, repeat: int) -> dict[str, object]:
    os.environ["NEURONCTL_TRUSTED_KEYS"] = str(write_public_key(work / "bench.pub"))
    url = f"oci://{registry.host}/bench/model"
    files = layout(size_mb)
    artifact = make_artifact(work / "src", files)
    total = sum(files.values())
    started = time.perf_counter()
    OciStore(url).push(artifact, signer=SIGNER)
    push_s = time.perf_counter() - started
    started = time.perf_counter()
    assert OciStore(url).push(artifact, signer=SIGNER).noop
    repush_s = time.perf_counter() - started

    oras_times, pull_times, install_times = [], [], []
    for i in range(repeat):
        oras_times.append(oras_pull(f"{registry.host}/bench/model:{artifact.name}",
                                    work / f"oras{i}"))
        shutil.rmtree(work / f"oras{i}")
        pull_times.append(neuronctl_pull(url, artifact.name, work / f"pull{i}"))
        shutil.rmtree(work / f"pull{i}")
        install_times.append(neuronctl_install(f"{url}:{artifact.name}", work / f"dest{i}"))
        shutil.rmtree(work / f"dest{i}")
    oras_best, pull_best = min(oras_times), min(pull_times)
    return {
        "artifact_mb": round(total / MB, 1),
        "layers": len(files),
        "push_mb_s": round(total / MB / push_s, 1),
        "repush_noop_s": round(repush_s, 3),
        "oras_py_pull_s": [round(t, 2) for t in oras_times],
        "neuronctl_pull_s": [round(t, 2) for t in pull_times],
        "oras_py_mb_s": round(total / MB / oras_best, 1),
        "neuronctl_mb_s": round(total / MB / pull_best, 1),
        "ratio_oras_py_to_neuronctl_time": round(oras_best / pull_best, 3),
        "neuronctl_install_s": [round(t, 2) for t in install_times],
        "neuronctl_install_mb_s": round(total / MB / min(install_times), 1),
        **killed_at_half(url, artifact.name, total, registry, work),
        "note": PEER_NOTE,
    }


def write_public_key(path: Path) -> Path:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(SIGNER.key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if registry_binary() is None:
        print("bench/oci.py: docker-registry is not installed (`make install` installs it "
              "as root: apt-get install docker-registry); skipped")
        return
    work = Path(tempfile.mkdtemp(prefix="neuronctl-bench-oci-"))
    registry = OciRegistry(work / "registry").start()
    try:
        results = run(work, registry, args.size_mb, args.repeat)
    finally:
        registry.stop()
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for name, value in results.items():
        print(f"{name:>32}: {value}")


if __name__ == "__main__":
    main()
