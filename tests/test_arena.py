"""The blocked weights' memory, faulted in ahead of the loader (backends/torch/arena.py)."""

from __future__ import annotations

import ctypes
import json
import mmap
import shutil
import sys
from pathlib import Path

import pytest
import torch

from neuronctl.backends.torch import arena
from neuronctl.backends.torch.layout import is_matrix
from tests.helpers import sharded_qwen2

MiB = 1 << 20
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_WRITE is Linux's")


def resident(mapping: mmap.mmap) -> int:
    """Pages of `mapping` in memory (mincore)."""
    pages = -(-len(mapping) // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    mincore = ctypes.CDLL(None, use_errno=True).mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert mincore(arena.address_of(mapping), len(mapping), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


@pytest.fixture(autouse=True)
def nothing_reserved() -> None:
    arena.take(0)  # a test's reservation never reaches the next one


def test_populate_faults_pages_in_and_changes_no_byte() -> None:
    mapping = mmap.mmap(-1, 4 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_NOHUGEPAGE)  # 4 KiB pages: a write faults one in, not 2 MiB
    mapping[5:10] = b"hello"
    mapping[3 * MiB:3 * MiB + 2] = b"ok"
    assert resident(mapping) < 4 * MiB // mmap.PAGESIZE
    if not arena.populate([(arena.address_of(mapping), len(mapping))]):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert resident(mapping) == 4 * MiB // mmap.PAGESIZE
    assert mapping[5:10] == b"hello" and mapping[3 * MiB:3 * MiB + 2] == b"ok"
    assert mapping[:5] == bytes(5) and mapping[-7:] == bytes(7)


def test_take_hands_over_a_faulted_in_reservation_once_and_only_when_large_enough() -> None:
    assert arena.take(MiB) is None  # nothing reserved
    arena.reserve(8 * MiB)
    assert arena.take(16 * MiB) is None  # too small: dropped, not kept for later
    assert arena.take(MiB) is None
    arena.reserve(8 * MiB)
    mapping = arena.take(3 * MiB)
    assert mapping is not None and len(mapping) == 8 * MiB
    assert arena.take(MiB) is None
    if resident(mapping):  # faulted in (Linux 5.14+): the pages past the 3 MiB are given back
        assert resident(mapping) == 3 * MiB // mmap.PAGESIZE


@pytest.mark.parametrize("tied,quantized", [(True, False), (False, False), (False, True)])
def test_a_reservation_of_the_weight_files_size_holds_the_blocked_matrices(
    tmp_path: Path, tied: bool, quantized: bool
) -> None:
    # reserve_for reserves the weight files' size: the blocked matrices (fused, a tied head
    # blocked beside the plain embedding) must fit in it, and load exactly as without it.
    from neuronctl.backends.torch.weights import load_graph_weights

    weights_dir, args = sharded_qwen2(tmp_path, 2, tied, quantized)
    plain = load_graph_weights(weights_dir, args, torch.bfloat16, quantized, False, True)
    nbytes = sum(f.stat().st_size for f in weights_dir.glob("*.safetensors"))
    arena.reserve(nbytes)
    mapping = arena._reserved.mapping  # type: ignore[union-attr]
    start = arena.address_of(mapping)
    got = load_graph_weights(weights_dir, args, torch.bfloat16, quantized, False, True)
    assert arena._reserved is None  # taken
    blocked = [n for n in got if is_matrix(n)]
    assert blocked and all(start <= got[n].data_ptr() < start + nbytes for n in blocked)
    assert list(got) == list(plain)
    for name in plain:
        assert torch.equal(got[name], plain[name]), name


def test_reserve_for_reserves_only_for_a_torch_artifact_with_blocked_weights(
    tmp_path: Path, compiled_artifact: Path
) -> None:
    art = tmp_path / "art"
    (art / "weights").mkdir(parents=True)
    (art / "weights" / "tp0_sharded_checkpoint.safetensors").write_bytes(bytes(3 * MiB))
    (art / "weights" / "tp1_sharded_checkpoint.safetensors").write_bytes(bytes(MiB))
    manifest = json.loads((compiled_artifact / "manifest.json").read_text())
    for layout, reserved in (("plain", None), ("blocked", 4 * MiB)):
        manifest["ops"] = {**(manifest.get("ops") or {"rows": []}), "layout": layout}
        (art / "manifest.json").write_text(json.dumps(manifest))
        arena.reserve_for(art)
        assert (arena._reserved and arena._reserved.nbytes) == reserved, layout
        arena.take(0)
    shutil.rmtree(art / "weights")
    (art / "manifest.json").write_text("{not json")
    arena.reserve_for(art)  # loading says what is wrong; nothing here
    assert arena._reserved is None
