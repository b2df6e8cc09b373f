"""Rotary position embedding and grouped-query attention over the KV cache.

`inv_freq` reads the rope type and its parameters (config.rope_parameters) as transformers
computes them. Graphs attend by an `Attend` function: masked batched matmuls (`attention`)
or, for token generation where it fits, neuronctl's own op (kernel.attention), which reads
the cache as stored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from neuronctl.backends.torch import kernel
from neuronctl.backends.torch.config import ModelArgs

Attend = Callable[[Tensor, Tensor, Tensor], Tensor]  # (q, keys, values) -> [B, T, Hq*D]


def inv_freq(args: ModelArgs) -> Tensor:
    """RoPE inverse frequencies in float32, as transformers computes them."""
    rope, dim = args.rope, args.head_dim
    base = float(rope["rope_theta"])
    freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope["rope_type"] == "linear":
        return freq / float(rope["factor"])
    if rope["rope_type"] == "llama3":
        return _llama3_scaling(freq, rope)
    return freq


def _llama3_scaling(freq: Tensor, rope: Mapping[str, Any]) -> Tensor:
    factor = float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old_len = float(rope["original_max_position_embeddings"])
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > old_len / low, freq / factor, freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_tables(freq: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin of shape [B, 1, T, head_dim] for integer positions [B, T]."""
    angles = positions[..., None].float() * freq
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, args: ModelArgs) -> Tensor:
    """Grouped-query attention without repeating K/V.

    q [B, Hq, T, D]; k, v [B, Hkv, S, D] (widened to q's dtype if the cache is narrower);
    mask [B, T, S] bool (True = attend). -> [B, T, Hq*D]
    """
    b, _, t, d = q.shape
    g, s = args.group_size, k.shape[2]
    k, v = k.to(q.dtype), v.to(q.dtype)
    # Query heads h*g .. h*g+g-1 share KV head h: fold the group into the query rows.
    qg = q.reshape(b, args.num_kv_heads, g * t, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * (d**-0.5)
    scores = scores.view(b, args.num_kv_heads, g, t, s)
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.matmul(probs.view(b, args.num_kv_heads, g * t, s), v)
    return out.view(b, args.num_heads, t, d).transpose(1, 2).reshape(b, t, args.num_heads * d)


def masked_attention(mask: Tensor, args: ModelArgs) -> Attend:
    return lambda q, k, v: attention(q, k, v, mask, args)


def cache_attention(lengths: Tensor) -> Attend:
    """Token generation by neuronctl's op: one new token per row, its first lengths[b]
    positions of the cache read as stored (no widened copy, no mask)."""
    return lambda q, k, v: kernel.attention(q, k, v, lengths)
