"""The build farm: every entry of a build plan compiled on a Ray cluster, one task each.

Each task runs `neuronctl compile --plan FILE --entry N --remote URL --json` in a child
process on a Ray worker (the worker keeps no compiler or torch state between builds), asking
Ray for the CPUs and memory that compile needs (`needs`). The driver (this process):

  1. skips an entry the remote already holds ("already published");
  2. claims the key on the remote (store/remote/claim.py) and checks the remote again, so
     two plans that share an entry, run at once, build it once: the other waits for the
     artifact (then "skipped") or for the claim to go (the build failed: it builds);
  3. submits the task; a failed task (non-zero exit, a crashed worker) is reported with its
     log without stopping the others;
  4. writes each task's log under the log folder and returns one FarmResult per entry.

Ray is imported only where a farm runs: `pip install 'neuronctl[ray]'`.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from neuronctl.errors import NeuronctlError, UsageError
from neuronctl.fleet.workload import DTYPE_BYTES, GIB
from neuronctl.plan import load_plan
from neuronctl.workers import PR_SET_PDEATHSIG

logger = logging.getLogger(__name__)

BASE_MEMORY = 2 * GIB  # the interpreter, torch and the compiler's own processes
LOG_CAP = 1 << 20  # the last MiB of a task's log crosses back to the driver
TAIL_LINES = 20
RAY_EXTRA = "pip install 'neuronctl[ray]'"
STATUSES = ("published", "built", "skipped", "failed")
# What the CLI main module is, so a worker runs the neuronctl its own interpreter has.
NEURONCTL_MAIN = ("-m", "neuronctl.cli.main")


@dataclass(frozen=True)
class FarmJob:
    """One entry of the plan, as a task: the compile's arguments and what it asks Ray for."""

    entry: int
    name: str
    key: str  # the artifact directory name (20 hex digits)
    artifact_key: str
    args: tuple[str, ...]  # after `neuronctl`
    cpus: int
    memory: int  # bytes
    problem: str = ""  # why its keys could not be computed here: failed without a task


@dataclass
class FarmResult:
    entry: int
    name: str
    key: str
    status: str  # one of STATUSES
    seconds: float = 0.0
    reason: str = ""
    log: str | None = None  # the full log, on the driver's host
    tail: list[str] = field(default_factory=list)  # its last lines, for a failure
    node: str = ""

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["seconds"] = round(self.seconds, 3)
        return data


# -- what a compile needs ------------------------------------------------------------------------


def needs(spec: Any, checkpoint: Any) -> tuple[int, int]:
    """CPUs and memory (bytes) one compile asks Ray for.

    CPUs: one per bucket (context and token generation): each bucket is at least one graph
    and the backends compile graphs in parallel. Memory: BASE_MEMORY, plus the checkpoint as
    read, plus the artifact's weights as written (parameters x the compile dtype's bytes).
    """
    buckets = len(spec.context_buckets) + len(spec.token_gen_buckets)
    weights = checkpoint.num_parameters() * DTYPE_BYTES.get(str(spec.dtype), 4)
    return max(1, buckets), BASE_MEMORY + checkpoint.size_on_disk() + weights


def farm_jobs(
    plan_path: Path,
    *,
    remote_url: str | None,
    store_dir: Path | None = None,
    cpus: int | None = None,
    extra_args: tuple[str, ...] = (),
) -> list[FarmJob]:
    """One job per entry of the plan: its key (the plan's own resolution) and its needs. An
    entry whose checkpoint cannot be read is a job that fails without a task (the others
    still build); an invalid plan (a usage error) stops everything, as `plan` does."""
    from neuronctl.build import resolve_build

    plan_path = Path(plan_path).resolve()
    jobs = []
    for entry in load_plan(plan_path):
        try:
            build = resolve_build(
                entry.model, entry.spec_flags, revision=entry.revision, store_dir=store_dir
            )
        except UsageError as exc:
            exc.message = f"{plan_path} entry {entry.index} ({entry.name}): {exc.message}"
            raise
        except NeuronctlError as exc:
            problem = f"error: {exc.message}" + (f" ({exc.hint})" if exc.hint else "")
            jobs.append(FarmJob(entry.index, entry.name, "", "", (), 0, 0, problem))
            continue
        want_cpus, memory = needs(build.spec, build.checkpoint)
        jobs.append(
            FarmJob(
                entry=entry.index,
                name=entry.name,
                key=build.keys.dirname,
                artifact_key=build.keys.artifact,
                args=compile_args(plan_path, entry.index, cpus or want_cpus, remote_url,
                                  store_dir, extra_args),  # fmt: skip
                cpus=cpus or want_cpus,
                memory=memory,
            )
        )
    return jobs


def compile_args(
    plan_path: Path,
    entry: int,
    cpus: int,
    remote_url: str | None,
    store_dir: Path | None,
    extra: tuple[str, ...],
) -> tuple[str, ...]:
    args = ["-v", "compile", "--plan", str(plan_path), "--entry", str(entry)]
    args += ["--jobs", str(cpus), "--json"]
    if remote_url:
        args += ["--remote", remote_url]
    if store_dir is not None:
        args += ["--store", str(Path(store_dir).resolve())]
    return (*args, *extra)


# -- the task (runs on a Ray worker) -------------------------------------------------------------


def compile_task(job: FarmJob) -> dict[str, Any]:
    """Run one compile in a child process; its JSON, exit code and log come back."""
    started = time.monotonic()
    with tempfile.TemporaryFile() as log:
        done = subprocess.run(
            [sys.executable, *NEURONCTL_MAIN, *job.args],
            stdout=subprocess.PIPE,
            stderr=log,
            check=False,
            preexec_fn=_die_with_worker if sys.platform.startswith("linux") else None,
        )
        size = log.seek(0, os.SEEK_END)
        log.seek(max(0, size - LOG_CAP))
        text = log.read().decode(errors="replace")
    return {
        "returncode": done.returncode,
        "stdout": done.stdout.decode(errors="replace"),
        "log": text,
        "seconds": time.monotonic() - started,
        "node": socket.gethostname(),
    }


def _die_with_worker() -> None:
    """In the compile's process before it runs: SIGTERM when the Ray worker that started it
    dies (a cancelled task, a lost node), so no compile runs on orphaned. The compile's own
    graph workers die with it (workers.py)."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def outcome(job: FarmJob, output: dict[str, Any], remote: bool) -> tuple[str, str]:
    """(status, reason) of a finished task."""
    code = output["returncode"]
    if code < 0:  # a signal: the kernel's OOM killer sends 9
        hint = " (out of memory?)" if code == -9 else ""
        return "failed", f"compile killed by signal {-code}{hint}"
    if code != 0:
        return "failed", _error_line(output["log"]) or f"compile exited with {code}"
    try:
        data = json.loads(output["stdout"])
    except ValueError:
        return "failed", "compile printed no JSON summary"
    if data.get("artifact_key") != job.artifact_key:
        return "failed", (
            f"the worker computed key {str(data.get('artifact_key'))[:12]}, the plan "
            f"{job.artifact_key[:12]}: its versions differ from this host's (compare "
            "`neuronctl hash` on both)"
        )
    if data.get("pulled") or (remote and data.get("pushed") is False):
        return "skipped", "published by another build meanwhile"
    if not remote:
        return ("skipped", "already in the worker's store") if data.get("cache_hit") else (
            "built", ""
        )
    return "published", ""


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _task_error(exc: BaseException) -> str:
    """What a failed Ray task raised (a RayTaskError carries it as `cause`), else what Ray
    says happened (a lost worker, the memory monitor's kill), on one line."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        return f"the task raised {type(cause).__name__}: {cause}"
    lines = [line for line in ANSI.sub("", str(exc)).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0].strip() if lines else ''}"


def _error_line(log: str) -> str:
    """The one-line error neuronctl printed last (`error: ...`), else the last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"(error|Error)\b", line):
            return line
    return lines[-1] if lines else ""


# -- the driver ----------------------------------------------------------------------------------


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise UsageError("the build farm needs Ray", RAY_EXTRA) from None
    return ray


def largest_node(ray: Any) -> tuple[float, float]:
    """The CPUs and memory of the largest live node: what one task can be given at most."""
    cpus, memory = 0.0, 0.0
    for node in ray.nodes():
        if node.get("Alive"):
            resources = node.get("Resources", {})
            cpus = max(cpus, float(resources.get("CPU", 0)))
            memory = max(memory, float(resources.get("memory", 0)))
    return cpus, memory


@dataclass
class FarmOptions:
    log_dir: Path
    poll_s: float = 2.0
    claim_ttl_s: float = 300.0
    on_result: Callable[[FarmResult], None] | None = None


@dataclass
class _Running:
    job: FarmJob
    claim: Any  # a store.remote.claim.Claim, or None


class Farm:
    """The driver's loop over a plan's jobs (see the module docstring for its steps)."""

    def __init__(
        self,
        jobs: list[FarmJob],
        remote: Any,
        options: FarmOptions,
        task: Callable[[FarmJob], dict[str, Any]] | None = None,
    ) -> None:
        from neuronctl.store.remote.claim import supports_claims

        self.ray = import_ray()
        self.remote = remote
        self.options = options
        self.claims = remote is not None and supports_claims(remote)
        if remote is not None and not self.claims:
            logger.warning(
                "%s cannot create a claim only where none exists: a plan run beside this one "
                "may build the same entry (the remote keeps the first push)", remote.url
            )
        self.task = self.ray.remote(task or compile_task)
        self.waiting = list(jobs)
        self.running: dict[Any, _Running] = {}
        self.results: dict[int, FarmResult] = {}
        self.announced: set[int] = set()

    def run(self) -> list[FarmResult]:
        self._refuse_infeasible()
        try:
            self._loop()
        finally:  # interrupted, or the remote failed: no task left running, no claim held
            for ref, running in self.running.items():
                self.ray.cancel(ref, force=True)
                if running.claim is not None:
                    running.claim.release()
        return [self.results[i] for i in sorted(self.results)]

    def _loop(self) -> None:
        while self.waiting or self.running:
            self._start_what_can()
            if self.running:
                refs = list(self.running)
                ready, _ = self.ray.wait(refs, num_returns=1, timeout=self.options.poll_s)
                for ref in ready:
                    self._finish(ref)
            elif self.waiting:
                time.sleep(self.options.poll_s)
            self._refresh_claims()

    def _refuse_infeasible(self) -> None:
        """A job without keys, or a task no node can hold (it would wait forever), fails
        now, and says why."""
        cpus, memory = largest_node(self.ray)
        for job in list(self.waiting):
            if job.problem:
                self.waiting.remove(job)
                self._record(FarmResult(job.entry, job.name, job.key, "failed",
                                        reason=job.problem, tail=[job.problem]))  # fmt: skip
            elif memory and job.memory > memory:
                self.waiting.remove(job)
                self._record(FarmResult(job.entry, job.name, job.key, "failed", reason=(
                    f"needs {job.memory / GIB:.1f} GiB of memory; the largest Ray node "
                    f"offers {memory / GIB:.1f} GiB"
                )))  # fmt: skip
            elif cpus and job.cpus > cpus:
                logger.info("entry %d: %d CPUs asked, the largest node has %d: %d given",
                            job.entry, job.cpus, cpus, cpus)  # fmt: skip
                index = self.waiting.index(job)
                self.waiting[index] = _with_cpus(job, int(cpus))

    def _start_what_can(self) -> None:
        for job in list(self.waiting):
            if self._published(job):
                self.waiting.remove(job)
                self._record(FarmResult(job.entry, job.name, job.key, "skipped",
                                        reason="already published"))  # fmt: skip
                continue
            claim = None
            if self.claims:
                from neuronctl.store.remote.claim import live_holder, try_claim

                claim = try_claim(self.remote, job.key, self.options.claim_ttl_s)
                if claim is None:
                    if job.entry not in self.announced:
                        holder = live_holder(self.remote, job.key)
                        logger.info("entry %d (%s): %s builds it; waiting", job.entry,
                                    job.key, holder)  # fmt: skip
                        self.announced.add(job.entry)
                    continue
                if self._published(job):  # its builder published and let go before we came
                    claim.release()
                    self.waiting.remove(job)
                    self._record(FarmResult(job.entry, job.name, job.key, "skipped",
                                            reason="already published"))  # fmt: skip
                    continue
            self.waiting.remove(job)
            ref = self.task.options(
                num_cpus=job.cpus, memory=job.memory, max_retries=0,
                name=f"neuronctl-compile-{job.entry}-{job.name}",
            ).remote(job)  # fmt: skip
            self.running[ref] = _Running(job, claim)

    def _published(self, job: FarmJob) -> bool:
        return self.remote is not None and bool(self.remote.has(job.key))

    def _finish(self, ref: Any) -> None:
        running = self.running.pop(ref)
        job = running.job
        try:
            output = self.ray.get(ref)
        except Exception as exc:  # the worker died, Ray killed it (memory), a task error
            text = ANSI.sub("", str(exc))
            output = {"returncode": 1, "stdout": "", "log": f"{text}\nerror: {_task_error(exc)}",
                      "seconds": 0.0, "node": ""}  # fmt: skip
        finally:
            if running.claim is not None:
                running.claim.release()
        status, reason = outcome(job, output, self.remote is not None)
        log_path = self._write_log(job, output["log"])
        tail = output["log"].splitlines()[-TAIL_LINES:] if status == "failed" else []
        self._record(FarmResult(job.entry, job.name, job.key, status, output["seconds"],
                                reason, str(log_path), tail, output["node"]))  # fmt: skip

    def _write_log(self, job: FarmJob, text: str) -> Path:
        folder = self.options.log_dir
        folder.mkdir(parents=True, exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9_.=-]", "_", job.name)
        path = folder / f"{job.entry}-{safe}-{job.key}.log"
        path.write_text(text)
        return path

    def _record(self, result: FarmResult) -> None:
        self.results[result.entry] = result
        if self.options.on_result is not None:
            self.options.on_result(result)

    def _refresh_claims(self) -> None:
        due = time.monotonic() - self.options.claim_ttl_s / 5
        for running in self.running.values():
            claim = running.claim
            if claim is not None and claim.refreshed < due and not claim.refresh():
                logger.warning("entry %d: the claim on %s was taken over (it had expired)",
                               running.job.entry, running.job.key)  # fmt: skip


def _with_cpus(job: FarmJob, cpus: int) -> FarmJob:
    args = list(job.args)
    if "--jobs" in args:
        args[args.index("--jobs") + 1] = str(cpus)
    return replace(job, args=tuple(args), cpus=cpus)


def exit_code(results: list[FarmResult]) -> int:
    """0 when every entry is built or published (now or before), 1 when any failed."""
    return 1 if any(r.status == "failed" for r in results) else 0


def check_address(address: str) -> None:
    """Ray retries an address that does not answer for minutes: one TCP connect says it."""
    if address in ("local", "auto"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(
            f"--ray {address}: not an address", "use local, auto, HOST:PORT or ray://HOST:PORT"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
    except OSError as exc:
        raise UsageError(
            f"--ray {address}: no Ray cluster answers there ({exc.strerror or exc})",
            "start one with `ray start --head`, or use --ray local for a cluster in this "
            "process",
        ) from None


def connect(address: str) -> tuple[Any, bool]:
    """Ray, connected: `local` starts a cluster in this process (stopped at the end), `auto`
    joins the one on this host or $RAY_ADDRESS, HOST:PORT or ray://HOST:PORT a given one.
    Returns Ray and whether this call started it."""
    ray = import_ray()
    if ray.is_initialized():
        return ray, False
    check_address(address)
    kwargs: dict[str, Any] = {"log_to_driver": False, "configure_logging": False}
    if address == "local":  # on this host only: nothing of it listens beyond loopback
        kwargs.update(include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        ray.init(address=address, **kwargs)
    except ConnectionError as exc:
        raise UsageError(
            f"--ray {address}: no Ray cluster there ({str(exc).splitlines()[0]})",
            "start one with `ray start --head`, or use --ray local for a cluster in this "
            "process",
        ) from None
    return ray, True
