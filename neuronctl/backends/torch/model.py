"""The Llama-family model in plain PyTorch with static shapes (gpt-fast style, functional).

Every function takes the weights as a dict of tensors (layout.graph_sources names) instead
of owning parameters, so `torch.export` sees them as graph inputs: the compiled graphs carry
no weights and one graph serves every checkpoint of the same architecture. Its parts live
beside it: config.py (ModelArgs, Numerics), layout.py (the tensors and the KV cache),
linear.py (the matmuls), attention.py (rope and attention).

The two entry points mirror Neuron's two graphs, over the KV cache's Neuron layout (one
contiguous block per sequence, layout.new_kv_cache):

- `context_encode`: one prompt padded to a context bucket, written into one slot; returns the
  logits of the last real position.
- `token_generate`: every slot advances by one token at its own position; attention reads the
  first `bucket` positions of each slot, masked per slot; returns logits [batch, vocab].

Both update the cache in place (index_put_), which torch.export and AOTInductor keep as a
mutation of the caller's tensors, so no cache is ever copied.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from neuronctl.backends.torch import kernel
from neuronctl.backends.torch.attention import (
    Attend,
    apply_rope,
    cache_attention,
    masked_attention,
    rope_tables,
)
from neuronctl.backends.torch.config import ModelArgs, Numerics
from neuronctl.backends.torch.layout import scale_name
from neuronctl.backends.torch.linear import Linear, linear

Weights = Mapping[str, Tensor]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # float32 statistics, then back to the activation dtype, as transformers does.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _proj(
    linear: Linear, w: Weights, name: str, x: Tensor, bias: Tensor | None = None
) -> Tensor:
    """One projection; an int8 artifact passes the weight's per-channel scale along."""
    return linear(x, w[name], bias, w.get(scale_name(name)))


def _project_qkv(
    w: Weights, p: str, h: Tensor, args: ModelArgs, linear: Linear = linear
) -> tuple[Tensor, Tensor, Tensor]:
    b, t, _ = h.shape
    bias = w[p + "qkv_proj.bias"] if args.qkv_bias else None
    kv = args.num_kv_heads * args.head_dim
    qkv = _proj(linear, w, p + "qkv_proj.weight", h, bias)
    q, k, v = qkv.split([args.num_heads * args.head_dim, kv, kv], dim=-1)
    q = q.view(b, t, args.num_heads, args.head_dim).transpose(1, 2)
    k = k.view(b, t, args.num_kv_heads, args.head_dim).transpose(1, 2)
    v = v.view(b, t, args.num_kv_heads, args.head_dim).transpose(1, 2)
    return q, k, v


def _mlp(w: Weights, p: str, x: Tensor, linear: Linear = linear) -> Tensor:
    gate, up = _proj(linear, w, p + "gate_up_proj.weight", x).chunk(2, dim=-1)
    return _proj(linear, w, p + "down_proj.weight", torch.nn.functional.silu(gate) * up)


def _embed(w: Weights, token_ids: Tensor, dtype: torch.dtype) -> Tensor:
    """Embedding rows in the compute dtype; an int8 (tied) table is scaled per row."""
    name = "model.embed_tokens.weight"
    if name in w:
        x = w[name][token_ids].to(dtype)
    else:  # a tied table held only as the blocked head (graph_weights)
        name = "lm_head.weight"
        rows = w[name][token_ids // kernel.ROWS, :, token_ids % kernel.ROWS]  # [..., K/16, 16]
        x = rows.flatten(-2).to(dtype)
    scale = w.get(scale_name(name))
    return x if scale is None else x * scale[token_ids][..., None].to(dtype)


def _lm_head(w: Weights, x: Tensor, args: ModelArgs, linear: Linear = linear) -> Tensor:
    x = rms_norm(x, w["model.norm.weight"], args.rms_norm_eps)
    # A packed artifact passes its tied head as lm_head.weight too (graph_weights).
    head = "lm_head.weight" if "lm_head.weight" in w else "model.embed_tokens.weight"
    return _proj(linear, w, head, x).float()


def _layer(
    args: ModelArgs, w: Weights, i: int, x: Tensor, rope: tuple[Tensor, Tensor],
    write_kv: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]], attend: Attend, linear: Linear,
) -> Tensor:
    """One decoder layer; `write_kv` stores this step's K/V and returns what to attend to."""
    p = f"model.layers.{i}."
    h = rms_norm(x, w[p + "input_layernorm.weight"], args.rms_norm_eps)
    q, k, v = _project_qkv(w, p + "self_attn.", h, args, linear)
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    keys, values = write_kv(k, v)
    o = attend(q, keys, values)
    x = x + _proj(linear, w, p + "self_attn.o_proj.weight", o, _o_bias(w, p, args))
    h = rms_norm(x, w[p + "post_attention_layernorm.weight"], args.rms_norm_eps)
    return x + _mlp(w, p + "mlp.", h, linear)


def context_encode(
    args: ModelArgs,
    w: Weights,
    freq: Tensor,
    k_cache: list[Tensor],
    v_cache: list[Tensor],
    token_ids: Tensor,
    lengths: Tensor,
    slots: Tensor,
    linear: Linear = linear,
    compute: torch.dtype | None = None,
) -> Tensor:
    """token_ids [P, bucket] (right-padded), lengths [P], slots [P] -> logits [P, vocab] fp32.

    P prompts in one call, each written into its own slot (a padding row repeats a real
    one: same slot, same values). `linear` may be `packed_linear` in compiled graphs (see
    packed_linear); `compute` is the activations' dtype (default: the cache's).
    """
    prompts, bucket = token_ids.shape
    positions = torch.arange(bucket, device=token_ids.device)
    x = _embed(w, token_ids, compute or k_cache[0].dtype)
    rope = rope_tables(freq, positions[None], x.dtype)
    causal = (positions[None, :] <= positions[:, None])[None]  # [1, T, T]
    attend = masked_attention(causal, args)
    rows, cols = slots[:, None], positions[None, :]

    for i in range(args.num_layers):
        def write_kv(k: Tensor, v: Tensor, i: int = i) -> tuple[Tensor, Tensor]:
            # cache[slot, :, 0:bucket] = k per prompt; padded positions hold garbage that
            # decode masks out. The [P, T] index puts heads last: values are [P, T, H, D].
            k_cache[i][rows, :, cols] = k.transpose(1, 2).to(k_cache[i].dtype)
            v_cache[i][rows, :, cols] = v.transpose(1, 2).to(v_cache[i].dtype)
            return k, v

        x = _layer(args, w, i, x, rope, write_kv, attend, linear)
    last = x[torch.arange(prompts, device=x.device), lengths - 1]  # [P, hidden]
    return _lm_head(w, last, args, linear)


def token_generate(
    args: ModelArgs,
    w: Weights,
    freq: Tensor,
    k_cache: list[Tensor],
    v_cache: list[Tensor],
    token_ids: Tensor,
    positions: Tensor,
    bucket: int,
    linear: Linear = linear,
    compute: torch.dtype | None = None,
    fused_attention: bool = False,
) -> Tensor:
    """token_ids [B], positions [B] (-1 = idle slot) -> logits [B, vocab] float32.

    `linear` may be `gemv` for small batches or `packed_linear` for larger ones in compiled
    graphs (see both); `compute` is the activations' dtype (default: the cache's).
    `fused_attention` attends by neuronctl's own op (kernel.attention) where it fits the
    shapes and cache dtype.
    """
    batch = token_ids.shape[0]
    seq_len = k_cache[0].shape[2]
    # An idle slot writes into its own last position, which any live sequence overwrites
    # before it attends to it; position 0 would clobber a prompt prefilled in that slot.
    write_at = torch.where(positions < 0, seq_len - 1, positions)
    live = positions.clamp(min=0)
    slots = torch.arange(batch, device=token_ids.device)
    x = _embed(w, token_ids[:, None], compute or k_cache[0].dtype)
    rope = rope_tables(freq, live[:, None], x.dtype)
    if fused_attention and kernel.attention_fits(args.head_dim, k_cache[0].dtype):
        attend = cache_attention(live + 1)
    else:
        span = torch.arange(bucket, device=token_ids.device)
        attend = masked_attention((span[None, :] <= live[:, None])[:, None], args)  # [B,1,S]
    for i in range(args.num_layers):
        def write_kv(k: Tensor, v: Tensor, i: int = i) -> tuple[Tensor, Tensor]:
            k_cache[i][slots, :, write_at] = k[:, :, 0].to(k_cache[i].dtype)
            v_cache[i][slots, :, write_at] = v[:, :, 0].to(v_cache[i].dtype)
            return k_cache[i][:, :, :bucket], v_cache[i][:, :, :bucket]

        x = _layer(args, w, i, x, rope, write_kv, attend, linear)
    return _lm_head(w, x, args, linear)[:, 0]


def _o_bias(w: Weights, p: str, args: ModelArgs) -> Tensor | None:
    return w[p + "self_attn.o_proj.bias"] if args.o_bias else None


# --- exportable wrappers ---------------------------------------------------------------------


class ContextEncoding(torch.nn.Module):
    """Holds no tensors: weights, rope frequencies and the KV cache are all inputs.

    `linear` is the artifact's matmul at this graph's rows (linear_for)."""

    def __init__(self, args: ModelArgs, numerics: Numerics, linear: Linear = linear) -> None:
        super().__init__()
        self.args = args
        self.compute = numerics.compute
        self.linear = linear

    def forward(
        self,
        weights: dict[str, Tensor],
        freq: Tensor,
        k_cache: list[Tensor],
        v_cache: list[Tensor],
        token_ids: Tensor,
        lengths: Tensor,
        slots: Tensor,
    ) -> Tensor:
        return context_encode(
            self.args, weights, freq, k_cache, v_cache, token_ids, lengths, slots, self.linear,
            self.compute,
        )


class TokenGeneration(torch.nn.Module):
    def __init__(
        self, args: ModelArgs, bucket: int, numerics: Numerics, linear: Linear = linear,
        fused_attention: bool = False,
    ) -> None:
        super().__init__()
        self.args = args
        self.bucket = bucket
        self.compute = numerics.compute
        self.linear = linear
        self.fused_attention = fused_attention

    def forward(
        self,
        weights: dict[str, Tensor],
        freq: Tensor,
        k_cache: list[Tensor],
        v_cache: list[Tensor],
        token_ids: Tensor,
        positions: Tensor,
    ) -> Tensor:
        return token_generate(
            self.args, weights, freq, k_cache, v_cache, token_ids, positions, self.bucket,
            self.linear, self.compute, self.fused_attention,
        )
