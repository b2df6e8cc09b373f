"""The safetensors file format, read and written by hand.

Reading only the header lets us list tensors, validate a file (a truncated download is caught
before any compile starts) and plan shards without touching tensor bytes. Writing by hand lets
the sharder stream tensors into several files at once without ever holding a whole shard.

Layout: 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`, then
the raw bytes, offsets relative to the end of the header.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from neuronctl.errors import CheckpointError

MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Tensor infos in file order and the `__metadata__`; CheckpointError if damaged."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _damaged(path, "shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise _damaged(path, "header length is past the end of the file")
            header = json.loads(f.read(n))
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _damaged(path, "header is not valid JSON") from None
    if not isinstance(header, dict):
        raise _damaged(path, "header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    entries = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
    infos: dict[str, TensorInfo] = {}
    end = 0
    for name, entry in entries:
        dtype = DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise _damaged(path, f"tensor {name} has unknown dtype {entry.get('dtype')!r}")
        info = TensorInfo(dtype, tuple(entry["shape"]))
        begin, stop = entry["data_offsets"]
        if stop - begin != info.nbytes:
            raise _damaged(path, f"tensor {name} has {stop - begin} bytes, expected {info.nbytes}")
        infos[name] = info
        end = max(end, stop)
    if 8 + n + end > size:
        missing = 8 + n + end - size
        raise _damaged(path, f"truncated: {missing} bytes missing (an interrupted download?)")
    return infos, metadata


def _damaged(path: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"{path} is not a valid safetensors file: {why}",
        "download it again (`neuronctl download MODEL`) or re-save the checkpoint",
    )


def header_bytes(infos: list[tuple[str, TensorInfo]], metadata: dict[str, str]) -> bytes:
    """The length prefix and JSON header for tensors laid out back to back in this order."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, info in infos:
        header[name] = {
            "dtype": DTYPE_NAMES[info.dtype],
            "shape": list(info.shape),
            "data_offsets": [offset, offset + info.nbytes],
        }
        offset += info.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # readers expect the data to start 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def write_tensor_bytes(f: IO[bytes], tensor: torch.Tensor) -> None:
    """Write a tensor's raw bytes (row-major, little-endian) without an extra full copy."""
    flat = tensor.contiguous().reshape(-1)
    if flat.numel():
        f.write(flat.view(torch.uint8).numpy().data)
