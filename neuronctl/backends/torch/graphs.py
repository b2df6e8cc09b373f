"""One graph per bucket: trace with torch.export, optionally compile with AOTInductor.

Graph files are `graphs/context_encoding_<bucket>.pt2` and `graphs/token_generation_<bucket>
.pt2`. Every graph takes (weights dict, rope frequencies, K caches, V caches, ...) as inputs, so
no weight is baked into a graph: graphs are small and shared by every checkpoint with the same
graph key. Graphs are traced from empty tensors of the right shapes; tracing never reads the
checkpoint.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import nullcontext
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from neuronctl.backends.torch import internals, kernel, opchoice
from neuronctl.backends.torch.attention import inv_freq
from neuronctl.backends.torch.config import ModelArgs, Numerics
from neuronctl.backends.torch.layout import graph_shapes
from neuronctl.backends.torch.linear import Linear, linear_for
from neuronctl.backends.torch.model import ContextEncoding, TokenGeneration
from neuronctl.backends.torch.opchoice import prompt_counts
from neuronctl.errors import BuildError
from neuronctl.progress import Progress
from neuronctl.workers import die_with_parent

if TYPE_CHECKING:
    from neuronctl.spec import BuildSpec
    from neuronctl.store.manifest import OpChoice

GRAPHS_DIR = "graphs"
REPORT_DIR = "report"
CONTEXT = "context_encoding"
TOKEN_GEN = "token_generation"


@dataclass(frozen=True)
class GraphJob:
    """Everything a worker process needs to produce one graph file (picklable)."""

    kind: str  # CONTEXT | TOKEN_GEN
    bucket: int
    args: ModelArgs  # the model, parsed from config.json once per build
    batch_size: int
    seq_len: int
    dtype: str
    compiler: str  # "export" | "inductor"
    staging: str
    compute: str = ""  # activations' dtype; "" = the storage dtype (config.Numerics)
    quantized: bool = False  # int8 projections with per-channel scales
    prompts: int = 1  # context encoding: prompts per call (prefill_batch)
    layout: str = opchoice.PLAIN  # the artifact's weight layout (opchoice.READS)
    carries_kernel: bool = False  # some graph calls the kernel: token generation attends by it
    path: str = field(kw_only=True)  # the matmul path at this graph's rows (the op choice's)

    @property
    def name(self) -> str:
        return graph_name(self.kind, self.bucket, self.prompts)

    @property
    def numerics(self) -> Numerics:
        storage = opchoice.TORCH_DTYPES[self.dtype]
        compute = opchoice.TORCH_DTYPES[self.compute] if self.compute else storage
        return Numerics(storage, compute, self.quantized)

    @property
    def relpath(self) -> str:
        return f"{GRAPHS_DIR}/{self.name}.pt2"

    @property
    def packed(self) -> bool:
        return self.layout == opchoice.PACKED

    @property
    def blocked(self) -> bool:
        return self.layout == opchoice.BLOCKED

    @property
    def linear(self) -> Linear:
        return linear_for(self.path, self.quantized, self.kind == TOKEN_GEN)


def graph_name(kind: str, bucket: int, prompts: int = 1) -> str:
    return f"{kind}_{bucket}" if prompts == 1 else f"{kind}_{bucket}x{prompts}"


def graph_jobs(spec: BuildSpec, args: ModelArgs, staging: Path, ops: OpChoice) -> list[GraphJob]:
    """One job per graph of `spec`: a context-encoding graph per context bucket and prompt
    count, a token-generation graph per token-generation bucket; each on its row count's
    path and compute dtype in `ops`."""
    assert isinstance(spec.context_buckets, list) and isinstance(spec.token_gen_buckets, list)
    kinds = [(CONTEXT, b, n) for b in spec.context_buckets for n in prompt_counts(spec.batch_size)]
    kinds += [(TOKEN_GEN, b, 1) for b in spec.token_gen_buckets]
    jobs = []
    for kind, bucket, prompts in kinds:
        row = ops.row(spec.batch_size if kind == TOKEN_GEN else bucket * prompts)
        jobs.append(GraphJob(
            kind, bucket, args, spec.batch_size, spec.seq_len, str(spec.dtype),
            str(spec.compiler), str(staging), compute=row.compute, quantized=spec.quantized,
            prompts=prompts, layout=ops.layout, path=row.path,
            carries_kernel=opchoice.KERNEL in ops.paths,
        ))
    return jobs


def example_inputs(job: GraphJob) -> tuple[Any, ...]:
    """Inputs with the graph's static shapes; values are never read while tracing."""
    args = job.args
    dtype = opchoice.TORCH_DTYPES[job.dtype]
    shapes = graph_shapes(args, dtype, job.packed, job.quantized, job.blocked)
    weights = {name: torch.empty(t.shape, dtype=t.dtype) for name, t in shapes.items()}
    cache_shape = (job.batch_size, args.num_kv_heads, job.seq_len, args.head_dim)
    k = [torch.empty(cache_shape, dtype=dtype) for _ in range(args.num_layers)]
    v = [torch.empty(cache_shape, dtype=dtype) for _ in range(args.num_layers)]
    freq = inv_freq(args)
    if job.kind == CONTEXT:
        tokens = torch.zeros(job.prompts, job.bucket, dtype=torch.long)
        return (
            weights,
            freq,
            k,
            v,
            tokens,
            torch.ones(job.prompts, dtype=torch.long),
            torch.zeros(job.prompts, dtype=torch.long),
        )
    tokens = torch.zeros(job.batch_size, dtype=torch.long)
    return (weights, freq, k, v, tokens, torch.zeros(job.batch_size, dtype=torch.long))


def module_for(job: GraphJob) -> torch.nn.Module:
    if job.kind == CONTEXT:
        return ContextEncoding(job.args, job.numerics, job.linear)
    return TokenGeneration(job.args, job.bucket, job.numerics, job.linear,
                           fused_attention=job.carries_kernel)


def build_graph(job: GraphJob) -> str:
    """Trace (and compile) one graph into staging; on failure write its log and raise."""
    staging = Path(job.staging)
    out = staging / job.relpath
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = staging / REPORT_DIR / f"{job.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_path)
    torch_logger = logging.getLogger("torch")
    torch_logger.addHandler(handler)
    if job.carries_kernel:
        kernel.load()  # fails here, not on the serving host, if it cannot be built
    try:
        with torch.no_grad():
            program = torch.export.export(module_for(job), example_inputs(job), strict=False)
        if job.compiler == "inductor":
            with internals.onednn_weights_as_inputs() if job.packed else nullcontext():
                internals.aoti_compile_and_package(program, out)
        else:
            # The example inputs are empty weight-sized tensors: never store them.
            program.example_inputs = None
            torch.export.save(program, str(out))
    except Exception as exc:
        with open(log_path, "a") as log:
            handler.flush()
            log.write(traceback.format_exc())
        raise BuildError(
            f"compiling graph {job.name} failed: {type(exc).__name__}: {exc}"
            f" (compiler log: {REPORT_DIR}/{job.name}.log)"
        ) from None
    finally:
        torch_logger.removeHandler(handler)
        handler.close()
    log_path.unlink(missing_ok=True)  # a successful build keeps no report
    return job.relpath


def build_graphs(jobs: list[GraphJob], workers: int, progress: Progress) -> list[str]:
    """Build every graph, in parallel spawn workers when allowed; first failure wins."""
    bars = {job.name: progress.task(f"{job.compiler} {job.name}", total=1) for job in jobs}
    if workers <= 1 or len(jobs) == 1:
        # In-process: no interpreter start-up per graph, which dominates tiny builds.
        done = []
        for job in jobs:
            done.append(build_graph(job))
            bars[job.name](1)
        return done
    return _build_in_pool(jobs, min(workers, len(jobs)), bars)


GRAPH_TIMEOUT_ENV = "NEURONCTL_GRAPH_TIMEOUT"
DEFAULT_GRAPH_TIMEOUT = 3600.0  # seconds a pool may go without finishing a graph


def graph_timeout() -> float:
    return kernel.timeout_from_env(GRAPH_TIMEOUT_ENV, DEFAULT_GRAPH_TIMEOUT, example=7200)


def _build_in_pool(
    jobs: list[GraphJob],
    workers: int,
    bars: dict[str, Callable[[float], None]],
    build: Callable[[GraphJob], str] = build_graph,
) -> list[str]:
    results: dict[str, str] = {}
    timeout = graph_timeout()
    # Workers die with this process (SIGKILL included), and kill the C++ compilers AOTInductor
    # runs in them first (whole_tree): no orphan keeps compiling.
    with ProcessPoolExecutor(
        max_workers=workers,
        mp_context=get_context("spawn"),
        initializer=die_with_parent,
        initargs=(os.getpid(), True),
    ) as pool:
        pending: dict[Future[str], GraphJob] = {pool.submit(build, j): j for j in jobs}
        try:
            while pending:
                finished, _ = wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
                if not finished:  # a worker hangs (or the host is far too slow): stop them all
                    _kill_workers(pool)
                    names = ", ".join(sorted(job.name for job in pending.values()))
                    raise BuildError(
                        f"no graph finished in {timeout:.0f} s (pending: {names}); "
                        "killed the compile workers",
                        f"raise {GRAPH_TIMEOUT_ENV} on a slow host, or use --jobs 1",
                    )
                for future in finished:
                    job = pending.pop(future)
                    results[job.name] = _result(future, job)
                    bars[job.name](1)
        except BaseException:
            for future in pending:
                future.cancel()
            raise
    return [results[job.name] for job in jobs]


def _kill_workers(pool: ProcessPoolExecutor) -> None:
    """Stop every worker: shutdown() alone waits for the running jobs to finish. SIGTERM
    first, as a worker then kills what runs below it (die_with_parent's whole_tree), where a
    SIGKILL left its compiler running, orphaned; SIGKILL whatever remains after a grace."""
    processes = internals.pool_processes(pool)
    for process in processes:
        process.terminate()
    deadline = time.monotonic() + kernel.KILL_GRACE_SECONDS
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    kill = getattr(pool, "kill_workers", None)  # Python 3.14
    if kill is not None:
        kill()
        return
    for process in internals.pool_processes(pool):
        process.kill()


def _result(future: Future[str], job: GraphJob) -> str:
    try:
        return future.result()
    except BuildError:
        raise
    except Exception as exc:  # the worker died (out of memory, killed): name the bucket
        why = f"{type(exc).__name__}: {exc}"
        raise BuildError(f"compiling graph {job.name} failed: {why}") from None
