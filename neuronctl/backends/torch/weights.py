"""An artifact's weights, written once at compile in the form its graphs take, mapped at load.

The graphs take q/k/v and gate/up fused, int8 with bf16 scales where quantized, and every
matrix in the kernel's blocked layout where they call it (layout.graph_sources). `compile`
writes exactly those tensors, in graph order, into one safetensors file
(`weights/graph_weights.safetensors`), each tensor's bytes on a 64-byte boundary (uint8
padding entries fill the gaps: safetensors allows no holes). Loading maps that file and hands
the graphs views of it: nothing is copied, the pages are the page cache's (two processes
serving one artifact share them), and on a kernel whose page cache keeps 2 MiB folios the
mapping is made of 2 MiB pages like the anonymous arena it replaces (arena.py).

One process runs the whole model on a CPU, so the file is not split by tp: the tp degree is
recorded in the spec and the host check, as on Neuron, and changes no byte here.
"""

from __future__ import annotations

import json
import logging
import mmap
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import torch
from torch import Tensor

from neuronctl.backends.torch import arena, kernel
from neuronctl.backends.torch.arena import GRAPH_WEIGHTS
from neuronctl.backends.torch.config import ModelArgs
from neuronctl.backends.torch.layout import (
    graph_layout,
    graph_sources,
    graph_tensor,
    is_matrix,
)
from neuronctl.checkpoints.safetensors_format import (
    SAFETENSORS_CODES,
    TensorInfo,
    read_header,
    write_tensor_bytes,
)
from neuronctl.errors import CheckpointError
from neuronctl.progress import NullProgress, Progress

if TYPE_CHECKING:
    from neuronctl.checkpoints import Checkpoint

logger = logging.getLogger(__name__)

RECOMPILE = "recompile the artifact"
# Below this share of the mapping in 2 MiB pages, blocked matrices move into anonymous ones.
HUGE_ENOUGH = 0.5
# A cache line: each weight starts on its own (inductor's code assumes inputs 16-byte aligned).
ALIGN = 64
PAD = "neuronctl.pad."  # padding entries' name prefix: never a graph tensor
WEIGHTS_FORMAT = "graph-1"
Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]


def stored_layout(args: ModelArgs, dtype: torch.dtype, quantized: bool, blocked: bool) -> Layout:
    """The tensors the file holds: the graphs' weights, less the tied head a packed graph
    takes beside the embedding (the loader hands it the embedding's view to pack)."""
    return graph_layout(args, dtype, False, quantized, blocked)


def write_graph_weights(
    checkpoint: Checkpoint, args: ModelArgs, dtype: torch.dtype, quantized: bool, blocked: bool,
    path: Path, progress: Progress | None = None,
) -> None:
    """Write the graphs' weights from `checkpoint` (a Checkpoint, or its int8 wrapper) into
    `path`, one graph tensor in memory at a time. A failure leaves no file."""
    layout = stored_layout(args, dtype, quantized, blocked)
    sources = graph_sources(args, quantized, False, blocked)
    header, offsets = _header(layout, {"neuronctl.weights": WEIGHTS_FORMAT,
                                       "neuronctl.dtype": str(dtype).removeprefix("torch.")})
    advance = (progress or NullProgress()).task(
        "writing weights", total=sum(_nbytes(shape, dt) for shape, dt in layout.values()))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(path, "wb", buffering=0) as file:
            out = PageWriter(file)
            out.write(header)
            for name, tensor in _graph_tensors(checkpoint, sources, layout, blocked):
                out.write(bytes(offsets[name] - out.tell()))  # padding to its boundary
                write_tensor_bytes(out, tensor)  # type: ignore[arg-type]
                advance(tensor.numel() * tensor.element_size())
            out.flush()
    except BaseException:
        path.unlink(missing_ok=True)
        raise


class PageWriter:
    """Writes a file in whole, aligned 2 MiB pieces (the last one shorter).

    Linux's page cache gives a buffered write folios no larger, nor more aligned, than the
    write: tensor-sized writes left a just-compiled 257 MB weights file 16-37 % in 2 MiB
    folios, so its mapping was mostly 4 KiB pages until the file left the cache; written in
    2 MiB pieces it maps as 2 MiB pages at once (bench/load.py's in_2mib_pages)."""

    PIECE = arena.HUGE_PAGE

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.buffer = bytearray(self.PIECE)
        self.filled = 0
        self.written = 0

    def tell(self) -> int:
        return self.written + self.filled

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            take = min(len(view), self.PIECE - self.filled)
            self.buffer[self.filled:self.filled + take] = view[:take]
            self.filled, view = self.filled + take, view[take:]
            if self.filled == self.PIECE:
                self.flush()

    def flush(self) -> None:
        done = 0
        while done < self.filled:  # a raw write may write less than asked
            done += self.file.write(memoryview(self.buffer)[done:self.filled]) or 0
        self.written, self.filled = self.written + self.filled, 0


def _graph_tensors(
    checkpoint: Checkpoint, sources: dict[str, list[str]], layout: Layout, blocked: bool
) -> Iterator[tuple[str, Tensor]]:
    """Each graph tensor, built from its checkpoint parts: fused, converted, blocked."""
    for name, parts in sources.items():
        shape, dtype = layout[name]
        tensor = graph_tensor(name, [checkpoint.tensor(part).to(dtype) for part in parts],
                              blocked)
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"{name} is {list(tensor.shape)} from {parts}, the graphs "
                                  f"take {list(shape)}")
        yield name, tensor


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return TensorInfo(dtype, shape).nbytes


def _header(layout: Layout, metadata: dict[str, str]) -> tuple[bytes, dict[str, int]]:
    """The safetensors header for `layout`, each tensor's data on an ALIGN boundary of the
    file, and each tensor's file offset."""
    # The header's length moves every offset: lay the data out relative to its start, then
    # pad the JSON so that the data starts on a boundary.
    table: dict[str, object] = {"__metadata__": metadata}
    starts, offset, pads = {}, 0, 0
    for name, (shape, dtype) in layout.items():
        gap = -offset % ALIGN
        if gap:
            table[f"{PAD}{pads}"] = {"dtype": "U8", "shape": [gap],
                                     "data_offsets": [offset, offset + gap]}
            pads, offset = pads + 1, offset + gap
        nbytes = _nbytes(shape, dtype)
        table[name] = {"dtype": SAFETENSORS_CODES[dtype], "shape": list(shape),
                       "data_offsets": [offset, offset + nbytes]}
        starts[name], offset = offset, offset + nbytes
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)
    data = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, {n: data + s for n, s in starts.items()}


def load_graph_weights(
    weights_dir: Path, args: ModelArgs, dtype: torch.dtype, quantized: bool,
    packed: bool, blocked: bool,
) -> dict[str, Tensor]:
    """The graphs' weight inputs (in graph order): views of the mapped weights file.

    `packed` adds the tied head's plain table as `lm_head.weight` (the embedding's view);
    the runner packs the matrices and gives their pages back (release).
    """
    path = weights_dir / GRAPH_WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"{weights_dir} has no {GRAPH_WEIGHTS}", RECOMPILE)
    layout = stored_layout(args, dtype, quantized, blocked)
    offsets, header, size = _checked_offsets(path, layout)
    try:
        mapping = arena.take(path) or arena.map_file(path)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot map {path}: {exc}", RECOMPILE) from None
    if len(mapping) != size or mapping[:len(header)] != header:  # replaced since it was read
        raise CheckpointError(f"{path} changed while it was being loaded", "load it again")
    space = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping while views live
    stored = {name: space[offsets[name]:offsets[name] + _nbytes(shape, dt)].view(dt).view(shape)
              for name, (shape, dt) in layout.items()}
    if blocked and arena.huge_share(mapping) < HUGE_ENOUGH and arena.anonymous_huge_pages():
        into_anonymous_huge_pages(stored)
    want = graph_layout(args, dtype, packed, quantized, blocked)
    return {name: stored[name] if name in stored else stored["model.embed_tokens.weight"]
            for name in want}


def into_anonymous_huge_pages(weights: dict[str, Tensor]) -> None:
    """Copy the blocked matrices out of a mapping the page cache could not give 2 MiB pages
    (a filesystem or kernel without large folios) into anonymous memory that has them
    (kernel.huge_page_tensors), each one's mapped pages given back as it goes: the kernel
    streams them every step, up to 16 % faster on 2 MiB pages (bench/kernel.py)."""
    matrices = [name for name in weights if is_matrix(name)]
    logger.info("the weights file maps as 4 KiB pages here: copying %d matrices into 2 MiB "
                "pages", len(matrices))
    kernel.into_huge_pages(weights, matrices, release)


def _checked_offsets(path: Path, layout: Layout) -> tuple[dict[str, int], bytes, int]:
    """Each tensor's file offset, after checking the file holds exactly `layout`, in order,
    each on its boundary (read_header has checked the offsets cover the file); the header's
    bytes and the file's size, which the mapping must have too."""
    infos, metadata = read_header(path)
    if metadata.get("neuronctl.weights") != WEIGHTS_FORMAT:
        raise CheckpointError(f"{path} was not written by this neuronctl's compile", RECOMPILE)
    names = [name for name in infos if not name.startswith(PAD)]
    if names != list(layout):
        missing = sorted(set(layout) - set(names)) or sorted(set(names) - set(layout))
        raise CheckpointError(f"{path} does not hold the graphs' weights (first difference: "
                              f"{missing[:1] or 'their order'})", RECOMPILE)
    for name, (shape, dtype) in layout.items():
        if infos[name] != TensorInfo(dtype, shape):
            raise CheckpointError(f"{path}: {name} is {infos[name].dtype} "
                                  f"{list(infos[name].shape)}, the graphs take {dtype} "
                                  f"{list(shape)}", RECOMPILE)
    with open(path, "rb") as f:
        prefix = f.read(8)
        length = struct.unpack("<Q", prefix)[0]
        raw = f.read(length)
    header = json.loads(raw)
    offsets = {name: 8 + length + int(header[name]["data_offsets"][0]) for name in layout}
    crooked = [name for name, offset in offsets.items() if offset % ALIGN]
    if crooked:
        raise CheckpointError(f"{path}: {crooked[0]} is not on a {ALIGN}-byte boundary",
                              RECOMPILE)
    end = max((int(entry["data_offsets"][1]) for name, entry in header.items()
               if name != "__metadata__"), default=0)
    return offsets, prefix + raw, 8 + length + end


def release(view: Tensor) -> None:
    """Give back the whole pages of a mapped weight that nothing reads any more (a matrix
    the runner packed into its own memory): they leave the process's resident set and the
    mapping stays valid (a later read would fault them in again from the file)."""
    start = view.data_ptr()
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (start + view.numel() * view.element_size()) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > first:
        arena.advise([(first, end - first)], mmap.MADV_DONTNEED)

