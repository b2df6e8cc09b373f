"""An artifact's weights read into the form its graphs take, one tensor at a time.

The shards hold the checkpoint's tensors (Hugging Face names, Neuron's tp split). The graphs
take q/k/v and gate/up fused, in the kernel's blocked layout where they call it
(layout.graph_sources). Each graph tensor is allocated once, in its final place (the
huge-page arena for blocked matrices), and its parts are read from the files straight into
it: a fused matrix's parts into its row ranges, a tp piece into its slice. Only a blocked
matrix passes through one transient plain tensor. Files are read, not mapped: the pages of a
mapped file count in the process's resident memory until it is unmapped, which doubled the
peak (bench/load.py).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import torch
from torch import Tensor

from neuronctl.backends.torch import kernel
from neuronctl.backends.torch.config import ModelArgs
from neuronctl.backends.torch.layout import graph_layout, graph_sources, is_matrix
from neuronctl.checkpoints.safetensors_format import TensorInfo, read_header
from neuronctl.errors import CheckpointError
from neuronctl.sharding import META_SPLITS, shard_name

RECOMPILE = "recompile the artifact"
# A blocked matrix is read and blocked this many bytes of rows at a time (one scratch buffer).
BAND_BYTES = 4 << 20


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

    def read_rows(self, name: str, start: int, out: Tensor) -> None:
        """Rows start.. of the stored tensor `name` (as many as `out` has) into `out`."""
        info = self.infos[name]
        if (tuple(out.shape[1:]) != info.shape[1:] or start + out.shape[0] > info.shape[0]
                or not info.shape):
            raise CheckpointError(f"{self.path}: {name} has shape {list(info.shape)}, the "
                                  f"graphs take {list(out.shape)}", RECOMPILE)
        if out.dtype != info.dtype or not out.is_contiguous():
            staged = torch.empty(tuple(out.shape), dtype=info.dtype)
            self.read_rows(name, start, staged)
            out.copy_(staged)
            return
        row_bytes = math.prod(info.shape[1:]) * info.dtype.itemsize
        view = out.reshape(-1).view(torch.uint8).numpy().data
        done, offset = 0, self.offsets[name] + start * row_bytes
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

    def read_rows(self, name: str, start: int, out: Tensor) -> None:
        """Rows start.. of the whole tensor `name` (as many as `out` has; any dtype,
        converted) into `out`, from the pieces that hold them."""
        kind, dim, kv_heads = self.splits[name]
        if kind == "replicate":
            self.shards[0].read_rows(name, start, out)
            return
        # "kv": head h lives on ranks h*tp//kv onwards; "split": even pieces, rank order.
        ranks = ([h * self.tp // kv_heads for h in range(kv_heads)] if kind == "kv"
                 else list(range(self.tp)))
        if dim != 0:  # every piece holds every row, a slice of the columns
            size = out.shape[dim] // len(ranks)
            for i, rank in enumerate(ranks):
                self.shards[rank].read_rows(name, start, out.narrow(dim, i * size, size))
            return
        size = self.info(name).shape[0] // len(ranks)  # rows per piece
        end = start + out.shape[0]
        for i, rank in enumerate(ranks):
            lo, hi = max(start, i * size), min(end, (i + 1) * size)
            if lo < hi:
                self.shards[rank].read_rows(name, lo - i * size, out.narrow(0, lo - start, hi - lo))

    def close(self) -> None:
        for shard in self.shards:
            shard.close()


def load_graph_weights(
    weights_dir: Path, args: ModelArgs, dtype: torch.dtype, quantized: bool,
    packed: bool, blocked: bool,
) -> dict[str, Tensor]:
    """The graphs' weight inputs (in graph order), read from the shards with one copy held.

    `packed` only adds the tied head's plain table as `lm_head.weight`; the runner packs.
    """
    sources = graph_sources(args, quantized, packed, blocked)
    layout = graph_layout(args, dtype, packed, quantized, blocked)
    shards = Shards(weights_dir)
    try:
        for parts in sources.values():
            for part in parts:
                shards.info(part)  # every part exists before anything is allocated
        matrices = {name: layout[name] for name in layout
                    if blocked and is_matrix(name)}
        weights = kernel.huge_page_tensors(matrices) if matrices else {}
        widest = max((kernel.ROWS * kernel.unblocked_shape(shape)[1] * dt.itemsize
                      for shape, dt in matrices.values()), default=0)
        scratch = torch.empty(max(BAND_BYTES, widest) if matrices else 0, dtype=torch.uint8)
        for name, (shape, dt) in layout.items():
            if name in matrices:
                _read_blocked(shards, sources[name], weights[name], scratch)
            else:
                weights[name] = torch.empty(shape, dtype=dt)
                _read_rows(shards, sources[name], 0, weights[name])
    finally:
        shards.close()
    return {name: weights[name] for name in layout}


def _read_blocked(shards: Shards, parts: list[str], out: Tensor, scratch: Tensor) -> None:
    """A matrix into its blocked place, a band of rows at a time through `scratch` (so the
    plain form never exists whole: a tied head is a fifth of a small model)."""
    n, k = kernel.unblocked_shape(tuple(out.shape))
    step = max(kernel.ROWS, scratch.numel() // (k * out.dtype.itemsize)
               // kernel.ROWS * kernel.ROWS)
    for row in range(0, n, step):
        rows = min(step, n - row)
        band = scratch[:rows * k * out.dtype.itemsize].view(out.dtype).view(rows, k)
        _read_rows(shards, parts, row, band)
        kernel.block(band, out=out[row // kernel.ROWS:(row + rows) // kernel.ROWS])


def _read_rows(shards: Shards, parts: list[str], start: int, out: Tensor) -> None:
    """Rows start.. of the parts concatenated along dim 0, into `out`."""
    row, end = 0, start + out.shape[0]
    for part in parts:
        rows = shards.info(part).shape[0]
        lo, hi = max(start, row), min(end, row + rows)
        if lo < hi:
            shards.read_rows(part, lo - row, out.narrow(0, lo - start, hi - lo))
        row += rows
    if row < end:
        raise CheckpointError(f"{shards.dir}: {parts} make {row} rows, the graphs take "
                              f"{end}", RECOMPILE)
