"""The matmuls a graph's projections run by, one per op-choice path (opchoice.py).

Each takes (x, weight, bias, scale) and returns x @ weight.T in x's dtype, whatever dtype
the weight is stored in: `linear` (aten, plain weights), `packed_linear` (oneDNN on
prepacked weights), `gemv` (inductor's fused reduction, compiled graphs only),
`int8_linear` (aten's int8 kernel for token generation) and neuronctl's own kernel.linear
(blocked weights). `linear_for` maps a path to its function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from neuronctl.backends.torch import internals, kernel
from neuronctl.backends.torch.config import ModelArgs
from neuronctl.backends.torch.layout import graph_shapes, is_matrix

Linear = Callable[..., Tensor]


def linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, scale: Tensor | None = None
) -> Tensor:
    """x @ weight.T in x's dtype: a narrower (bf16, int8) weight is widened for the matmul.

    Widening per matmul is what a host without bf16 units needs for context encoding and
    larger batches: aten's emulated bf16 GEMM is several times slower than widening the
    weight and running the float32 GEMM. An int8 weight's scale applies to the output.
    """
    out = torch.nn.functional.linear(x, weight.to(x.dtype))
    if scale is not None:
        out = out * scale.to(x.dtype)
    return out if bias is None else out + bias.to(x.dtype)


def packed_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, scale: Tensor | None = None
) -> Tensor:
    """linear() by oneDNN on a weight the runner prepacked (`pack_weight`) at load time.

    For token-generation batches above the GEMV's range: aten's GEMM re-reads a plain
    [out, in] weight in a layout that is slow for a few rows (bf16 batch 8: 1.7x slower than
    oneDNN on its own blocked layout; fp32: ~3x). The graph is traced with plain tensors of
    the same shape; at run time the weight inputs are oneDNN tensors, so the graph file still
    holds no weight and a fine-tune reuses it. Only for AOTInductor graphs (graphs.py lowers
    this op to oneDNN's kernel without requiring the weight to be a constant).
    """
    assert scale is None, "quantized artifacts never pack weights"
    return internals.onednn_linear(x, weight, bias)


def pack_weight(weight: Tensor, batch_size: int) -> Tensor:
    """The oneDNN blocked layout packed_linear reads, chosen for `batch_size` rows."""
    return internals.onednn_pack(weight, batch_size)


def packed_names(args: ModelArgs) -> list[str]:
    """The graph weights packed_linear reads (every projection and the LM head)."""
    return [n for n in graph_shapes(args, torch.float32, packed=True) if is_matrix(n)]


def can_pack(dtype: torch.dtype) -> bool:
    """oneDNN runs this dtype's linear natively on this host."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and internals.onednn_bf16()


def gemv(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, scale: Tensor | None = None
) -> Tensor:
    """linear() for a handful of rows, written so inductor emits one fused reduction.

    aten's bf16/fp32 GEMV reads weights at about half this machine's bandwidth (one thread
    per matrix); inductor turns this into a kernel parallel over output rows that streams the
    weight once at full bandwidth. Products are accumulated in float32. Only for compiled
    graphs: run eagerly it would materialise rows x weight. A bf16 or int8 weight is widened
    inside the kernel as it streams (float32 activations), so it is read at its own width.
    """
    out = (x[..., None, :] * weight).sum(-1, dtype=torch.float32)
    if scale is not None:
        out = out * scale
    out = out.to(x.dtype)
    return out if bias is None else out + bias.to(x.dtype)


def int8_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, scale: Tensor | None = None
) -> Tensor:
    """linear() on an int8 weight by aten's weight-only int8 kernel, for token generation.

    The kernel widens int8 weights as it streams them and accumulates in float32; it is
    vectorized for bf16 activations (float32 ones take a scalar path ~10x slower), so the
    activations are rounded to bf16 for the product and the result widened back. Inductor's
    own code for the same product loads int8 8 lanes at a time through a bounce buffer
    (7x slower than its bf16 kernel on an AVX2 host).
    """
    assert scale is not None, "an int8 weight needs its scale"
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    # The scale must be a graph input as is: inductor's lowering of this op does not
    # materialise a computed one.
    out = internals.int8_weight_mm(rows, weight, scale)
    out = out.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)
    return out if bias is None else out + bias.to(x.dtype)


def linear_for(path: str, quantized: bool, token_generation: bool) -> Linear:
    """The matmul of an op-choice path (opchoice.py): kernel (blocked or, with linear_rows,
    plain weights), onednn (packed), gemv, aten (int8 token generation by int8_linear)."""
    if path == "kernel":
        return kernel.linear
    if path == "onednn":
        return packed_linear
    if path == "gemv":
        return gemv
    return int8_linear if quantized and token_generation else linear
