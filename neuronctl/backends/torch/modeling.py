"""Llama-family modeling in plain PyTorch with static shapes (gpt-fast style, functional).

Every function takes the weights as a dict of tensors (Hugging Face names) instead of owning
parameters, so `torch.export` sees them as graph inputs: the compiled graphs carry no weights
and one graph serves every checkpoint of the same architecture.

The KV cache follows Neuron's layout: per layer one K and one V tensor of
[batch_size slots, kv_heads, seq_len, head_dim], one contiguous block per sequence. The two
entry points mirror Neuron's two graphs:

- `context_encode`: one prompt padded to a context bucket, written into one slot; returns the
  logits of the last real position.
- `token_generate`: every slot advances by one token at its own position; attention reads the
  first `bucket` positions of each slot, masked per slot; returns logits [batch, vocab].

Both update the cache in place (index_put_), which torch.export and AOTInductor keep as a
mutation of the caller's tensors, so no cache is ever copied.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from neuronctl.backends.torch import kernel
from neuronctl.errors import CheckpointError, SpecError

ARCHITECTURES = {
    "LlamaForCausalLM": "Llama 2/3/3.1/3.2 (default, linear and llama3 rope)",
    "MistralForCausalLM": "Mistral (sliding window only when >= seq_len)",
    "Qwen2ForCausalLM": "Qwen2/2.5 (qkv bias; sliding window only when >= seq_len)",
}
ROPE_TYPES = ("default", "linear", "llama3")
Weights = Mapping[str, Tensor]
Linear = Callable[..., Tensor]
Attend = Callable[[Tensor, Tensor, Tensor], Tensor]  # (q, keys, values) -> [B, T, Hq*D]


@dataclass(frozen=True)
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict[str, Any]  # rope_type, rope_theta and the type's own parameters
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    max_position_embeddings: int | None
    sliding_window: int | None  # the window that applies to some layer, None when none does

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class Numerics:
    """How an artifact stores its weights and computes with them.

    `storage` is the artifact's dtype (weights, KV cache). `compute` is the activations' and
    the matmuls' dtype: the storage dtype where the CPU has units for it, float32 where it
    does not (bf16 on an AVX2 host: weights stay bf16 in memory and are widened inside each
    kernel or matmul, as llama.cpp does). `quantized` artifacts hold every projection and the
    LM head as int8 with one bf16 scale per output channel (`<name>_scale`).
    """

    storage: torch.dtype
    compute: torch.dtype
    quantized: bool = False


def args_from_config(config: Mapping[str, Any]) -> ModelArgs:
    """Read a config.json (old and new transformers spellings); refuse what we cannot run."""
    archs = config.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"architecture {arch!r} is not supported by the torch backend",
            "supported: " + ", ".join(ARCHITECTURES),
        )
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"hidden_act {act!r} is not supported", "only silu is")
    if config.get("mlp_bias"):
        raise CheckpointError("mlp_bias is not supported by the torch backend")
    heads = int(config["num_attention_heads"])
    attention_bias = bool(config.get("attention_bias", False))
    return ModelArgs(
        architecture=arch,
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope=rope_parameters(config),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v bias; Llama's attention_bias adds it to q/k/v and o.
        qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
        o_bias=arch != "Qwen2ForCausalLM" and attention_bias,
        max_position_embeddings=config.get("max_position_embeddings"),
        sliding_window=_sliding_window(arch, config),
    )


def rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """transformers 5 keeps rope in `rope_parameters`; older configs in rope_theta+rope_scaling."""
    params = dict(config.get("rope_parameters") or {})
    if not params or "rope_theta" not in params:
        params.update(config.get("rope_scaling") or {})
        params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.pop("type", None) or params.get("rope_type") or "default"
    params["rope_type"] = rope_type
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(
            f"rope type {rope_type!r} is not supported by the torch backend",
            "supported: " + ", ".join(ROPE_TYPES),
        )
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointError("partial_rotary_factor != 1 is not supported")
    return params


def _sliding_window(arch: str, config: Mapping[str, Any]) -> int | None:
    window = config.get("sliding_window")
    if not window:
        return None
    if arch == "MistralForCausalLM":
        return int(window)
    layer_types = config.get("layer_types") or []
    if "sliding_attention" in layer_types:
        return int(window)
    if config.get("use_sliding_window") and not layer_types:
        # Older Qwen2 configs: layers from max_window_layers on use the window.
        if int(config.get("max_window_layers", 0)) < int(config["num_hidden_layers"]):
            return int(window)
    return None


def check_args(args: ModelArgs, seq_len: int) -> None:
    """Refuse shapes this modeling code would not compute exactly."""
    if args.num_heads % args.num_kv_heads:
        raise CheckpointError(
            f"{args.num_heads} attention heads are not a multiple of {args.num_kv_heads} KV heads"
        )
    if args.sliding_window is not None and args.sliding_window < seq_len:
        raise SpecError(
            "seq_len",
            f"the model uses a sliding window of {args.sliding_window} tokens, shorter than "
            f"seq_len {seq_len}; the torch backend attends over the full context",
            f"use --seq-len {args.sliding_window} or less",
        )


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


def quantized_names(args: ModelArgs) -> list[str]:
    """The tensors an int8 artifact stores quantized: every projection and the LM head."""
    head = "model.embed_tokens.weight" if args.tie_word_embeddings else "lm_head.weight"
    return sorted([n for n in weight_names(args) if n.endswith("_proj.weight")] + [head])


def scale_name(name: str) -> str:
    return name + "_scale"


def weight_names(args: ModelArgs, quantized: bool = False) -> list[str]:
    """The artifact tensors the graphs read (sorted); int8 artifacts add one scale each."""
    if quantized:
        names = weight_names(args)
        return sorted(names + [scale_name(n) for n in quantized_names(args)])
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not args.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names.append(f"{p}self_attn.{proj}.weight")
        if args.qkv_bias:
            names += [f"{p}self_attn.{proj}.bias" for proj in ("q_proj", "k_proj", "v_proj")]
        if args.o_bias:
            names.append(f"{p}self_attn.o_proj.bias")
        names += [f"{p}mlp.{proj}.weight" for proj in ("gate_proj", "up_proj", "down_proj")]
    return sorted(names)


def quantize(weight: Tensor, per_channel: bool) -> tuple[Tensor, Tensor]:
    """Symmetric int8: (q [out, in] int8, scale [out]) with weight ~= q * scale[:, None].

    The scale is rounded to bf16 first (int8_linear's kernel reads bf16 scales, and any
    storage dtype holds it exactly), then the weight divided by it; values the rounding
    pushes past 127 are clipped.
    """
    w = weight.float()
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax().expand(w.shape[0])
    scale = (amax / 127.0).clamp(min=1e-12).to(torch.bfloat16).float()
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.to(torch.bfloat16).contiguous()


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """The shape every weight must have for this config (checked before building)."""
    h, kv = args.hidden_size, args.num_kv_heads * args.head_dim
    q = args.num_heads * args.head_dim
    per_layer = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.bias": (h,),
        "mlp.gate_proj.weight": (args.intermediate_size, h),
        "mlp.up_proj.weight": (args.intermediate_size, h),
        "mlp.down_proj.weight": (h, args.intermediate_size),
    }
    shapes = {
        "model.embed_tokens.weight": (args.vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (args.vocab_size, h),
    }
    for name in weight_names(args):
        if name.startswith("model.layers."):
            shapes[name] = per_layer[name.split(".", 3)[3]]
    return {name: shapes[name] for name in weight_names(args)}


def graph_sources(
    args: ModelArgs, quantized: bool = False, packed: bool = False, blocked: bool = False
) -> dict[str, list[str]]:
    """Each tensor the graphs take (sorted by name: the graphs' input order) and the
    checkpoint-named tensors it is made of, concatenated along dim 0: q/k/v and gate/up fused.

    One projection per input vector instead of three (two) means fewer, larger matmul
    kernels per layer; the checkpoint and its shards keep Hugging Face names. `packed`
    graphs (packed_linear) also take a tied LM head as `lm_head.weight`: the embedding
    lookup needs the plain table, the head its packed copy. `blocked` graphs (kernel.linear)
    take every projection and the head in the kernel's blocked layout; a tied table is then
    only `lm_head.weight` (and its scale), blocked, and the embedding reads rows out of it.
    """
    out: dict[str, list[str]] = {}
    fused: set[str] = set()
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        groups = {
            "self_attn.qkv_proj.weight": [f"self_attn.{x}_proj.weight" for x in "qkv"],
            "mlp.gate_up_proj.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
        }
        if args.qkv_bias:
            groups["self_attn.qkv_proj.bias"] = [f"self_attn.{x}_proj.bias" for x in "qkv"]
        if quantized:
            groups.update({scale_name(k): [scale_name(x) for x in v]
                           for k, v in list(groups.items()) if k.endswith(".weight")})
        for name, parts in groups.items():
            out[p + name] = [p + part for part in parts]
            fused.update(p + part for part in parts)
    for name in weight_names(args, quantized):
        if name not in fused:
            out[name] = [name]
    if blocked and args.tie_word_embeddings:
        # One copy: the embedding lookup reads rows out of the blocked head (_embed).
        for name in [n for n in out if n.startswith("model.embed_tokens.weight")]:
            out[name.replace("model.embed_tokens", "lm_head")] = out.pop(name)
    if packed and args.tie_word_embeddings:
        out["lm_head.weight"] = ["model.embed_tokens.weight"]
    return {name: out[name] for name in sorted(out)}


def graph_weights(
    full: Mapping[str, Tensor], args: ModelArgs, packed: bool = False, quantized: bool = False,
    blocked: bool = False,
) -> dict[str, Tensor]:
    """The tensors the graphs take (graph_sources), from checkpoint-named ones."""
    out = {}
    for name, parts in graph_sources(args, quantized, packed, blocked).items():
        tensor = full[parts[0]] if len(parts) == 1 else torch.cat([full[p] for p in parts])
        if blocked and is_matrix(name):
            tensor = kernel.block(tensor)
        out[name] = tensor.contiguous()
    return out


def graph_layout(
    args: ModelArgs, dtype: torch.dtype, packed: bool = False, quantized: bool = False,
    blocked: bool = False,
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The shape and dtype of every tensor graph_weights makes, in its order, computed from
    the config (no tensors: the loader allocates each weight in its place from this).

    int8 weights stay int8 and their scales are bf16 (quantize); the rest is in `dtype`."""
    shapes: dict[str, tuple[int, ...]] = dict(expected_shapes(args))
    dtypes = {name: dtype for name in shapes}
    if quantized:
        for name in quantized_names(args):
            dtypes[name] = torch.int8
            shapes[scale_name(name)], dtypes[scale_name(name)] = (shapes[name][0],), torch.bfloat16
    out = {}
    for name, parts in graph_sources(args, quantized, packed, blocked).items():
        first = shapes[parts[0]]
        shape = (sum(shapes[part][0] for part in parts), *first[1:])
        if blocked and is_matrix(name):
            shape = (shape[0] // kernel.ROWS, shape[1] // kernel.CHUNK, kernel.ROWS, kernel.CHUNK)
        out[name] = (shape, dtypes[parts[0]])
    return out


def graph_shapes(
    args: ModelArgs, dtype: torch.dtype, packed: bool = False, quantized: bool = False,
    blocked: bool = False,
) -> dict[str, Tensor]:
    """Meta tensors with the shapes, dtypes and order of graph_weights (for tracing)."""
    return {name: torch.empty(shape, dtype=dt, device="meta")
            for name, (shape, dt) in graph_layout(args, dtype, packed, quantized,
                                                 blocked).items()}


def is_matrix(name: str) -> bool:
    """A weight the graphs multiply by: every projection and the LM head."""
    return name.endswith("_proj.weight") or name == "lm_head.weight"


def blockable(args: ModelArgs) -> bool:
    """Every matrix the graphs multiply by (a tied head is the embedding table) fits
    kernel.block's layout unpadded."""
    return all(kernel.fits(shape) for name, shape in expected_shapes(args).items()
               if is_matrix(name) or name == "model.embed_tokens.weight")


def new_kv_cache(
    args: ModelArgs, batch_size: int, seq_len: int, dtype: torch.dtype
) -> tuple[list[Tensor], list[Tensor]]:
    shape = (batch_size, args.num_kv_heads, seq_len, args.head_dim)
    k = [torch.zeros(shape, dtype=dtype) for _ in range(args.num_layers)]
    v = [torch.zeros(shape, dtype=dtype) for _ in range(args.num_layers)]
    return k, v


# --- the computation -----------------------------------------------------------------------


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # float32 statistics, then back to the activation dtype, as transformers does.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


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
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def pack_weight(weight: Tensor, batch_size: int) -> Tensor:
    """The oneDNN blocked layout packed_linear reads, chosen for `batch_size` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_size)


def packed_names(args: ModelArgs) -> list[str]:
    """The graph weights packed_linear reads (every projection and the LM head)."""
    return [n for n in graph_shapes(args, torch.float32, packed=True) if is_matrix(n)]


def can_pack(dtype: torch.dtype) -> bool:
    """oneDNN runs this dtype's linear natively on this host."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


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
    out = torch.ops.aten._weight_int8pack_mm(rows, weight, scale)
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


def _masked_attention(mask: Tensor, args: ModelArgs) -> Attend:
    return lambda q, k, v: attention(q, k, v, mask, args)


def _cache_attention(lengths: Tensor) -> Attend:
    """Token generation by neuronctl's op: one new token per row, its first lengths[b]
    positions of the cache read as stored (no widened copy, no mask)."""
    return lambda q, k, v: kernel.attention(q, k, v, lengths)


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
    attend = _masked_attention(causal, args)
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
        attend = _cache_attention(live + 1)
    else:
        span = torch.arange(bucket, device=token_ids.device)
        attend = _masked_attention((span[None, :] <= live[:, None])[:, None], args)  # [B,1,S]
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
