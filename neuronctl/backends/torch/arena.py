"""Memory for the blocked weights, faulted in before the loader writes to it.

The kernel's blocked matrices live in one anonymous mapping that asks Linux for 2 MiB pages
(kernel.huge_page_tensors). The first write to each page stops for a page fault in which the
kernel zeroes it. On a 2-core AMD EPYC VM, faulting in the 270 MB arena of the
SmolLM2-135M-shaped bf16 artifact took 0.04-1.1 s of CPU in a fresh process (bimodal, where
4 KiB pages took a steady 0.15-0.2 s: a 2 MiB block the VM's host has to back again is
slow), 10 % of a cold `generate`'s CPU in one perf profile (`clear_page_erms` under the
blocking copy), all of it on the one thread that loads.

`reserve` moves it off that thread, without touching torch (this module imports only the
standard library, so it runs before `import torch`): a command that knows it will load an
artifact (`generate`, through backends.prepare_load) maps the arena and faults it in on a
second thread while the main thread imports torch, single-threaded, for seconds; `take`
hands it to the loader, which finds every page in place.

Faulting in is madvise(MADV_POPULATE_WRITE) (Linux 5.14+), called through ctypes, which
releases the GIL; it changes no byte. Where it is not available nothing is faulted in ahead
and the loader's writes fault the pages in as before.
"""

from __future__ import annotations

import logging
import mmap
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

# Python's mmap module does not name it; kernels before 5.14 answer EINVAL.
MADV_POPULATE_WRITE = 23
Ranges = Sequence[tuple[int, int]]  # (address, length), whole pages


class Reservation:
    """An anonymous mapping of `nbytes`, asked for 2 MiB pages, faulted in on a thread."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.mapping = new_mapping(nbytes)
        self._thread = threading.Thread(
            target=populate, args=([(address_of(self.mapping), nbytes)],), daemon=True,
            name="neuronctl-reserve")
        self._thread.start()

    def wait(self) -> mmap.mmap:
        self._thread.join()
        return self.mapping


_reserved: Reservation | None = None
_lock = threading.Lock()


def reserve(nbytes: int) -> None:
    """Start faulting in a mapping of `nbytes` for the next `take` (replacing one not taken).
    A no-op off Linux, where MADV_POPULATE_WRITE does not exist."""
    global _reserved
    if sys.platform != "linux" or nbytes <= 0:
        return
    with _lock:
        _reserved = Reservation(nbytes)


def reserve_for(artifact: Path) -> None:
    """Reserve the arena for a torch artifact whose matrices are blocked (the manifest's op
    choice), as large as its weight files: the blocked matrices are some of the tensors the
    files hold, fused or tied ones included, so never larger. Nothing for other artifacts, or
    where that would take more than half the memory available (then loading finds out)."""
    from neuronctl.errors import NeuronctlError
    from neuronctl.store.manifest import read_manifest

    try:
        manifest = read_manifest(artifact)
    except NeuronctlError:
        return  # loading says what is wrong with it
    # "blocked" is opchoice.BLOCKED, which imports torch
    if manifest.backend != "torch" or manifest.ops is None or manifest.ops.layout != "blocked":
        return
    try:
        nbytes = sum(f.stat().st_size for f in (artifact / "weights").glob("*.safetensors")
                     if f.is_file())
    except OSError:
        return
    if nbytes and nbytes <= available_memory() // 2:
        reserve(nbytes)


def available_memory() -> int:
    """MemAvailable from /proc/meminfo, in bytes; 0 where it cannot be read."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def take(nbytes: int) -> mmap.mmap | None:
    """The reserved mapping when it holds `nbytes`, once faulted in; its pages past `nbytes`
    are given back. None when nothing, or too little, was reserved (then it is dropped)."""
    global _reserved
    with _lock:
        reservation, _reserved = _reserved, None
    if reservation is None:
        return None
    mapping = reservation.wait()
    if reservation.nbytes < nbytes:
        logger.debug("reserved %d bytes, the weights take %d: not used", reservation.nbytes,
                     nbytes)
        mapping.close()
        return None
    spare = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    if spare < reservation.nbytes:
        mapping.madvise(mmap.MADV_DONTNEED, spare, reservation.nbytes - spare)
    return mapping


def new_mapping(nbytes: int) -> mmap.mmap:
    """An anonymous private mapping that asks for 2 MiB pages where Linux offers them."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        mapping.madvise(advice)
    return mapping


def address_of(mapping: mmap.mmap) -> int:
    import ctypes

    pointer = ctypes.c_char.from_buffer(mapping)
    address = ctypes.addressof(pointer)
    del pointer  # releases the buffer export: the mapping can be closed later
    return address


def populate(ranges: Ranges) -> bool:
    """madvise(MADV_POPULATE_WRITE) over each range, GIL released; False where the kernel
    does not offer it (the pages then fault in when first written, as they would anyway)."""
    import ctypes

    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return all(madvise(address, length, MADV_POPULATE_WRITE) == 0 for address, length in ranges)
