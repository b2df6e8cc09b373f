"""The tensors the graphs take: weight names and shapes, their layouts, and the KV cache.

A checkpoint keeps Hugging Face names; the graphs take fewer, larger tensors (q/k/v and
gate/up fused), in the layout the artifact's op choice reads them in (opchoice.LAYOUTS):
plain [N, K], blocked for neuronctl's kernel (kernel.block), or a plain tensor the runner
packs for oneDNN at load time. int8 artifacts add one scale per quantized tensor.

The KV cache follows Neuron's layout: per layer one K and one V tensor of
[batch_size slots, kv_heads, seq_len, head_dim], one contiguous block per sequence.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from neuronctl.backends.torch import kernel
from neuronctl.backends.torch.config import ModelArgs


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
    return {name: graph_tensor(name, [full[p] for p in parts], blocked)
            for name, parts in graph_sources(args, quantized, packed, blocked).items()}


def graph_tensor(name: str, parts: list[Tensor], blocked: bool) -> Tensor:
    """Graph tensor `name` from its checkpoint parts (graph_sources): concatenated along dim
    0, and in the kernel's blocked layout where `blocked` graphs multiply by it. Consumes
    `parts` (emptied once joined), so compile never holds the parts beside the blocked form."""
    tensor = parts[0] if len(parts) == 1 else torch.cat(parts)
    parts.clear()
    if blocked and is_matrix(name):
        return kernel.block(tensor)
    return tensor.contiguous()


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
