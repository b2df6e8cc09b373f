"""Probes from issue 13, as an attacker and a careless user would run them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.conftest import TINY_SPEC

ROOT = Path(__file__).resolve().parents[1]


def _spec_flags(spec: dict[str, object]) -> list[str]:
    return [arg for k, v in spec.items() for arg in (f"--{k.replace('_', '-')}", str(v))]


def _workers_of(proc: psutil.Process) -> list[psutil.Process]:
    """The pool's spawned interpreters (not the resource tracker, which exits on its own)."""
    found = []
    for child in proc.children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "spawn_main" in cmdline:
            found.append(child)
    return found


def test_sigkill_of_compile_leaves_no_worker_behind(tiny_llama: Path, tmp_path: Path) -> None:
    # Many graphs and two workers: the pool is busy when the compile process is killed.
    spec = {**TINY_SPEC, "context_buckets": ",".join(str(8 * i) for i in range(1, 9))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "neuronctl.cli.main", "compile", str(tiny_llama),
         *_spec_flags(spec), "--store", str(tmp_path / "store"), "--jobs", "2", "--json"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    parent = psutil.Process(proc.pid)
    deadline = time.monotonic() + 120
    workers: list[psutil.Process] = []
    while len(workers) < 2:
        assert proc.poll() is None, "compile finished before its workers were seen"
        assert time.monotonic() < deadline, "no compile workers appeared"
        time.sleep(0.05)
        workers = _workers_of(parent)

    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)

    gone, alive = psutil.wait_procs(workers, timeout=20)
    for orphan in alive:  # clean up before failing
        orphan.kill()
    assert not alive, f"orphaned compile workers: {[p.pid for p in alive]}"
    assert len(gone) == len(workers)
