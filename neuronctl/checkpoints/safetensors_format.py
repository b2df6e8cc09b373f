"""The safetensors file format: headers read with `safetensors.safe_open`, files written by hand.

Reading only the header lets us list tensors, validate a file (a truncated download is caught
before any compile starts) and plan shards without touching tensor bytes. Writing by hand lets
the sharder stream tensors into several files at once without ever holding a whole shard (the
safetensors library only writes a file from tensors held in memory).

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
from safetensors import SafetensorError, safe_open

from neuronctl.errors import CheckpointError

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
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
SAFETENSORS_CODES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


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
    """Tensor infos in file order and the `__metadata__`; CheckpointError if damaged.

    `safe_open` maps the file but reads only its header, and checks it: the JSON, every
    tensor's offsets against its dtype and shape, and the file size against the last offset.
    """
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            infos = {name: _info(path, name, f.get_slice(name)) for name in f.offset_keys()}
    except SafetensorError as exc:
        raise _damaged(path, _reason(exc)) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    return infos, metadata


def _info(path: Path, name: str, view: Any) -> TensorInfo:
    dtype = SAFETENSORS_DTYPES.get(view.get_dtype())
    if dtype is None:
        raise CheckpointError(
            f"{path}: tensor {name} has dtype {view.get_dtype()}, which neuronctl does not read",
            "supported: " + ", ".join(SAFETENSORS_DTYPES),
        )
    return TensorInfo(dtype, tuple(view.get_shape()))


# What safetensors says (after "Error while deserializing header: ") -> what it means here.
_REASONS = {
    "header too small": "shorter than a safetensors header",
    "invalid header length": "header length is past the end of the file",
    "header too large": "header length is over safetensors' limit (100 MB)",
    "not fully covered": "its size does not match its header: truncated (an interrupted download?)",
}


def _reason(exc: SafetensorError) -> str:
    text = str(exc).splitlines()[0].removeprefix("Error while deserializing header: ")
    return next((ours for theirs, ours in _REASONS.items() if theirs in text), text)


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
            "dtype": SAFETENSORS_CODES[info.dtype],
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
