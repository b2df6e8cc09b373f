"""Load an export graph without ever unpickling anything.

`torch.export.load` reads a `.pt2` zip archive and unpickles some of its members with
`weights_only=False` (pickled weights and constants, sample inputs on fallback, "opaque"
objects with plain `pickle.loads`): a `.pt2` whose pickle calls `os.system` runs it on load.
neuronctl's own export graphs carry no pickle at all (weights are graph inputs, the payload
configs are empty, the sample inputs member is empty), so before torch sees the file every
member must be data, judged without executing anything:

- JSON records (the serialized graph, the payload configs) and the archive's tiny metadata
  records;
- raw tensor payloads that a payload config declares with `use_pickle: false`, which torch
  reads as bytes; such a member must not itself be a pickle or a zip;
- a payload config that declares any pickled payload, script object or opaque object is
  refused, and so is any member that is a pickle or a torch.save zip, whatever its name.

Python's `zipfile` and torch's zip reader (miniz, behind torch._C.PyTorchFileReader) must see
the same members, or the scan judges one archive and torch loads another: `zipfile` tolerates
data before the archive (it shifts every offset by what it finds there) where miniz takes the
offsets as written, so a malicious zip followed by a benign one whose end record points back
at the first central directory showed `zipfile` the benign members and torch the malicious
ones. So the layout itself is checked first, and anything but the one plain layout is
refused: the first member at offset 0, each member's local header right where the previous
member (and its data descriptor) ended, with the same name as its central directory entry,
the central directory right after the last member, the end records right after it and
nothing after them. Such an archive has one reading, whichever reader reads it.

torch's zip reader finds members case-insensitively (miniz's locate_file without the
case-sensitive flag), so names are compared case-folded and an archive with two members whose
names differ only in case is refused. Anything unrecognised is refused: the rule fails closed.

AOTInductor packages load a shared library and Neuron artifacts a TorchScript/NEFF file: those
are code by nature, and what vouches for them is the local build or a verified signature
(store/signing.py), not a scan.
"""

from __future__ import annotations

import io
import json
import pickletools
import re
import struct
import zipfile
from pathlib import Path
from typing import IO, Any

from neuronctl.backends.torch import internals
from neuronctl.errors import NeuronctlError
from neuronctl.store.files import open_regular

STRING_OPS = frozenset(
    {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING",
     "SHORT_BINSTRING"}
)  # fmt: skip
MEMO_PUT_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
MEMO_GET_OPS = frozenset({"GET", "BINGET", "LONG_BINGET"})
REFUSED_PREFIXES = internals.PT2_OBJECT_PREFIXES  # TorchScript objects, plain pickles
METADATA_RE = re.compile(rb"[\w.\-]{0,64}\n?")  # archive_format, byteorder, version, ...
ZIP_MAGIC = b"PK\x03\x04"
PAYLOAD_DIRS = internals.PT2_PAYLOAD_DIRS


class UnsafeGraphError(NeuronctlError):
    """A graph file carries something that would run code when loaded."""


def load_export_graph(file: Path, name: str = "") -> Any:
    """torch.export.load, after check_export_graph found nothing that could run code."""
    check_export_graph(file, name)
    import torch

    return torch.export.load(str(file))


def check_export_graph(file: Path, name: str = "") -> None:
    """Raise UnsafeGraphError unless every member of the `.pt2` is data (see module doc).
    `name`: what errors call the file (a verified copy's path means nothing to a user)."""
    shown = name or file
    try:
        with open_regular(file) as stream, zipfile.ZipFile(stream) as archive:
            problem = _layout_problem(stream, archive) or _archive_problem(archive)
    except (zipfile.BadZipFile, OSError) as exc:
        raise UnsafeGraphError(f"{shown} is not a torch.export archive: {exc}") from None
    if problem:
        raise UnsafeGraphError(
            f"{shown}: refusing to load it: {problem}",
            "neuronctl's export graphs never carry pickled objects; this file was "
            "not made by `neuronctl compile` (recompile, or pull a signed artifact)",
        )


EOCD = struct.Struct("<4s4H2LH")  # end of central directory record
EOCD_SIG, LOCATOR_SIG, EOCD64_SIG = b"PK\x05\x06", b"PK\x06\x07", b"PK\x06\x06"
EOCD64_SIZE, LOCATOR_SIZE = 56, 20
LOCAL = struct.Struct("<4s5H3L2H")  # local file header, before its name and extra field
LOCAL_SIG, DESCRIPTOR_SIG = b"PK\x03\x04", b"PK\x07\x08"
DESCRIPTOR_FLAG = 0x08


def _layout_problem(stream: IO[bytes], archive: zipfile.ZipFile) -> str | None:
    """Why the archive could read differently in another zip reader, or None (module doc)."""
    size = stream.seek(0, io.SEEK_END)
    stream.seek(size - EOCD.size)
    tail = stream.read(EOCD.size)
    if len(tail) != EOCD.size or EOCD.unpack(tail)[0] != EOCD_SIG or EOCD.unpack(tail)[-1]:
        return "has data after its end record (or an archive comment)"
    cd_end = _central_directory_end(stream, size - EOCD.size)
    cd_start = cd_end - sum(_cd_entry_size(info) for info in archive.infolist())
    if archive.start_dir != cd_start:  # type: ignore[attr-defined]
        return "has data before its first member or around its central directory"
    entries = sorted(archive.infolist(), key=lambda i: i.header_offset)
    if entries and entries[0].header_offset:
        return (
            f"has {entries[0].header_offset} bytes before its first member (another zip "
            "reader, torch's, can read another archive there)"
        )
    position = 0
    for info in entries:
        problem = _entry_problem(stream, info, position)
        if problem:
            return f"member {info.filename} {problem}"
        position = _entry_end(stream, info)
        if position < 0:
            return f"member {info.filename} has no data descriptor after its data"
    if position != cd_start:
        return "has data between its last member and its central directory"
    return None


def _central_directory_end(stream: IO[bytes], eocd_at: int) -> int:
    """Where the central directory must end: at the zip64 end record, if there is one (its
    locator right before the end record), else at the end record."""
    if eocd_at >= LOCATOR_SIZE + EOCD64_SIZE:
        stream.seek(eocd_at - LOCATOR_SIZE)
        if stream.read(4) == LOCATOR_SIG:
            return eocd_at - LOCATOR_SIZE - EOCD64_SIZE
    return eocd_at


def _cd_entry_size(info: zipfile.ZipInfo) -> int:
    return 46 + len(info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")) \
        + len(info.extra) + len(info.comment)


def _entry_problem(stream: IO[bytes], info: zipfile.ZipInfo, expected: int) -> str | None:
    if info.header_offset != expected:
        return f"starts at {info.header_offset}, not where the previous one ended ({expected})"
    stream.seek(info.header_offset)
    header = stream.read(LOCAL.size)
    if len(header) != LOCAL.size or LOCAL.unpack(header)[0] != LOCAL_SIG:
        return "has no local header where the central directory says"
    name = stream.read(LOCAL.unpack(header)[-2])
    if name.decode("utf-8", "replace") != info.orig_filename:
        return "has another name in its local header than in the central directory"
    return None


def _entry_end(stream: IO[bytes], info: zipfile.ZipInfo) -> int:
    """Where a member ends: after its local header, data and data descriptor, if any."""
    stream.seek(info.header_offset)
    fields = LOCAL.unpack(stream.read(LOCAL.size))
    end = info.header_offset + LOCAL.size + fields[-2] + fields[-1] + info.compress_size
    if not info.flag_bits & DESCRIPTOR_FLAG:
        return end
    stream.seek(end)
    if stream.read(4) != DESCRIPTOR_SIG:
        return -1  # torch writes the signature: anything else is not its layout
    zip64 = info.compress_size >= 0xFFFFFFFF or info.file_size >= 0xFFFFFFFF
    return end + (24 if zip64 else 16)


def _archive_problem(archive: zipfile.ZipFile) -> str | None:
    members = [info for info in archive.infolist() if not info.is_dir()]
    seen: dict[str, str] = {}
    for info in members:
        folded = info.filename.casefold()
        if folded in seen:
            return (
                f"{info.filename} and {seen[folded]} differ only in case "
                "(torch would read either for both)"
            )
        seen[folded] = info.filename
    raw, problem = _raw_payloads(archive)
    if problem:
        return problem
    for info in members:
        data = archive.read(info)
        is_raw = info.filename.casefold() in raw
        problem = _raw_problem(data) if is_raw else _member_problem(info.filename, data)
        if problem:
            return f"{info.filename} {problem}"
    return None


def _raw_payloads(archive: zipfile.ZipFile) -> tuple[set[str], str | None]:
    """The members (case-folded) the payload configs declare as raw tensor bytes, or why a
    config is refused: every payload must be declared `use_pickle: false`, none an object."""
    raw: set[str] = set()
    for name in archive.namelist():
        folder, _, base = name.rpartition("/")
        if not base.casefold().endswith(internals.PT2_PAYLOAD_CONFIG_SUFFIX):
            continue
        if not folder.casefold().endswith(PAYLOAD_DIRS):
            continue
        try:
            config = json.loads(archive.read(name)).get(internals.PT2_CONFIG_ENTRIES, {})
        except (ValueError, AttributeError):
            continue  # _member_problem judges the file itself
        entries = config.values() if isinstance(config, dict) else ()
        for meta in entries:
            path_name = str(meta.get(internals.PT2_PATH_NAME, "")) if isinstance(meta, dict) else ""
            if not isinstance(meta, dict) or meta.get(internals.PT2_USE_PICKLE) is not False:
                return raw, f"{name} declares a pickled payload {path_name or repr(meta)}"
            if path_name.casefold().startswith(REFUSED_PREFIXES):
                return raw, f"{name} declares a script or opaque object {path_name}"
            raw.add(f"{folder}/{path_name}".casefold())
    return raw, None


def _raw_problem(data: bytes) -> str | None:
    """A raw payload is read as bytes; one that is a pickle or a zip is a disguised one."""
    if data.startswith(ZIP_MAGIC):
        return "is a torch.save archive (pickled), not a raw payload"
    if _is_pickle(data):
        return _describe_pickle(data)
    return None


def _member_problem(name: str, data: bytes) -> str | None:
    if name.rpartition("/")[2].casefold().startswith(REFUSED_PREFIXES):
        return "is a script or opaque Python object"
    if not data or METADATA_RE.fullmatch(data):
        return None
    if name.casefold().endswith(".json") and _is_json(data):
        return None
    if data.startswith(ZIP_MAGIC):
        return "is a torch.save archive (pickled)"
    if _is_pickle(data):
        return _describe_pickle(data)
    return "is not data (neither JSON, archive metadata nor a declared raw payload)"


def _is_pickle(data: bytes) -> bool:
    """Whether `data` starts with a complete pickle (decoded, never executed)."""
    try:
        for _op in pickletools.genops(io.BytesIO(data)):
            pass
    except ValueError:
        return False
    return True


def _describe_pickle(data: bytes) -> str:
    """What a refused pickle would call, for the error message."""
    targets = _pickle_globals(data)
    if targets:
        return f"is a pickle that references {targets[0]}"
    return "is a pickle (neuronctl's graphs carry none)"


def _pickle_globals(data: bytes) -> list[str]:
    """The globals a pickle names, in order, decoded without executing anything."""
    stream: IO[bytes] = io.BytesIO(data)
    stack: list[Any] = []  # what recent opcodes pushed, as far as strings go
    memo: dict[int, Any] = {}
    found: list[str] = []
    try:
        for op, arg, _pos in pickletools.genops(stream):
            target = _global_target(op.name, arg, stack)
            if target is not None:
                found.append(target)
            _track(op.name, arg, stack, memo)
    except ValueError:
        pass
    return found


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
        check_export_graphs(root, manifest)
    except UnsafeGraphError as exc:
        return exc.message
    return None


def check_export_graphs(root: Path, manifest: Any) -> None:
    """Raise UnsafeGraphError for the first export graph that is not pure data. Run when an
    artifact is opened, since graphs load lazily and a refusal mid-request helps nobody."""
    spec = manifest.spec
    compiler = spec.get("compiler") if isinstance(spec, dict) else getattr(spec, "compiler", None)
    if manifest.backend != "torch" or compiler != "export":
        return
    for rel in manifest.graphs:
        check_export_graph(root / rel)
