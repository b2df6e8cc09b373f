"""The memory the weights live in: their file mapped, faulted in before the loader needs it.

A torch artifact's weights are one file in the form the graphs take (weights.py). Loading maps
it privately (a stray write would change this process's copy, never the file), asks Linux for
2 MiB pages and faults every page in with madvise(MADV_POPULATE_READ) (Linux 5.14+, called
through ctypes, which releases the GIL; it changes no byte). On a kernel whose page cache
keeps large folios (ext4 and xfs on recent kernels) the populated mapping is made of 2 MiB
pages, as the anonymous huge-page arena this replaces was: a decode step streams every matrix,
and on 4 KiB pages each page is a TLB miss (kernel.huge_page_tensors). Where the file is not
in the page cache yet, populating it is the disk read.

`map_early` moves that off the loading thread without touching torch (this module imports only
the standard library, so it runs before `import torch`): a command that knows it will load an
artifact (`generate` and `serve`, through backends.prepare_load) maps the file and faults it
in on a second thread while the main thread imports torch, single-threaded, for seconds;
`take` hands the mapping to the loader when it maps the same file, which then checks the
header as always.
"""

from __future__ import annotations

import mmap
import os
import stat
import sys
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

GRAPH_WEIGHTS = "graph_weights.safetensors"  # in the artifact's weights/ (weights.py)
# Python's mmap module does not name it; kernels before 5.14 answer EINVAL.
MADV_POPULATE_READ = 22
HUGE_PAGE = 2 << 20
Ranges = Sequence[tuple[int, int]]  # (address, length), whole pages


class EarlyMapping:
    """A weights file mapped, and faulted in on a thread."""

    def __init__(self, path: Path) -> None:
        self.identity, self.mapping = _map(path)
        self._thread = threading.Thread(
            target=advise, args=([(address_of(self.mapping), len(self.mapping))],
                                 MADV_POPULATE_READ),
            daemon=True, name="neuronctl-map")
        self._thread.start()

    def wait(self) -> mmap.mmap:
        self._thread.join()
        return self.mapping


_early: EarlyMapping | None = None
_lock = threading.Lock()


def map_early(artifact: Path) -> None:
    """Map and fault in a torch artifact's weights file ahead of the load, on a thread.
    Nothing where there is no such file (another backend's artifact), off Linux, or where
    the file takes more than half the memory available (the load then maps it as it goes).
    The manifest is not read here: the reuse checks read it, once, and the load judges
    the mapping against it (take: the same file, else mapped afresh)."""
    global _early
    path = artifact / "weights" / GRAPH_WEIGHTS
    if sys.platform != "linux" or not path.is_file():
        return
    from neuronctl.store.owned import others_can_write

    if others_can_write(artifact):  # the load rule will refuse it: a mapping of a file
        return  # others can truncate is a SIGBUS waiting in this process
    try:
        if path.stat().st_size > available_memory() // 2:
            return
        early = EarlyMapping(path)
    except (OSError, ValueError):
        return  # loading says what is wrong with it
    with _lock:
        _early = early


def take(path: Path) -> mmap.mmap | None:
    """The early mapping, faulted in, when it maps the file now at `path` (the same device,
    inode, size and mtime: a file replaced in between is mapped afresh); None otherwise.
    Taken once."""
    global _early
    with _lock:
        early, _early = _early, None
    if early is None:
        return None
    mapping = early.wait()
    try:  # the file, not its name: an artifact can be reached by more than one path
        same = _identity(os.stat(path)) == early.identity
    except OSError:
        same = False
    if not same:
        mapping.close()
        return None
    return mapping


def map_file(path: Path) -> mmap.mmap:
    """`path` mapped privately, asked for 2 MiB pages, and faulted in."""
    _, mapping = _map(path)
    advise([(address_of(mapping), len(mapping))], MADV_POPULATE_READ)
    return mapping


def _map(path: Path) -> tuple[tuple[int, int, int, int], mmap.mmap]:
    """ValueError for anything but a regular file: opening a FIFO for reading would wait for
    a writer (O_NONBLOCK opens it at once), and `generate` and `serve` map before vouching
    for the artifact, which may be any directory named on the command line."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file")
        identity = _identity(st)
        mapping = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping holds the file
    _ask_for_huge_pages(mapping)
    return identity, mapping


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def huge_share(mapping: mmap.mmap) -> float:
    """The share of the mapping's whole 2 MiB pieces that are mapped as 2 MiB pages
    (/proc/self/smaps FilePmdMapped); 1.0 where it has none or smaps cannot be read (then
    nothing is done about it)."""
    pieces = len(mapping) // HUGE_PAGE * HUGE_PAGE
    if not pieces:
        return 1.0
    start = f"{address_of(mapping):x}-"
    try:
        with open("/proc/self/smaps") as smaps:
            fields = _entry_fields(smaps, start)
    except OSError:
        return 1.0
    return fields.get("FilePmdMapped", 0) / pieces


def _entry_fields(lines: Iterable[str], start: str) -> dict[str, int]:
    """The kB fields of the smaps entry whose address range begins with `start`."""
    fields: dict[str, int] = {}
    inside = False
    for line in lines:
        if line[:1] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
            if inside:
                break
            inside = line.startswith(start)
        elif inside and line.rstrip().endswith(" kB"):
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0]) * 1024
    return fields


def anonymous_huge_pages() -> bool:
    """Whether an anonymous mapping advised MADV_HUGEPAGE gets 2 MiB pages here."""
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode and hasattr(mmap, "MADV_HUGEPAGE")


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


def new_mapping(nbytes: int) -> mmap.mmap:
    """An anonymous private mapping that asks for 2 MiB pages where Linux offers them."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    _ask_for_huge_pages(mapping)
    return mapping


def _ask_for_huge_pages(mapping: mmap.mmap) -> None:
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None and len(mapping):
        mapping.madvise(advice)


def address_of(mapping: mmap.mmap) -> int:
    import ctypes

    pointer = ctypes.c_char.from_buffer(mapping)
    address = ctypes.addressof(pointer)
    del pointer  # releases the buffer export: the mapping can be closed later
    return address


def advise(ranges: Ranges, advice: int) -> bool:
    """madvise(advice) over each range, GIL released; False where the kernel refuses it
    (populating then happens page by page as the pages are first read, as it would anyway)."""
    if sys.platform != "linux":
        return False
    import ctypes

    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return all(madvise(address, length, advice) == 0 for address, length in ranges)
