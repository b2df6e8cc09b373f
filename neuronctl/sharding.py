"""Streaming tensor-parallel sharding of a Llama-family checkpoint.

Writes `weights_dir/tp{rank}_sharded_checkpoint.safetensors` for every rank, keeping the HF
tensor names. Split rules (docs/checkpoints.md has the table):
- column-parallel, dim 0: q/k/v/gate/up weights and their biases;
- row-parallel, dim 1: o_proj and down_proj weights (their biases, if any, are replicated);
- embed_tokens and lm_head: vocab-parallel on dim 0 when tp divides the vocab, else replicated;
- KV heads: when tp > num_key_value_heads, rank r holds KV head r * kv_heads // tp;
- tied embeddings: no lm_head is written (the loader ties it to embed_tokens);
- everything else (norms, unknown tensors) is replicated.

Memory stays flat whatever the model size: tensors are read one at a time, each shard file's
header is written first from the plan, then each piece is appended as it is cut, so no shard is
ever held in memory. Each file's `__metadata__` records the split of every tensor, which is how
`load_full_tensors` puts the originals back together.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from neuronctl.checkpoints import Checkpoint
from neuronctl.checkpoints.reader import valid_tp_degrees
from neuronctl.checkpoints.safetensors_format import TensorInfo, header_bytes, write_tensor_bytes
from neuronctl.errors import CheckpointError, SpecError
from neuronctl.progress import NullProgress, Progress

logger = logging.getLogger(__name__)

SHARD_NAME = "tp{rank}_sharded_checkpoint.safetensors"
META_SPLITS = "neuronctl.splits"  # JSON {name: [kind, dim, kv_heads]}

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class Split:
    kind: str  # "replicate" | "split" (even pieces along dim) | "kv" (one KV head per rank)
    dim: int = 0
    kv_heads: int = 0

    def piece_shape(self, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
        if self.kind == "replicate":
            return shape
        parts = self.kv_heads if self.kind == "kv" else tp
        out = list(shape)
        out[self.dim] //= parts
        return tuple(out)

    def piece(self, tensor: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        if self.kind == "replicate":
            return tensor
        if self.kind == "kv":
            head = rank * self.kv_heads // tp
            return tensor.chunk(self.kv_heads, dim=0)[head]
        return tensor.chunk(tp, dim=self.dim)[rank]


def shard_file(rank: int) -> str:
    return SHARD_NAME.format(rank=rank)


def split_rule(name: str, shape: tuple[int, ...], kv_heads: int, tp: int) -> Split:
    """How tensor `name` is divided across `tp` ranks."""
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    if name in VOCAB:
        return Split("split") if shape[0] % tp == 0 else Split("replicate")
    if module in COLUMN:
        if module in ("k_proj", "v_proj") and tp > kv_heads:
            return Split("kv", 0, kv_heads)
        return Split("split", 0)
    if module in ROW and parts[-1] == "weight":
        return Split("split", 1)
    return Split("replicate")


def check_tp(config: dict[str, Any], tp: int) -> None:
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    if tp < 1 or heads % tp:
        raise SpecError(
            "tp_degree",
            f"tp degree {tp} does not divide the model's {heads} attention heads",
            "use one of " + ", ".join(str(d) for d in valid_tp_degrees(heads, kv)),
        )
    if kv % tp and tp % kv:
        raise SpecError(
            "tp_degree", f"tp degree {tp} neither divides the {kv} KV heads nor is a multiple"
        )


PlanItem = tuple[str, Split, TensorInfo]


def plan(checkpoint: Checkpoint, tp: int, dtype: torch.dtype) -> list[PlanItem]:
    """(name, split, converted full info) for every tensor to write, in read order."""
    config = checkpoint.config
    check_tp(config, tp)
    kv = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    tied = bool(config.get("tie_word_embeddings"))
    out = []
    for name in checkpoint.tensor_names():
        if tied and name == "lm_head.weight":
            continue
        info = checkpoint.tensor_info(name)
        split = split_rule(name, info.shape, kv, tp)
        if split.kind == "split" and info.shape[split.dim] % tp:
            raise SpecError(
                "tp_degree",
                f"tp degree {tp} does not divide dim {split.dim} of {name} {list(info.shape)}",
            )
        out_dtype = dtype if info.dtype.is_floating_point else info.dtype
        out.append((name, split, TensorInfo(out_dtype, info.shape)))
    return out


def shard_checkpoint(
    checkpoint: Checkpoint,
    tp_degree: int,
    dtype: torch.dtype,
    weights_dir: Path,
    progress: Progress | None = None,
) -> list[Path]:
    """Write one safetensors file per rank; return their paths in rank order."""
    tp = tp_degree
    items = plan(checkpoint, tp, dtype)
    weights_dir.mkdir(parents=True, exist_ok=True)
    paths = [weights_dir / shard_file(rank) for rank in range(tp)]
    splits = {name: [s.kind, s.dim, s.kv_heads] for name, s, _ in items}
    total = sum(info.nbytes for *_, info in items)
    logger.info("sharding %s for tp %d into %s", checkpoint.ref, tp, weights_dir)
    logger.debug("%d tensors, %d bytes as %s", len(items), total, dtype)
    advance = (progress or NullProgress()).task(f"sharding weights (tp {tp})", total=total)
    files: list[IO[bytes]] = []
    try:
        for rank, path in enumerate(paths):
            out = open(path, "wb")
            files.append(out)
            infos = [
                (name, TensorInfo(info.dtype, split.piece_shape(info.shape, tp)))
                for name, split, info in items
            ]
            out.write(header_bytes(infos, _metadata(checkpoint, tp, rank, dtype, splits)))
        for name, split, info in items:
            logger.debug("%s %s: %s", name, list(info.shape), split.kind)
            tensor = checkpoint.tensor(name).to(info.dtype)
            for rank, f in enumerate(files):
                write_tensor_bytes(f, split.piece(tensor, rank, tp))
            del tensor
            advance(info.nbytes)
        for f in files:
            f.close()
    except BaseException:
        for f in files:
            f.close()
        for path in paths:
            path.unlink(missing_ok=True)
        logger.debug("sharding failed: removed the partial shard files")
        raise
    logger.info("wrote %d shard files in %s", len(paths), weights_dir)
    return paths


def _metadata(
    checkpoint: Checkpoint, tp: int, rank: int, dtype: torch.dtype, splits: dict[str, list[Any]]
) -> dict[str, str]:
    return {
        "format": "pt",
        "neuronctl.tp_degree": str(tp),
        "neuronctl.tp_rank": str(rank),
        "neuronctl.dtype": str(dtype).removeprefix("torch."),
        "neuronctl.tie_word_embeddings": json.dumps(
            bool(checkpoint.config.get("tie_word_embeddings"))
        ),
        META_SPLITS: json.dumps(splits, separators=(",", ":")),
    }


def load_full_tensors(weights_dir: Path) -> dict[str, torch.Tensor]:
    """Reassemble the unsharded tensors from the shards in `weights_dir`."""
    from safetensors import safe_open

    first = weights_dir / shard_file(0)
    if not first.is_file():
        raise CheckpointError(f"{weights_dir} has no {first.name}")
    with safe_open(str(first), framework="pt") as f:
        meta = f.metadata() or {}
    if META_SPLITS not in meta:
        raise CheckpointError(f"{first} was not written by neuronctl (no split metadata)")
    tp = int(meta["neuronctl.tp_degree"])
    splits = json.loads(meta[META_SPLITS])
    logger.debug("reassembling %d tensors from %d shards in %s", len(splits), tp, weights_dir)
    paths = [weights_dir / shard_file(rank) for rank in range(tp)]
    for path in paths:
        if not path.is_file():
            raise CheckpointError(f"{weights_dir} is missing {path.name} (tp degree {tp})")
    handles = [safe_open(str(p), framework="pt") for p in paths]
    full: dict[str, torch.Tensor] = {}
    for name, (kind, dim, kv_heads) in splits.items():
        if kind == "replicate":
            full[name] = handles[0].get_tensor(name)
        elif kind == "kv":
            # The first rank holding each KV head: head h lives on ranks h*tp//kv onwards.
            ranks = [h * tp // kv_heads for h in range(kv_heads)]
            full[name] = torch.cat([handles[r].get_tensor(name) for r in ranks], dim=0)
        else:
            full[name] = torch.cat([h.get_tensor(name) for h in handles], dim=dim)
    return full
