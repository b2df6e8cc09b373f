"""A real process that publishes one artifact, for kill and concurrency tests.

usage: python -m tests.publish_worker STORE DIRNAME PAUSE_AT MARKER BUILDS_LOG
PAUSE_AT is a publish step name (or "none"): on reaching it the worker touches MARKER and
sleeps, waiting to be killed. Every build appends a line to BUILDS_LOG.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from neuronctl.store.local import Store
from neuronctl.store.manifest import Manifest, Source


def main() -> None:
    store_dir, dirname, pause_at, marker, builds_log = sys.argv[1:6]

    def pause(step: str) -> None:
        if step == pause_at:
            Path(marker).touch()
            time.sleep(120)

    def build(staging: Path) -> Manifest:
        with open(builds_log, "a") as log:
            log.write(f"{os.getpid()}\n")
        (staging / "weights").mkdir()
        for rank in range(2):
            (staging / "weights" / f"tp{rank}_sharded_checkpoint.safetensors").write_bytes(
                os.urandom(256 * 1024)
            )
            pause("mid-build")
        if pause_at == "none":  # a run to completion: long enough for a concurrent
            time.sleep(0.5)  # process to queue on the lock (one waiting to be killed needs none)
        return Manifest(
            backend="torch",
            backend_versions={"torch": "test"},
            spec={"tp_degree": 2},
            keys={"graph_key": "g", "weights_key": "w", "artifact_key": dirname},
            source=Source(digest="d"),
            architecture={},
        )

    published = Store(Path(store_dir)).publish(dirname, build, on_step=pause)
    print(json.dumps({"path": str(published.path), "cache_hit": published.cache_hit}))


if __name__ == "__main__":
    main()
