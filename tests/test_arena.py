"""The weights file mapped and faulted in, early or at load (backends/torch/arena.py)."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from pathlib import Path

import pytest
import torch

from neuronctl.backends.torch import arena
from neuronctl.backends.torch.layout import is_matrix
from neuronctl.backends.torch.weights import load_graph_weights, release
from tests.helpers import graph_weights_qwen2

MiB = 1 << 20
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_READ is Linux's")


def resident(address: int, nbytes: int) -> int:
    """Pages of [address, address + nbytes) in this process's memory (mincore)."""
    start = address // mmap.PAGESIZE * mmap.PAGESIZE
    pages = -(-(address + nbytes - start) // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    mincore = ctypes.CDLL(None, use_errno=True).mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert mincore(start, pages * mmap.PAGESIZE, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


def mapped_pages(address: int, nbytes: int) -> int:
    """Pages of the range this process has mapped in its page tables (/proc/self/pagemap's
    present bit: mincore would also count page-cache pages this process never mapped)."""
    first, last = address // mmap.PAGESIZE, (address + nbytes - 1) // mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = pagemap.read((last - first + 1) * 8)
    return sum(entries[i + 7] >> 7 & 1 for i in range(0, len(entries), 8))


@pytest.fixture(autouse=True)
def nothing_mapped_early() -> None:
    arena.take(Path("/"))  # a test's early mapping never reaches the next one


def test_map_file_faults_the_file_in_privately(tmp_path: Path) -> None:
    file = tmp_path / "w.bin"
    data = os.urandom(3 * MiB + 123)
    file.write_bytes(data)
    mapping = arena.map_file(file)
    address = arena.address_of(mapping)
    assert mapping[:] == data
    if not mapped_pages(address, len(mapping)):
        pytest.skip("this kernel has no MADV_POPULATE_READ (Linux < 5.14)")
    assert mapped_pages(address, len(mapping)) == -(-len(data) // mmap.PAGESIZE)
    mapping[:5] = b"stray"  # a write changes this process's copy, never the file
    assert file.read_bytes() == data


def test_take_hands_over_the_early_mapping_of_the_same_file_once(
    tmp_path: Path, compiled_artifact: Path
) -> None:
    art = artifact_with_weights(tmp_path / "art", compiled_artifact, b"w" * (2 * MiB))
    file = art / "weights" / arena.GRAPH_WEIGHTS
    assert arena.take(file) is None  # nothing mapped early
    arena.map_early(art)
    mapping = arena.take(file)
    assert mapping is not None and mapping[:] == file.read_bytes()
    assert arena.take(file) is None  # taken once
    other = tmp_path / "other.safetensors"
    other.write_bytes(b"o" * MiB)
    arena.map_early(art)
    assert arena.take(other) is None  # another file: dropped
    assert arena.take(file) is None
    arena.map_early(art)
    assert arena.take(art / "weights" / ".." / "weights" / arena.GRAPH_WEIGHTS) is not None
    # The file replaced between the early map and the load (a new inode): mapped afresh.
    arena.map_early(art)
    replaced = file.with_suffix(".new")
    replaced.write_bytes(b"n" * (2 * MiB))
    os.replace(replaced, file)
    assert arena.take(file) is None


def test_map_early_maps_only_a_torch_artifacts_weights_and_reads_no_manifest(
    tmp_path: Path, compiled_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reuse checks read manifest.json once per command; the early mapping, which runs
    before them, decides by the torch weights file alone (no other backend writes it)."""
    import neuronctl.store.manifest as manifest_mod

    def no_read(*_args: object) -> bytes:
        raise AssertionError("map_early read the manifest")

    monkeypatch.setattr(manifest_mod, "read_capped", no_read)
    art = artifact_with_weights(tmp_path / "art", compiled_artifact, b"w" * MiB)
    arena.map_early(art)
    assert arena._early is not None
    arena._early = None
    (art / "weights" / arena.GRAPH_WEIGHTS).unlink()  # as an nxdi or tnx artifact
    arena.map_early(art)
    assert arena._early is None


@pytest.mark.parametrize("tied,quantized", [(True, False), (False, True)])
def test_loaded_weights_are_views_of_the_early_mapping(
    tmp_path: Path, tied: bool, quantized: bool, compiled_artifact: Path
) -> None:
    weights_dir, args = graph_weights_qwen2(tmp_path / "w", tied, quantized, blocked=True)
    plain = load_graph_weights(weights_dir, args, torch.bfloat16, quantized, False, True)
    art = artifact_with_weights(tmp_path / "art", compiled_artifact,
                                (weights_dir / arena.GRAPH_WEIGHTS).read_bytes())
    arena.map_early(art)
    mapping = arena._early.mapping  # type: ignore[union-attr]
    start = arena.address_of(mapping)
    got = load_graph_weights(art / "weights", args, torch.bfloat16, quantized, False, True)
    assert arena._early is None  # taken
    assert all(start <= t.data_ptr() < start + len(mapping) for t in got.values())
    assert list(got) == list(plain)
    for name in plain:
        assert torch.equal(got[name], plain[name]), name


def test_release_gives_a_weights_pages_back_and_keeps_it_readable(tmp_path: Path) -> None:
    weights_dir, args = graph_weights_qwen2(tmp_path, False, False, blocked=False)
    got = load_graph_weights(weights_dir, args, torch.bfloat16, False, False, False)
    name = max(got, key=lambda n: got[n].numel())
    tensor = got[name]
    nbytes = tensor.numel() * tensor.element_size()
    before = tensor.clone()
    if not mapped_pages(tensor.data_ptr(), nbytes):
        pytest.skip("this kernel has no MADV_POPULATE_READ (Linux < 5.14)")
    release(tensor)
    # Only whole pages inside the tensor go: its first and last may hold its neighbours.
    assert mapped_pages(tensor.data_ptr(), nbytes) <= 2
    assert torch.equal(tensor, before)  # read again from the file


def artifact_with_weights(art: Path, compiled_artifact: Path, data: bytes) -> Path:
    """A copy of a torch artifact's manifest, with `data` as its weights file."""
    (art / "weights").mkdir(parents=True)
    (art / "manifest.json").write_bytes((compiled_artifact / "manifest.json").read_bytes())
    (art / "weights" / arena.GRAPH_WEIGHTS).write_bytes(data)
    return art


def test_blocked_matrices_move_to_anonymous_huge_pages_where_the_file_maps_as_small_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page cache without 2 MiB folios (an older kernel or filesystem) maps the file as
    4 KiB pages: the blocked matrices the kernel streams are copied into an anonymous mapping
    advised for 2 MiB pages, and everything else stays a view of the file."""
    weights_dir, args = graph_weights_qwen2(tmp_path, True, False, blocked=True)
    mapped = load_graph_weights(weights_dir, args, torch.bfloat16, False, False, True)
    monkeypatch.setattr(arena, "huge_share", lambda mapping: 0.0)
    monkeypatch.setattr(arena, "anonymous_huge_pages", lambda: True)
    got = load_graph_weights(weights_dir, args, torch.bfloat16, False, False, True)
    file = str(weights_dir / arena.GRAPH_WEIGHTS)
    for name, tensor in got.items():
        assert torch.equal(tensor, mapped[name]), name
        in_file = mapping_name(tensor.data_ptr()) == file
        assert in_file != is_matrix(name), name
    monkeypatch.setattr(arena, "anonymous_huge_pages", lambda: False)  # THP "never": stay
    got = load_graph_weights(weights_dir, args, torch.bfloat16, False, False, True)
    assert all(mapping_name(t.data_ptr()) == file for t in got.values())


def test_huge_share_reads_this_mappings_own_smaps_entry(tmp_path: Path) -> None:
    file = tmp_path / "w.bin"
    file.write_bytes(bytes(4 * MiB))
    mapping = arena.map_file(file)
    share = arena.huge_share(mapping)
    assert 0.0 <= share <= 1.0
    smaps = [f"{arena.address_of(mapping) - 8192:x}-{arena.address_of(mapping):x} rw-p 0 0:0 0",
             "Rss:                 8 kB", "FilePmdMapped:    2048 kB",
             f"{arena.address_of(mapping):x}-{arena.address_of(mapping) + 4 * MiB:x} rw-p 0 "
             f"fd:00 12 {file}", "Rss:              4096 kB", "FilePmdMapped:    2048 kB",
             "VmFlags: rd wr mr mw me ac hg", "7f00-7f01 r--p 0 0:0 0", "Rss: 4 kB"]
    fields = arena._entry_fields(smaps, f"{arena.address_of(mapping):x}-")
    assert fields == {"Rss": 4 * MiB, "FilePmdMapped": 2 * MiB}
    small = tmp_path / "small.bin"
    small.write_bytes(bytes(MiB))  # no whole 2 MiB piece: nothing to judge
    assert arena.huge_share(arena.map_file(small)) == 1.0


def mapping_name(address: int) -> str:
    """The path (or "") of the mapping that holds `address` (/proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in span.split("-"))
        if start <= address < end:
            return rest[4].strip() if len(rest) == 5 else ""
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_weights_file_that_is_a_fifo_is_neither_waited_on_nor_mapped(
    tmp_path: Path, compiled_artifact: Path
) -> None:
    """`generate` maps the weights before it has vouched for the artifact, which may be any
    directory: a FIFO in the weights file's place must not block it (opening one for reading
    waits for a writer), and the loader refuses it with a clear error."""
    import threading

    from neuronctl.backends.torch.config import args_from_config
    from neuronctl.errors import CheckpointError
    from neuronctl.store.manifest import read_manifest

    art = artifact_with_weights(tmp_path / "art", compiled_artifact, b"")
    (art / "weights" / arena.GRAPH_WEIGHTS).unlink()
    os.mkfifo(art / "weights" / arena.GRAPH_WEIGHTS)
    early = threading.Thread(target=arena.map_early, args=(art,), daemon=True)
    early.start()
    early.join(10)
    assert not early.is_alive() and arena._early is None
    with pytest.raises(ValueError, match="not a regular file"):
        arena.map_file(art / "weights" / arena.GRAPH_WEIGHTS)
    args = args_from_config(read_manifest(compiled_artifact).architecture)
    with pytest.raises(CheckpointError, match="has no graph_weights"):
        load_graph_weights(art / "weights", args, torch.bfloat16, False, False, False)


def test_weights_written_in_whole_pieces_map_as_2_mib_pages_where_tensor_writes_do_not(
    tmp_path: Path,
) -> None:
    """The page cache gives a buffered write folios no larger than the write: the weights
    file is written through PageWriter (aligned 2 MiB pieces) so that its mapping is 2 MiB
    pages while the file is still in the page cache from compile; the same bytes written in
    tensor-sized pieces are not."""
    from neuronctl.backends.torch.weights import PageWriter

    data = os.urandom(6 * MiB + 4321)
    probe = tmp_path / "probe.bin"
    probe.write_bytes(data[:4 * MiB])  # one aligned write: the best this host can do
    if arena.huge_share(arena.map_file(probe)) == 0.0:
        pytest.skip("file mappings get no 2 MiB pages here (no large folios, or THP off)")
    pieces = [1000, 300_000, 2 * MiB + 17, 64, 3 * MiB, len(data)]  # tensor-like sizes
    written = {}
    for how in ("tensor writes", "PageWriter"):
        file = tmp_path / f"{how}.bin"
        with open(file, "wb", buffering=0) as raw:
            out = PageWriter(raw) if how == "PageWriter" else raw
            at = 0
            for size in pieces:
                out.write(data[at:at + size])
                at = min(len(data), at + size)
            if isinstance(out, PageWriter):
                out.flush()
        assert file.read_bytes() == data
        written[how] = arena.huge_share(arena.map_file(file))
    assert written["PageWriter"] == 1.0
    assert written["tensor writes"] < written["PageWriter"]
