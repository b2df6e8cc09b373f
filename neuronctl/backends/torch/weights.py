"""An artifact's weights read into the form its graphs take, one tensor at a time.

The shards hold the checkpoint's tensors (Hugging Face names, Neuron's tp split). The graphs
take q/k/v and gate/up fused, in the kernel's blocked layout where they call it
(modeling.graph_sources). Each graph tensor is allocated once, in its final place (the
huge-page arena for blocked matrices), and its parts are read from the files straight into
it: a fused matrix's parts into its row ranges, a tp piece into its slice. Only a blocked
matrix passes through one transient plain tensor. Files are read, not mapped: the pages of a
mapped file count in the process's resident memory until it is unmapped, which doubled the
peak (bench/load.py).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch
from torch import Tensor

from neuronctl.backends.torch import kernel, modeling
from neuronctl.checkpoints.safetensors_format import TensorInfo, read_header
from neuronctl.errors import CheckpointError
from neuronctl.sharding import META_SPLITS, shard_name

RECOMPILE = "recompile the artifact"


class Shard:
    """One safetensors file, read tensor by tensor with pread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.infos, self.metadata = read_header(path)  # validated: offsets fit the file
        self.fd = os.open(path, os.O_RDONLY)
        header_len = struct.unpack("<Q", os.pread(self.fd, 8, 0))[0]
        header = json.loads(os.pread(self.fd, header_len, 8))
        self.offsets = {name: 8 + header_len + int(entry["data_offsets"][0])
                        for name, entry in header.items() if name != "__metadata__"}

    def read_into(self, name: str, out: Tensor) -> None:
        info = self.infos[name]
        if tuple(out.shape) != info.shape:
            raise CheckpointError(f"{self.path}: {name} has shape {list(info.shape)}, the "
                                  f"graphs take {list(out.shape)}", RECOMPILE)
        if out.dtype != info.dtype or not out.is_contiguous():
            staged = torch.empty(info.shape, dtype=info.dtype)
            self.read_into(name, staged)
            out.copy_(staged)
            return
        view = out.reshape(-1).view(torch.uint8).numpy().data
        done, offset = 0, self.offsets[name]
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise CheckpointError(f"{self.path} ends inside {name}", RECOMPILE)
            done += got

    def close(self) -> None:
        os.close(self.fd)


class Shards:
    """The tp shards of an artifact: each tensor reassembled whole from its pieces."""

    def __init__(self, weights_dir: Path) -> None:
        first = weights_dir / shard_name(0)
        if not first.is_file():
            raise CheckpointError(f"{weights_dir} has no {first.name}", RECOMPILE)
        self.shards = [Shard(first)]
        meta = self.shards[0].metadata
        if META_SPLITS not in meta:
            raise CheckpointError(f"{first} was not written by neuronctl (no split metadata)")
        self.tp = int(meta["neuronctl.tp_degree"])
        self.splits = json.loads(meta[META_SPLITS])
        for rank in range(1, self.tp):
            path = weights_dir / shard_name(rank)
            if not path.is_file():
                raise CheckpointError(f"{weights_dir} is missing {path.name} "
                                      f"(tp degree {self.tp})", RECOMPILE)
            self.shards.append(Shard(path))
        self.dir = weights_dir

    def info(self, name: str) -> TensorInfo:
        if name not in self.splits:
            raise CheckpointError(f"{self.dir} lacks {name}", RECOMPILE)
        kind, dim, kv_heads = self.splits[name]
        piece = self.shards[0].infos[name]
        shape = list(piece.shape)
        shape[dim] *= {"replicate": 1, "kv": kv_heads}.get(kind, self.tp)
        return TensorInfo(piece.dtype, tuple(shape))

    def read_into(self, name: str, out: Tensor) -> None:
        """The whole tensor `name` into `out` (its shape; any dtype, converted)."""
        kind, dim, kv_heads = self.splits[name]
        if kind == "replicate":
            self.shards[0].read_into(name, out)
            return
        # "kv": head h lives on ranks h*tp//kv onwards; "split": even pieces, rank order.
        ranks = ([h * self.tp // kv_heads for h in range(kv_heads)] if kind == "kv"
                 else list(range(self.tp)))
        size = out.shape[dim] // len(ranks)
        for i, rank in enumerate(ranks):
            self.shards[rank].read_into(name, out.narrow(dim, i * size, size))

    def close(self) -> None:
        for shard in self.shards:
            shard.close()


def load_graph_weights(
    weights_dir: Path, args: modeling.ModelArgs, dtype: torch.dtype, quantized: bool,
    packed: bool, blocked: bool,
) -> dict[str, Tensor]:
    """The graphs' weight inputs (in graph order), read from the shards with one copy held.

    `packed` only adds the tied head's plain table as `lm_head.weight`; the runner packs.
    """
    sources = modeling.graph_sources(args, quantized, packed, blocked)
    layout = modeling.graph_layout(args, dtype, packed, quantized, blocked)
    shards = Shards(weights_dir)
    try:
        for parts in sources.values():
            for part in parts:
                shards.info(part)  # every part exists before anything is allocated
        matrices = {name: layout[name] for name in layout
                    if blocked and modeling.is_matrix(name)}
        weights = kernel.huge_page_tensors(matrices) if matrices else {}
        for name, (shape, dt) in layout.items():
            if name in matrices:
                plain = torch.empty(kernel.unblocked_shape(shape), dtype=dt)
                _read_rows(shards, sources[name], plain)
                kernel.block(plain, out=weights[name])
                del plain
            else:
                weights[name] = torch.empty(shape, dtype=dt)
                _read_rows(shards, sources[name], weights[name])
    finally:
        shards.close()
    return {name: weights[name] for name in layout}


def _read_rows(shards: Shards, parts: list[str], out: Tensor) -> None:
    """Parts concatenated along dim 0 into `out`, each read into its row range."""
    row = 0
    for part in parts:
        rows = shards.info(part).shape[0] if len(parts) > 1 else out.shape[0]
        shards.read_into(part, out.narrow(0, row, rows))
        row += rows
    if row != out.shape[0]:
        raise CheckpointError(f"{shards.dir}: {parts} make {row} rows, the graphs take "
                              f"{out.shape[0]}", RECOMPILE)
