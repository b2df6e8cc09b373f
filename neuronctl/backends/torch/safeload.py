"""Load an export graph without ever unpickling an arbitrary object.

`torch.export.load` reads a `.pt2` zip archive and unpickles some of its members with
`weights_only=False` (pickled weights and constants, sample inputs on fallback, "opaque"
objects with plain `pickle.loads`): a `.pt2` whose pickle calls `os.system` runs it on load.
So before torch sees the file, every member is inspected, without executing anything:

- JSON records (the serialized graph, the payload configs) and the archive's tiny metadata
  records are data;
- raw tensor payloads the configs declare as not pickled are read by torch as bytes;
- anything else must be a pickle, or a torch.save zip whose `.pkl` is one, that
  `pickletools.genops` decodes completely and whose globals are all on ALLOWED_GLOBALS
  (tensor and storage rebuilding, nothing that calls out);
- script and opaque objects (TorchScript, plain pickles of Python objects) are refused.

Anything unrecognised is refused: the rule fails closed. neuronctl's own export graphs carry
no pickle at all (weights are graph inputs), so a refusal always means the file was not made
by `neuronctl compile`.

AOTInductor packages load a shared library and Neuron artifacts a TorchScript/NEFF file: those
are code by nature, and what vouches for them is the local build or a verified signature
(store/signing.py), not a scan.
"""

from __future__ import annotations

import io
import json
import pickletools
import re
import zipfile
from pathlib import Path
from typing import IO, Any

from neuronctl.errors import NeuronctlError

ALLOWED_GLOBALS = frozenset(
    {
        "collections.OrderedDict",
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_parameter",
        "torch.Size",
        "torch.device",
        "torch.storage.UntypedStorage",
        "torch.UntypedStorage",
        *(
            f"torch.{name}Storage"
            for name in (
                "Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte",
                "Bool", "ComplexFloat", "ComplexDouble",
            )
        ),  # fmt: skip
        *(
            f"torch.{name}"
            for name in (
                "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8",
                "uint8", "bool", "complex64", "complex128",
            )
        ),  # fmt: skip
    }
)
STRING_OPS = frozenset(
    {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING",
     "SHORT_BINSTRING"}
)  # fmt: skip
MEMO_PUT_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
MEMO_GET_OPS = frozenset({"GET", "BINGET", "LONG_BINGET"})
REFUSED_PREFIXES = ("custom_obj_", "opaque_obj_")  # TorchScript objects, plain pickles
METADATA_RE = re.compile(rb"[\w.\-]{0,64}\n?")  # archive_format, byteorder, version, ...
ZIP_MAGIC = b"PK\x03\x04"


class UnsafeGraphError(NeuronctlError):
    """A graph file carries something that would run code when loaded."""


def load_export_graph(file: Path) -> Any:
    """torch.export.load, after check_export_graph found nothing that could run code."""
    check_export_graph(file)
    import torch

    return torch.export.load(str(file))


def check_export_graph(file: Path) -> None:
    """Raise UnsafeGraphError unless every member of the `.pt2` is data (see module doc)."""
    try:
        with zipfile.ZipFile(file) as archive:
            raw = _raw_payloads(archive)
            for info in archive.infolist():
                if info.is_dir() or info.filename in raw:
                    continue
                problem = _member_problem(info.filename, archive.read(info))
                if problem:
                    raise UnsafeGraphError(
                        f"{file}: refusing to load it: {info.filename} {problem}",
                        "neuronctl's export graphs never carry pickled objects; this file was "
                        "not made by `neuronctl compile` (recompile, or pull a signed artifact)",
                    )
    except (zipfile.BadZipFile, OSError) as exc:
        raise UnsafeGraphError(f"{file} is not a torch.export archive: {exc}") from None


def _raw_payloads(archive: zipfile.ZipFile) -> set[str]:
    """Members the payload configs declare only as raw tensor bytes (torch reads them as
    bytes); a member any entry names otherwise is not raw."""
    raw: set[str] = set()
    other: set[str] = set()
    for name in archive.namelist():
        folder, _, base = name.rpartition("/")
        if not base.endswith("_config.json"):
            continue
        if not folder.endswith(("data/weights", "data/constants")):
            continue
        try:
            config = json.loads(archive.read(name)).get("config", {})
        except (ValueError, AttributeError):
            continue  # _member_problem judges the file itself
        for meta in config.values() if isinstance(config, dict) else ():
            if not isinstance(meta, dict):
                continue
            path = f"{folder}/{meta.get('path_name', '')}"
            is_raw = meta.get("use_pickle") is False and not str(
                meta.get("path_name", "")
            ).startswith(REFUSED_PREFIXES)
            (raw if is_raw else other).add(path)
    return raw - other


def _member_problem(name: str, data: bytes) -> str | None:
    base = name.rpartition("/")[2]
    if base.startswith(REFUSED_PREFIXES):
        return "is a script or opaque Python object"
    if not data or METADATA_RE.fullmatch(data):
        return None
    if data.startswith(ZIP_MAGIC):
        return _torch_save_problem(data)
    if name.endswith(".json") and _is_json(data):
        return None
    return _pickle_problem(data)


def _torch_save_problem(data: bytes) -> str | None:
    """A torch.save zip: its pickles are checked, its storages are bytes."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as inner:
            for info in inner.infolist():
                content = inner.read(info)
                parts = info.filename.split("/")
                if info.filename.endswith(".pkl"):
                    problem = _pickle_problem(content)
                elif len(parts) >= 2 and parts[-2] == "data" and parts[-1].isdigit():
                    problem = None  # a tensor storage, read as bytes
                elif not content or METADATA_RE.fullmatch(content):
                    problem = None
                else:
                    problem = f"holds an unrecognised member {info.filename}"
                if problem:
                    return problem
    except zipfile.BadZipFile:
        return "is a damaged zip"
    return None


def _pickle_problem(data: bytes) -> str | None:
    """Why this pickle could run code when unpickled, or None when it only rebuilds tensors."""
    stream: IO[bytes] = io.BytesIO(data)
    stack: list[Any] = []  # what recent opcodes pushed, as far as strings go
    memo: dict[int, Any] = {}
    try:
        for op, arg, _pos in pickletools.genops(stream):
            target = _global_target(op.name, arg, stack)
            if target is not None and target not in ALLOWED_GLOBALS:
                return f"is a pickle that references {target}"
            if op.name.startswith("EXT"):
                return "is a pickle that uses the copyreg extension registry"
            _track(op.name, arg, stack, memo)
    except ValueError as exc:
        return f"is not data (neither JSON, a tensor payload nor a clean pickle: {exc})"
    if stream.tell() != len(data):
        return "has data after its pickle (the legacy torch.save format is not accepted)"
    return None


def _global_target(op: str, arg: Any, stack: list[Any]) -> str | None:
    if op in ("GLOBAL", "INST"):
        module, _, name = str(arg).partition(" ")
        return f"{module}.{name}"
    if op == "STACK_GLOBAL":
        top: list[Any] = stack[-2:] if len(stack) >= 2 else [None, None]
        if not all(isinstance(part, str) for part in top):
            return "<a global whose name is computed>"
        return f"{top[0]}.{top[1]}"
    return None


def _track(op: str, arg: Any, stack: list[Any], memo: dict[int, Any]) -> None:
    """Enough of the unpickler's stack to name STACK_GLOBAL targets; unknowns stay None."""
    if op in STRING_OPS:
        stack.append(arg.decode("latin-1") if isinstance(arg, bytes) else arg)
    elif op in MEMO_GET_OPS:
        stack.append(memo.get(int(arg)))
    elif op in MEMO_PUT_OPS:
        memo[int(arg)] = stack[-1] if stack else None
    elif op == "MEMOIZE":
        memo[len(memo)] = stack[-1] if stack else None
    else:
        stack.append(None)
    del stack[:-2]  # only the top two ever matter


def _is_json(data: bytes) -> bool:
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


def artifact_problem(root: Path, manifest: Any) -> str | None:
    """validate --deep: the first export graph of a torch artifact that is not pure data."""
    try:
        check_artifact(root, manifest)
    except UnsafeGraphError as exc:
        return exc.message
    return None


def check_artifact(root: Path, manifest: Any) -> None:
    """Raise UnsafeGraphError for the first export graph that is not pure data. Run when an
    artifact is opened, since graphs load lazily and a refusal mid-request helps nobody."""
    spec = manifest.spec
    compiler = spec.get("compiler") if isinstance(spec, dict) else getattr(spec, "compiler", None)
    if manifest.backend != "torch" or compiler != "export":
        return
    for rel in manifest.graphs:
        check_export_graph(root / rel)
