"""neuronctl's CPU ops (kernel.py: gemv.cpp, attention.cpp): numerics, layout, choice.

The kernel is built on first use (~15 s, then cached per source digest); the modeling tests
run it eagerly, so they need no AOTInductor compile.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from neuronctl.backends.torch import kernel
from neuronctl.backends.torch.attention import attention, inv_freq
from neuronctl.backends.torch.config import ModelArgs, args_from_config
from neuronctl.backends.torch.graphs import (
    CONTEXT,
    TOKEN_GEN,
    GraphJob,
    example_inputs,
    module_for,
)
from neuronctl.backends.torch.host import cpu_flags, kernel_runs_on
from neuronctl.backends.torch.layout import (
    blockable,
    expected_shapes,
    graph_weights,
    is_matrix,
    new_kv_cache,
    quantized_names,
    scale_name,
)
from neuronctl.backends.torch.model import context_encode, token_generate
from neuronctl.backends.torch.quantize import quantize
from neuronctl.backends.torch.runner import _load_kernel, _load_weights
from neuronctl.errors import CheckpointError, NotFoundError
from tests.helpers import make_checkpoint, read_config

Scale = torch.Tensor | None  # int8 weights' one scale per output row

pytestmark = [
    pytest.mark.skipif(not kernel_runs_on(cpu_flags()),
                       reason="the kernel needs an x86-64 CPU with AVX2 and FMA"),
    pytest.mark.skipif(not any(shutil.which(c) for c in ("c++", "g++", "clang++")),
                       reason="building the kernel needs a C++ compiler"),
]


@pytest.fixture(scope="module", autouse=True)
def built(request: pytest.FixtureRequest) -> None:
    """The library, built once per source digest and torch version into pytest's own cache
    folder (.pytest_cache, never the user's cache), so that only the first run of a clone
    pays for the compiler: the build itself is tested in test_faults.py and below."""
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    saved = os.environ.get("XDG_CACHE_HOME")
    if cache is not None:
        os.environ["XDG_CACHE_HOME"] = str(cache.mkdir("neuronctl-kernel"))
    try:
        kernel.load()
    finally:
        if saved is None:
            os.environ.pop("XDG_CACHE_HOME", None)
        else:
            os.environ["XDG_CACHE_HOME"] = saved


def reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return out if scale is None else out * scale.double()


def as_int16(x: torch.Tensor) -> torch.Tensor:
    """What the kernel multiplies int8 weights by: each row rounded at 32767 / its largest
    magnitude (float32 arithmetic, ties to even), back in float64."""
    most = x.abs().amax(-1, keepdim=True)
    inv = torch.where(most > 0, torch.tensor(32767.0) / most, torch.tensor(0.0))
    return torch.round(x * inv).double() * (most / 32767).double()


LAYOUTS = {"blocked": kernel.block, "plain": lambda w: w}  # linear_blocked, linear_rows
DTYPES = [torch.float32, torch.bfloat16, torch.int8]
ROWS = [1, 2, 3, 4, 5, 7, 64]  # 1; 2; threes and a remainder of 1 or 2; a context bucket


def weights(n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, Scale]:
    """A random [N, K] weight in dtype (int8: all of its range) and, for int8, bf16 scales."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 40).clamp(-127, 127).to(dtype)
    scale = torch.rand(n, generator=gen).to(torch.bfloat16) if dtype == torch.int8 else None
    return w, scale


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_is_the_float32_product(
    layout: str, dtype: torch.dtype, rows: int, with_bias: bool
) -> None:
    """kernel.linear on either layout against a float64 reference, element by element.

    Every row count takes a different path. Leading dimensions are kept, as the graphs pass
    [B, T, K]. The bound: bf16 and int8 weights widen to float32 exactly, so the kernel
    computes the float32 dot product of x (int8: x rounded to int16 as `as_int16` models, its
    products summed exactly in int32) and w. Each output sums K products in 8 lanes, each lane
    in order by FMA, then adds the 8 lanes: fewer than K + 3 roundings of a partial sum, so
    the error is at most (K + 3) u sum|x||w|, u = 2^-24 (the bound for recursive summation,
    Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., section 3.1). int8 adds
    three roundings (the int32 sum to float, the activation and the weight scale); the bias
    one more, of the result."""
    n, k = 52, 96
    w, scale = weights(n, k, dtype, seed=rows)
    gen = torch.Generator().manual_seed(rows + 1)
    x = torch.randn(rows, 1, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    got = kernel.linear(x, LAYOUTS[layout](w), bias, scale)
    xs = as_int16(x) if dtype == torch.int8 else x.double()
    s = torch.ones(n, dtype=torch.float64) if scale is None else scale.double()
    want = reference(xs, w.float(), None) * s + (0 if bias is None else bias.double())
    u = 2.0**-24
    bound = (k + 6) * u * (xs.abs() @ w.double().abs().T) * s + u * want.abs()
    assert got.shape == (rows, 1, n) and got.dtype == torch.float32
    assert ((got.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_both_layouts_give_the_same_bits(dtype: torch.dtype, rows: int) -> None:
    # One code over two layouts: the same products summed in the same order, so equal to the
    # bit. K = 2096 is 131 chunks: an odd count (one int8 row goes two a step) and a second
    # span of int8 sums.
    w, scale = weights(36, 2096, dtype, seed=rows)
    x = torch.randn(rows, 2096, generator=torch.Generator().manual_seed(rows))
    blocked = torch.ops.neuronctl.linear_blocked(x, kernel.block(w), scale)
    assert torch.equal(torch.ops.neuronctl.linear_rows(x, w, scale), blocked)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("k", [16, 112, 2096])
def test_one_int8_row_takes_any_count_of_chunks(layout: str, k: int) -> None:
    # One row goes two 16-column chunks a step: a lone chunk, an odd count (7), and a
    # second span of sums (128 chunks, then 3) must all land exactly where the model says.
    gen = torch.Generator().manual_seed(k)
    w = (torch.randn(12, k, generator=gen) * 40).clamp(-127, 127).to(torch.int8)
    x = torch.randn(1, k, generator=gen)
    got = kernel.linear(x, LAYOUTS[layout](w)).double()
    want = reference(as_int16(x), w.float(), None)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_int8_products_stay_within_the_int16_rounding_of_the_activations() -> None:
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(36, 160, generator=gen) * 40).clamp(-127, 127).to(torch.int8)
    x = torch.randn(5, 160, generator=gen)
    got = torch.ops.neuronctl.linear_blocked(x, kernel.block(w), None).double()
    # Each activation moves by at most half a step, max|x| / 65534, from its int16 value.
    bound = w.double().abs().sum(1) * x.abs().amax(1, keepdim=True).double() / 65534
    assert ((got - reference(x, w, None)).abs() <= bound * 1.001 + 1e-4).all()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("value", [127, -128])
@pytest.mark.parametrize("rows", [1, 2])
def test_int8_sums_do_not_overflow_on_long_rows(layout: str, value: int, rows: int) -> None:
    # 8208 columns (four spans of 128 chunks and one more) of extreme weights by activations
    # at 32767: 2^32 in one int32 lane had the sums not moved into float on the way. One
    # row and several take different loops.
    w = torch.full((4, 8208), value, dtype=torch.int8)
    got = kernel.linear(torch.ones(rows, 8208), LAYOUTS[layout](w))
    assert torch.equal(got, torch.full((rows, 4), float(value * 8208)))


def test_int8_takes_rows_of_zeros() -> None:
    w = kernel.block(torch.ones(4, 32, dtype=torch.int8))
    x = torch.zeros(2, 32)
    x[1] = 1.0
    got = torch.ops.neuronctl.linear_blocked(x, w, None)
    assert torch.equal(got, torch.tensor([[0.0] * 4, [32.0] * 4]))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_linear_adds_bias_and_returns_the_activations_dtype(layout: str) -> None:
    w = torch.randn(8, 32).to(torch.bfloat16)
    x, bias = torch.randn(2, 32), torch.randn(8)
    got = kernel.linear(x, LAYOUTS[layout](w), bias)
    assert torch.allclose(got, x @ w.float().T + bias, atol=1e-5)
    assert kernel.linear(x.bfloat16(), LAYOUTS[layout](w)).dtype == torch.bfloat16


def test_kernel_refuses_what_it_cannot_multiply() -> None:
    w = kernel.block(torch.randn(8, 32))
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.neuronctl.linear_blocked(torch.randn(1, 48), w, None)
    with pytest.raises(RuntimeError, match="not blocked"):
        torch.ops.neuronctl.linear_blocked(torch.randn(1, 32), torch.randn(8, 32), None)
    with pytest.raises(RuntimeError, match="float32 activations"):
        torch.ops.neuronctl.linear_blocked(torch.randn(1, 32).bfloat16(), w, None)


@pytest.mark.parametrize(("x", "w", "scale", "message"), [
    (torch.randn(1, 48), torch.randn(8, 32), None, "activations have 48 columns, weights 32"),
    (torch.randn(1, 32), torch.randn(6, 32), None, r"\[6, 32\] weight does not fit.* of 4 "),
    (torch.randn(1, 40), torch.randn(8, 40), None, r"\[8, 40\] weight does not fit.*K of 16"),
    (torch.randn(1, 32), torch.randn(2, 4, 32), None, r"not a contiguous \[N, K\] matrix"),
    (torch.randn(1, 32), torch.randn(32, 8).T, None, "not contiguous"),
    (torch.randn(1, 32), torch.randn(8, 32).double(), None, "float32, bfloat16 or int8"),
    (torch.randn(1, 32).bfloat16(), torch.randn(8, 32), None, "float32 activations"),
    (torch.randn(1, 32), torch.ones(8, 32, dtype=torch.int8), torch.ones(4), "one scale per"),
])
def test_linear_rows_refuses_what_it_cannot_multiply(
    x: torch.Tensor, w: torch.Tensor, scale: Scale, message: str
) -> None:
    with pytest.raises(RuntimeError, match=message) as raised:
        torch.ops.neuronctl.linear_rows(x, w, scale)
    assert "linear_rows" in str(raised.value)


def _attention_args(heads: int, kv_heads: int, head_dim: int) -> ModelArgs:
    return ModelArgs("LlamaForCausalLM", 64, heads * head_dim, 64, 1, heads, kv_heads,
                              head_dim, 1e-5, {}, False, False, False, None, None)


@pytest.mark.parametrize("cache", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("batch", "heads", "kv_heads", "head_dim"), [
    (1, 9, 3, 64),  # SmolLM2's grouping: three query heads a KV head
    (3, 32, 8, 64),  # Llama 3's, rows at different lengths
    (2, 4, 4, 128),  # no grouping
    (1, 6, 1, 16),  # one KV head for all
    (2, 10, 2, 80),  # five query heads a KV head: a pass of four and a pass of one
])
def test_attend_is_masked_attention_over_the_cache(
    cache: torch.dtype, batch: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    # The op reads the bucket's view of a longer cache (strided, as the graphs pass it) and
    # row b's first lengths[b] positions; the reference masks the rest out.
    gen = torch.Generator().manual_seed(batch * heads + head_dim)
    seq_len, bucket = 96, 40
    q = torch.randn(batch, heads, 1, head_dim, generator=gen) * 3
    k_cache = (torch.randn(batch, kv_heads, seq_len, head_dim, generator=gen) * 2).to(cache)
    v_cache = torch.randn(batch, kv_heads, seq_len, head_dim, generator=gen).to(cache)
    k, v = k_cache[:, :, :bucket], v_cache[:, :, :bucket]
    live = torch.tensor([0, bucket - 1, 17][:batch])  # 1, the whole bucket, some
    mask = (torch.arange(bucket)[None, :] <= live[:, None])[:, None]
    want = attention(q, k, v, mask, _attention_args(heads, kv_heads, head_dim))
    got = kernel.attention(q, k, v, live + 1)
    assert got.shape == want.shape == (batch, 1, heads * head_dim)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("threads", [1, 2, 8])
def test_attend_splits_long_rows_across_threads_without_changing_the_result(threads: int) -> None:
    # Few (row, KV head) items get their positions cut into parts, one softmax each, put
    # together by their largest scores: 2 threads cut 100 positions in 4, 8 threads in 6.
    gen = torch.Generator().manual_seed(threads)
    q = torch.randn(1, 4, 1, 32, generator=gen) * 4
    k = torch.randn(1, 1, 128, 32, generator=gen).bfloat16()
    v = torch.randn(1, 1, 128, 32, generator=gen).bfloat16()
    mask = (torch.arange(128) < 100)[None, None, None]
    want = attention(q, k, v, mask, _attention_args(4, 1, 32))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernel.attention(q, k, v, torch.tensor([100]))
    finally:
        torch.set_num_threads(before)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_attend_keeps_the_softmax_finite_at_extreme_scores() -> None:
    # Scores thousands apart: one position takes all the weight, the others underflow to 0
    # (the op's exp is taken at -87 below that), nothing is NaN.
    q = torch.zeros(1, 2, 1, 16)
    q[..., 0] = 100.0
    k = torch.zeros(1, 1, 24, 16)
    k[0, 0, :, 0] = torch.linspace(-100, 100, 24)
    v = torch.arange(24 * 16, dtype=torch.float32).reshape(1, 1, 24, 16)
    got = kernel.attention(q, k, v, torch.tensor([24]))
    assert torch.isfinite(got).all()
    assert torch.equal(got, v[0, 0, 23].repeat(2)[None, None])


def test_attend_refuses_what_it_cannot_read() -> None:
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 8, 16)
    for length in (0, 9):
        with pytest.raises(RuntimeError, match="outside 1..8"):
            torch.ops.neuronctl.attend(q, k, k, torch.tensor([length]))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.neuronctl.attend(q, k.half(), k.half(), torch.tensor([8]))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.neuronctl.attend(torch.randn(1, 4, 1, 24), torch.randn(1, 2, 8, 24),
                                   torch.randn(1, 2, 8, 24), torch.tensor([8]))
    with pytest.raises(RuntimeError, match="float32 queries"):
        torch.ops.neuronctl.attend(q.bfloat16(), k, k, torch.tensor([8]))
    assert kernel.attention_fits(64, torch.bfloat16)
    assert not kernel.attention_fits(64, torch.float16) and not kernel.attention_fits(24,
                                                                                     torch.float32)


@pytest.mark.parametrize(("quantized", "tied", "cache"), [
    (False, True, torch.float32), (True, True, torch.float32), (True, False, torch.float32),
    (False, True, torch.bfloat16),
])
def test_blocked_graphs_compute_what_plain_ones_do(
    tmp_path: Path, quantized: bool, tied: bool, cache: torch.dtype
) -> None:
    # The modeling code run eagerly with kernel.linear on blocked weights and token
    # generation attending by kernel.attention, against the plain weights' linear.linear
    # and masked attention: context encoding, then decode steps (one slot idle). A tied table
    # is held only as the blocked head; the embedding reads its rows out of it.
    config = read_config(make_checkpoint(tmp_path / "ckpt", "llama", tie_word_embeddings=tied))
    args = args_from_config(config)
    assert blockable(args)
    gen = torch.Generator().manual_seed(3)
    shapes = expected_shapes(args)
    full = {n: torch.randn(s, generator=gen) * 0.1 for n, s in shapes.items()}
    if quantized:
        for name in quantized_names(args):
            full[name], full[scale_name(name)] = quantize(full[name], True)
    plain = graph_weights(full, args, quantized=quantized)
    blocked = graph_weights(full, args, quantized=quantized, blocked=True)
    assert ("model.embed_tokens.weight" in blocked) != tied
    assert blocked["lm_head.weight"].dim() == 4
    ids = torch.randint(0, args.vocab_size, (1, 12), generator=gen)
    outs = []
    for weights, linear, fused in ((plain, _dequantizing_linear, False),
                                   (blocked, kernel.linear, True)):
        k, v = new_kv_cache(args, 2, 32, cache)
        freq = inv_freq(args)
        logits = [context_encode(args, weights, freq, k, v, ids, torch.tensor([12]),
                                          torch.tensor([1]), linear, torch.float32)]
        for pos in range(12, 16):
            step = token_generate(args, weights, freq, k, v, torch.tensor([0, pos % 7]),
                                           torch.tensor([-1, pos]), 32, linear, torch.float32,
                                           fused_attention=fused)
            logits.append(step[1:])
        outs.append(torch.cat(logits))
    assert (outs[0] - outs[1]).abs().max() < 1e-4


def _dequantizing_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         scale: torch.Tensor | None = None) -> torch.Tensor:
    out = x @ weight.float().T
    if scale is not None:
        out = out * scale.float()
    return out if bias is None else out + bias


def test_blocked_token_generation_graphs_call_attend_once_a_layer(tmp_path: Path) -> None:
    config = read_config(make_checkpoint(tmp_path / "ckpt", "llama"))
    layers = args_from_config(config).num_layers
    for kind, calls in ((TOKEN_GEN, layers), (CONTEXT, 0)):
        job = GraphJob(kind, 16, args_from_config(config), 2, 32, "bfloat16", "inductor",
                       str(tmp_path),
                       compute="float32", layout="blocked", carries_kernel=True, path="kernel")
        with torch.no_grad():
            program = torch.export.export(module_for(job), example_inputs(job), strict=False)
        targets = [node.target for node in program.graph.nodes]
        assert targets.count(torch.ops.neuronctl.attend.default) == calls


def test_runner_refuses_graphs_built_against_another_kernel_source(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="recompile"):
        _load_kernel("0123456789abcdef", tmp_path, {})
    with pytest.raises(NotFoundError, match="recompile"):  # no carried copy: never built here
        _load_kernel(kernel.digest(), tmp_path, {})


def test_serving_registers_the_artifacts_copy_and_compiles_nothing(tmp_path: Path) -> None:
    # A fresh process, as on a serving host: building is made to fail, and the op still runs
    # from the library the artifact carries.
    library = tmp_path / kernel.artifact_library()
    library.parent.mkdir()
    shutil.copyfile(kernel.load(), library)
    script = f"""
import torch, torch.utils.cpp_extension as ext
def no_compiler(*args, **kwargs):
    raise RuntimeError("the serving path compiled")
ext.load = no_compiler
from neuronctl.backends.torch import kernel
from neuronctl.backends.torch.runner import _load_kernel, _load_weights
from neuronctl.store.manifest import FileEntry, sha256_file
root = __import__("pathlib").Path({str(tmp_path)!r})
rel = kernel.artifact_library()
_load_kernel(kernel.digest(), root, {{rel: FileEntry(size=1, sha256=sha256_file(root / rel))}})
w = kernel.block(torch.ones(4, 16).bfloat16())
print(float(torch.ops.neuronctl.linear_blocked(torch.ones(1, 16), w, None).sum()))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "64.0"


def test_the_ninja_neuronctl_installs_is_found_off_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A PATH through a version manager's shims may not reach the env's own bin directory:
    # the build child gets that ninja on its PATH, and this process's PATH stays as it was.
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # nothing built: a build
    assert shutil.which("ninja") is None
    children: list[dict[str, str]] = []

    class Child:  # the build child as _build sees it: it exits 0 and leaves the library
        returncode = 0

        def __init__(self, argv: list[str], env: dict[str, str] | None = None, **_: object):
            children.append(dict(os.environ) if env is None else env)  # what it would get
            Path(argv[-2], f"{kernel.library_stem()}.so").write_bytes(b"")

        def communicate(self, timeout: float) -> tuple[str, str]:
            return "", ""

    monkeypatch.setattr(kernel.subprocess, "Popen", Child)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: None)
    kernel._build()
    assert len(children) == 1
    assert shutil.which("ninja", path=children[0]["PATH"]) is not None
    assert os.environ["PATH"] == str(tmp_path)


def _mapping_of(address: int) -> str:
    """The /proc/self/smaps entry of the mapping that holds `address`."""
    entries = re.split(r"^(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text(),
                       flags=re.M)
    for entry in entries[1:]:
        start, end = (int(x, 16) for x in entry.split(" ", 1)[0].split("-"))
        if start <= address < end:
            return entry
    raise AssertionError(f"no mapping holds {address:#x}")


def _thp_mode() -> str:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    text = path.read_text() if path.exists() else "[never]"
    return text[text.index("[") + 1:text.index("]")]


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux only")
def test_matrices_move_into_one_mapping_that_asks_for_huge_pages() -> None:
    torch.manual_seed(0)
    weights = {"a": kernel.block(torch.randn(64, 32)), "norm": torch.randn(32),
               "b": kernel.block(torch.randn(8, 48).bfloat16())}
    before = {name: tensor.clone() for name, tensor in weights.items()}
    kept = weights["norm"]
    kernel.into_huge_pages(weights, ["a", "b"])
    for name, tensor in before.items():
        assert weights[name].dtype == tensor.dtype and torch.equal(weights[name], tensor)
    assert weights["norm"] is kept  # only the named tensors move
    a, b = _mapping_of(weights["a"].data_ptr()), _mapping_of(weights["b"].data_ptr())
    assert a == b or a.split()[0] == b.split()[0]  # one mapping, not two
    assert weights["b"].data_ptr() % 64 == 0  # each matrix starts on a cache line
    if _thp_mode() != "never":  # the advice was taken ("hg"): 2 MiB pages where they fit
        assert " hg" in a.split("VmFlags:")[1], a


def test_a_blocked_runner_reads_its_matrices_from_the_weights_files_huge_page_mapping(
    tmp_path: Path,
) -> None:
    """The runner's weights are views of one private mapping of the artifact's weights
    file, advised for 2 MiB pages ("hg"); a blocked file holds kernel.block of each matrix."""
    from neuronctl.backends.torch.weights import GRAPH_WEIGHTS, write_graph_weights
    from neuronctl.checkpoints import open_checkpoint

    ckpt = open_checkpoint(str(make_checkpoint(tmp_path / "ckpt", "llama")))
    args = args_from_config(ckpt.config)
    for layout in ("plain", "blocked"):
        write_graph_weights(ckpt, args, torch.float32, False, layout == "blocked",
                            tmp_path / layout / GRAPH_WEIGHTS)
    plain = _load_weights(tmp_path / "plain", args, torch.float32)
    blocked = _load_weights(tmp_path / "blocked", args, torch.float32, blocked=True)
    matrices = [n for n in blocked if is_matrix(n)]
    assert matrices and all(blocked[n].dim() == 4 for n in matrices)
    mappings = {_mapping_of(blocked[n].data_ptr()) for n in blocked}
    assert len({m.split()[0] for m in mappings}) == 1
    entry = mappings.pop()
    assert entry.splitlines()[0].endswith(str(tmp_path / "blocked" / GRAPH_WEIGHTS))
    if _thp_mode() != "never":
        assert " hg" in entry.split("VmFlags:")[1]
    for name in matrices:
        assert torch.equal(blocked[name], kernel.block(plain[name]))
