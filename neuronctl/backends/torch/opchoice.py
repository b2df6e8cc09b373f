"""Which path and compute dtype each graph's matmuls take: chosen on the build host,
recorded in the manifest.

Paths, and the weight layouts each reads (layout.graph_sources):

- `kernel`: kernel.linear (gemv.cpp): neuronctl::linear_blocked on the `blocked` layout,
  neuronctl::linear_rows on the `plain` one; it computes in float32;
- `onednn`: linear.packed_linear on oneDNN-prepacked (`packed`) weights, computing in the
  storage dtype (float32, or bf16 where the CPU has bf16 units);
- `aten`: linear.linear on `plain` [N, K] weights, in any compute dtype (int8 token
  generation: linear.int8_linear);
- `gemv`: linear.gemv, inductor's fused reduction, on `plain` weights. It exists only
  compiled, so it is never timed: it is the rule's choice for a few rows where the kernel
  does not run (arm64, x86 without AVX2).

A graph computes (activations and matmuls) in float32, or in its storage dtype where the CPU
has units for that dtype (`ChoiceInputs.computes`); each row count gets its own. An artifact holds
its weights once, in one layout; per row count its graphs take the fastest (path, compute
dtype) that reads that layout. The row counts are those the graphs run at: the
token-generation batch and each context bucket times the prompts per call.

`measure` (the default; NEURONCTL_OP_CHOICE) times every candidate (`path/layout/dtype`)
eagerly on random weights of the model's projection shapes, in ROUNDS rounds that
interleave the candidates and the row counts, and keeps each candidate's fastest round (a
burst of load elsewhere only ever adds time). The layout is the one a served request costs
least on: a prompt once (one context-encoding call, each context row count alike) and then
GENERATED token-generation steps (`request_weights`). Then each row count takes its fastest
candidate on that layout. It measures only where AOTInductor compiles and the kernel runs
(elsewhere the untimed gemv would compete).
`rules` picks as the ISA rules below do, without timing: identical artifacts across the
builds of one host class, whatever the load.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import torch

from neuronctl.backends.torch import host, kernel
from neuronctl.backends.torch.config import ModelArgs, Numerics
from neuronctl.backends.torch.layout import blockable
from neuronctl.backends.torch.linear import can_pack, linear_for, pack_weight, packed_linear
from neuronctl.backends.torch.quantize import quantize
from neuronctl.errors import UsageError
from neuronctl.store.manifest import (
    ComputeDtype,
    MatmulPath,
    OpChoice,
    RowChoice,
    WeightLayout,
)

if TYPE_CHECKING:
    from neuronctl.spec import BuildSpec

ENV = "NEURONCTL_OP_CHOICE"
MEASURE: Final = "measure"
RULES: Final = "rules"
KERNEL: Final = "kernel"
ONEDNN: Final = "onednn"
ATEN: Final = "aten"
GEMV: Final = "gemv"
BLOCKED: Final = "blocked"
PACKED: Final = "packed"
PLAIN: Final = "plain"
LAYOUTS: tuple[WeightLayout, ...] = (BLOCKED, PACKED, PLAIN)
# The layouts each path reads.
READS: dict[MatmulPath, tuple[WeightLayout, ...]] = {
    KERNEL: (BLOCKED, PLAIN), ONEDNN: (PACKED,), ATEN: (PLAIN,), GEMV: (PLAIN,)}
# How a candidate's name spells its compute dtype, and the dtype the record names.
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
COMPUTE_DTYPE_NAMES: dict[torch.dtype, ComputeDtype] = {
    torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
TORCH_DTYPES: dict[str, torch.dtype] = {name: dtype for dtype, name in COMPUTE_DTYPE_NAMES.items()}
# The GEMV's batch range (rules): measured on a 2-core AVX-512 host, it streams weights at
# full bandwidth up to 4 rows, aten's GEMM wins beyond (docs/torch-backend.md). Weights
# stored narrower than they compute (bf16 on a CPU without bf16 units) it widens as it
# streams: at 8 rows, one 1536x576 projection on an AVX2 EPYC took 0.62 ms against 1.28 ms.
GEMV_MAX_BATCH = 4
GEMV_MAX_WIDENED_BATCH = 8
# Context buckets run at up to thousands of rows. Each path is compute-bound long before 256
# rows (every path's tile loop is saturated), so its rank there is its rank at more rows, and
# timing 256 keeps the measurement to seconds for a 30-layer model. A bucket's time is
# scaled from the timed rows to its own (linear in rows once compute-bound).
MAX_TIMED_ROWS = 256
# A layout (or a path) other than the rules' must be this much faster to be chosen. Repeated
# timings of one path on a busy 2-core host vary by a few percent; below this margin two
# builds of the same spec could pick differently for no real gain.
MARGIN = 0.07
# Each candidate is timed in ROUNDS rounds of REPS calls (after one warm-up per round); the
# rounds interleave the row counts and, within a round, the candidates take turns every
# call. The fastest call counts: on a busy host most calls of a 2-thread op wait for a
# descheduled thread, and load elsewhere only ever adds time. Rounds spread the calls over
# seconds, so one burst of load cannot cover all of a candidate's calls.
ROUNDS = 5
REPS = 4
# The request the layout is chosen for (docs/torch-backend.md): one prompt, then this many
# generated tokens, one token-generation step each.
GENERATED = 128

# (target, rows) -> milliseconds one step's projections take by each candidate: one round
Timer = Callable[["ChoiceInputs", int], dict[str, float]]


@dataclass(frozen=True)
class ChoiceInputs:
    """What the choice depends on besides timings."""

    args: ModelArgs
    numerics: Numerics  # storage, quantized; `compute` is the rules' compute dtype
    compiler: str
    batch_size: int
    rows: tuple[int, ...]  # the row counts the graphs run at, ascending
    kernel: bool  # neuronctl's kernel runs here and takes every matrix unpadded
    onednn: bool  # oneDNN's packed GEMM runs the storage dtype natively here
    context_rows: tuple[int, ...] = ()  # the context graphs' rows; () = all but the batch's

    @property
    def computes(self) -> tuple[torch.dtype, ...]:
        """The compute dtypes a graph may run in: float32, and the storage dtype where the
        CPU has units for it (the rules' compute dtype is then the storage dtype)."""
        return tuple(dict.fromkeys((torch.float32, self.numerics.compute)))

    @property
    def paths(self) -> list[MatmulPath]:
        """The paths that can be timed here, rules' first."""
        available: list[tuple[MatmulPath, bool]] = [
            (KERNEL, self.kernel), (ONEDNN, self.onednn), (ATEN, True)]
        return [path for path, ok in available if ok]

    def path_computes(self, path: MatmulPath) -> tuple[torch.dtype, ...]:
        if path == KERNEL:
            return (torch.float32,)
        if path == ONEDNN:
            return (self.numerics.storage,)
        return self.computes

    @property
    def candidates(self) -> list[str]:
        """What is timed: each available path on each layout it reads in each compute dtype
        it runs in (`candidate`)."""
        return [candidate(path, layout, compute) for path in self.paths
                for layout in READS[path] for compute in self.path_computes(path)]

    @property
    def contexts(self) -> tuple[int, ...]:
        return self.context_rows or tuple(r for r in self.rows if r != self.batch_size)

    @property
    def measurable(self) -> bool:
        return self.compiler == "inductor" and self.kernel


def candidate(path: str, layout: str, compute: torch.dtype = torch.float32) -> str:
    return f"{path}/{layout}/{SHORT[compute]}"


def split(name: str) -> tuple[MatmulPath, WeightLayout, torch.dtype]:
    path, layout, short = name.split("/")
    compute = next(dtype for dtype, text in SHORT.items() if text == short)
    return path, layout, compute  # type: ignore[return-value]


def spec_inputs(spec: BuildSpec, args: ModelArgs) -> ChoiceInputs:
    """The choice's inputs for a build of `spec` on this host: the compute dtype its units
    allow (host.compute_dtype), the row counts of its graphs."""
    assert isinstance(spec.context_buckets, list)
    compute = host.compute_dtype(str(spec.dtype), spec.quantized, host.half_units())
    numerics = Numerics(TORCH_DTYPES[str(spec.dtype)], TORCH_DTYPES[compute], spec.quantized)
    rows = graph_rows(spec.context_buckets, spec.batch_size)
    contexts = context_rows(spec.context_buckets, spec.batch_size)
    return inputs_for(spec, args, numerics, rows, host.cpu_flags(), contexts)


def prompt_counts(batch_size: int) -> list[int]:
    """How many prompts a context-encoding graph takes at once: 1, and batch_size.

    One extra graph per context bucket: every graph is compile time (tens of seconds with
    inductor). The runner pads a group to batch_size only when that at most doubles its
    rows; smaller groups go one prompt per call.
    """
    return [1] if batch_size == 1 else [1, batch_size]


def graph_rows(context_buckets: list[int], batch_size: int) -> tuple[int, ...]:
    """Rows per matmul of each graph, ascending: token generation's batch, and each context
    bucket times the prompts a context-encoding graph takes."""
    return tuple(sorted({batch_size, *context_rows(context_buckets, batch_size)}))


def context_rows(context_buckets: list[int], batch_size: int) -> tuple[int, ...]:
    """Rows per matmul of the context-encoding graphs, ascending."""
    return tuple(sorted({b * n for b in context_buckets for n in prompt_counts(batch_size)}))


def inputs_for(
    spec: BuildSpec, args: ModelArgs, numerics: Numerics,
    rows: tuple[int, ...], cpu_flags: str | None = None, context_rows: tuple[int, ...] = (),
) -> ChoiceInputs:
    """The choice's inputs for a spec: `rows` the graphs' (graph_rows)."""
    compiler = str(spec.compiler)
    flags = host.cpu_flags() if cpu_flags is None else cpu_flags
    return ChoiceInputs(
        args=args,
        numerics=numerics,
        compiler=compiler,
        batch_size=spec.batch_size,
        rows=rows,
        kernel=compiler == "inductor" and host.kernel_runs_on(flags) and blockable(args),
        onednn=(compiler == "inductor" and not numerics.quantized
                and numerics.storage == numerics.compute and can_pack(numerics.storage)),
        context_rows=context_rows,
    )


def mode() -> str:
    value = os.environ.get(ENV, "") or MEASURE
    if value not in (MEASURE, RULES):
        raise UsageError(f"{ENV}={value!r} is not one of {MEASURE}, {RULES}",
                         f"{ENV}={RULES} picks by the ISA rules, without timing")
    return value


def choose(target: ChoiceInputs, timer: Timer | None = None) -> OpChoice:
    """The artifact's choice: measured where it can be and the mode asks for it."""
    if target.measurable and mode() == MEASURE:
        return measured(target, timer or step_ms)
    return by_rules(target)


# --- the rules -------------------------------------------------------------------------------


def rule_layout(target: ChoiceInputs) -> WeightLayout:
    """Blocked where the kernel runs and the graphs compute in float32 (it widens bf16 and
    int8 in registers as they stream); packed for batches above the GEMV's range whose
    weights are in the dtype oneDNN computes natively; plain elsewhere."""
    if target.kernel and target.numerics.compute == torch.float32:
        return BLOCKED
    if target.onednn and target.batch_size > GEMV_MAX_BATCH:
        return PACKED
    return PLAIN


def rule_path(target: ChoiceInputs, layout: str, rows: int) -> MatmulPath:
    if layout == BLOCKED:
        return KERNEL
    if layout == PACKED:
        return ONEDNN
    numerics = target.numerics
    widened = numerics.storage != numerics.compute and not numerics.quantized
    most = GEMV_MAX_WIDENED_BATCH if widened else GEMV_MAX_BATCH
    token_gen = rows == target.batch_size
    if token_gen and target.compiler == "inductor" and not numerics.quantized and rows <= most:
        return GEMV
    return ATEN  # int8 token generation: aten's int8 kernel (linear.linear_for)


def by_rules(target: ChoiceInputs, layout: WeightLayout | None = None) -> OpChoice:
    """The rules: the compute dtype the CPU's units allow (host.compute_dtype) everywhere."""
    layout = layout or rule_layout(target)
    compute = COMPUTE_DTYPE_NAMES[target.numerics.compute]
    rows = [RowChoice(rows=r, path=rule_path(target, layout, r), compute=compute)
            for r in target.rows]
    return OpChoice(layout=layout, rows=rows, chosen_by=RULES)


# --- measuring -------------------------------------------------------------------------------


def request_weights(target: ChoiceInputs) -> dict[int, float]:
    """How often a served request runs each row count's graphs: its prompt once, in one
    context-encoding call (each context row count alike), then GENERATED token-generation
    steps. A row count both kinds run at adds both."""
    contexts = target.contexts
    weights = dict.fromkeys(target.rows, 0.0)
    for r in contexts:
        weights[r] += 1 / len(contexts)
    weights[target.batch_size] = weights.get(target.batch_size, 0.0) + GENERATED
    return weights


def sampled_ms(target: ChoiceInputs, timer: Timer, timed: list[int]) -> dict[int, dict[str, float]]:
    """Each candidate's fastest of ROUNDS rounds per timed row count; the rounds interleave
    the row counts, so a burst of load slows one round of each, not every round of one."""
    best = {rows: dict.fromkeys(target.candidates, float("inf")) for rows in timed}
    for _ in range(ROUNDS):
        for rows in timed:
            for name, ms in timer(target, rows).items():
                best[rows][name] = min(best[rows][name], ms)
    return best


def measured(target: ChoiceInputs, timer: Timer) -> OpChoice:
    """The layout a request (request_weights) costs least on, the rules' unless another
    beats it by MARGIN; then per row count the fastest candidate reading it (the rules'
    path and dtype unless another beats it by MARGIN)."""
    timed_rows = {r: min(r, MAX_TIMED_ROWS) for r in target.rows}
    samples = sampled_ms(target, timer, sorted(set(timed_rows.values())))
    ms = {r: samples[timed_rows[r]] for r in target.rows}
    readers = {layout: [c for c in target.candidates if split(c)[1] == layout]
               for layout in LAYOUTS}
    weights = request_weights(target)

    def cost(layout: WeightLayout) -> float:
        return sum(weights[r] * min(ms[r][c] for c in readers[layout]) * r / timed_rows[r]
                   for r in target.rows)

    costs = {layout: cost(layout) for layout in readers if readers[layout]}
    default = rule_layout(target)
    layout = min(costs, key=lambda name: (costs[name], name != default))
    if default in costs and costs[layout] > costs[default] * (1 - MARGIN):
        layout = default
    compute = target.numerics.compute
    rows = []
    for r in target.rows:
        preferred = candidate(rule_path(target, layout, r), layout, compute)
        path, _, dtype = split(_fastest(ms[r], readers[layout], preferred))
        rows.append(RowChoice(rows=r, path=path, compute=COMPUTE_DTYPE_NAMES[dtype],
                              timed_rows=timed_rows[r], ms=_rounded(ms[r])))
    return OpChoice(layout=layout, rows=rows, chosen_by=MEASURE)


def _fastest(ms: dict[str, float], candidates: list[str], preferred: str) -> str:
    fastest = min(candidates, key=lambda c: ms[c])
    if preferred in candidates and ms[fastest] > ms[preferred] * (1 - MARGIN):
        return preferred
    return fastest


def _rounded(ms: dict[str, float]) -> dict[str, float]:
    return {name: round(value, 3) for name, value in ms.items()}


def projection_shapes(target: ChoiceInputs, rows: int) -> list[tuple[tuple[int, int], int]]:
    """([N, K], how many per step) of every matrix a step multiplies by at `rows` rows: the
    fused projections once per layer, the LM head at token generation's rows (a context
    graph applies it to one row per prompt)."""
    args = target.args
    h, q = args.hidden_size, args.num_heads * args.head_dim
    kv = args.num_kv_heads * args.head_dim
    layers = args.num_layers
    shapes = [((q + 2 * kv, h), layers), ((h, q), layers),
              ((2 * args.intermediate_size, h), layers), ((h, args.intermediate_size), layers)]
    if rows == min(target.batch_size, MAX_TIMED_ROWS):
        shapes.append(((args.vocab_size, h), 1))
    return shapes


def step_ms(target: ChoiceInputs, rows: int) -> dict[str, float]:
    """One round: milliseconds one step's projections take by each candidate at `rows` rows
    (eagerly, on random weights in the artifact's storage dtype). The candidates take turns
    every call, so a burst of load elsewhere slows them alike."""
    total: dict[str, float] = dict.fromkeys(target.candidates, 0.0)
    with torch.no_grad():
        for shape, count in projection_shapes(target, rows):
            calls: dict[str, Callable[[], Any]] = {
                name: _call(target, name, shape, rows) for name in target.candidates}
            for path, ms in _time_ms(calls).items():
                total[path] += count * ms
    return total


def _call(
    target: ChoiceInputs, name: str, shape: tuple[int, int], rows: int
) -> Callable[[], torch.Tensor]:
    path, layout, compute = split(name)
    numerics = target.numerics
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=generator)
    scale = None
    if numerics.quantized:
        weight, scale = quantize(weight, per_channel=True)
    else:
        weight = weight.to(numerics.storage)
    x = torch.randn(rows, shape[1], generator=generator).to(compute)
    if path == KERNEL:
        kernel.load()
        laid_out = kernel.block(weight) if layout == BLOCKED else weight
        return lambda: kernel.linear(x, laid_out, None, scale)
    if path == ONEDNN:
        packed = pack_weight(weight, target.batch_size)
        return lambda: packed_linear(x, packed)
    linear = linear_for(ATEN, numerics.quantized, rows == target.batch_size)
    return lambda: linear(x, weight, None, scale)


def _time_ms(calls: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """Each call's fastest of REPS runs, after a warm-up (first-touch pages, oneDNN's
    primitive cache, OpenMP's threads)."""
    best = dict.fromkeys(calls, float("inf"))
    for call in calls.values():
        call()
    for _ in range(REPS):
        for path, call in calls.items():
            start = time.perf_counter()
            call()
            best[path] = min(best[path], time.perf_counter() - start)
    return {path: seconds * 1000 for path, seconds in best.items()}
