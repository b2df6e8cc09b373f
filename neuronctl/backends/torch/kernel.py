"""neuronctl's own CPU ops for float32 compute, one library built from two sources
(and simd.h, the header they share).

- `neuronctl::linear_blocked` and `neuronctl::linear_rows` (gemv.cpp), the matmul, one code
  over two weight layouts. On a CPU without bf16 units, bf16 weights must be widened to
  float32 somewhere. aten and inductor do it per matmul or lane by lane; gemv.cpp does it in
  registers as the weights stream. int8 weights multiply the activations rounded to int16,
  with exact int32 sums. linear_blocked reads a blocked layout the runner makes at load time
  (`block`: each 4 output rows one stream); linear_rows reads the plain [N, K] matrix that
  aten and oneDNN read too, so where a measured choice gives one row count to the kernel and
  another to aten, one copy of the weights serves both. `linear` is the one entry: it takes
  either layout. One kernel serves token generation (a few rows) and context encoding (a
  bucket of rows).
- `neuronctl::attend` (attention.cpp), token generation's attention: one new token per row
  over the cache as it is stored (bf16 widened in registers), in one parallel region, where
  the traced graph widened the whole bucket of K and V and ran two MKL batched matmuls and a
  softmax around them.

`compile` builds the C++ on this host (torch.utils.cpp_extension, ~15 s once, the compiler
AOTInductor uses) into the user cache, keyed by the sources' digest and torch's version, and
puts a copy in the artifact (`kernels/`), as AOTInductor puts its own shared libraries there:
serving registers that copy and compiles nothing. The ops' schemas and shape functions live
here, so graphs trace and export without the library.
"""

from __future__ import annotations

import ctypes
import fcntl
import math
import mmap
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from neuronctl.backends.torch import arena, internals
from neuronctl.backends.torch.versions import KERNEL_SOURCES
from neuronctl.backends.torch.versions import kernel_digest as digest  # part of the graph key
from neuronctl.errors import BuildError, UsageError
from neuronctl.store.local import user_cache_store
from neuronctl.toolchain import installed_ninja

ROWS, CHUNK = 4, 16  # the blocked layout: [N/ROWS, K/CHUNK, ROWS, CHUNK]
LIBRARY_DIR = "kernels"


def fits(shape: tuple[int, ...]) -> bool:
    """A [N, K] weight the layout holds without padding (every Llama-family projection)."""
    return len(shape) == 2 and shape[0] % ROWS == 0 and shape[1] % CHUNK == 0


def block(weight: Tensor, out: Tensor | None = None) -> Tensor:
    """[N, K] -> [N/4, K/16, 4, 16]: each block of 4 rows one sequential stream (into `out`
    where given, e.g. a view of a huge-page arena)."""
    n, k = weight.shape
    blocks = weight.reshape(n // ROWS, ROWS, k // CHUNK, CHUNK).transpose(1, 2)
    return blocks.contiguous() if out is None else out.copy_(blocks)


def unblocked_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The [N, K] a blocked [N/4, K/16, 4, 16] tensor holds."""
    return shape[0] * ROWS, shape[1] * CHUNK


def huge_page_tensors(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, Tensor]:
    """Empty tensors of these shapes and dtypes, back to back (each on a cache line) in one
    anonymous mapping that asks Linux for 2 MiB pages; plain tensors where it cannot ask.

    A decode step streams every matrix once. On 4 KiB pages each page is a TLB miss and a
    place where the hardware prefetcher stops; on 2 MiB pages a step's matmuls at batch 1
    ran 0.99-1.16x as fast, by the hour's memory traffic (bench/kernel.py). Transparent
    huge pages in `madvise` mode (the usual default) honour the request; `never`, or a
    system without MADV_HUGEPAGE, gives plain pages and the same numbers. The loader writes
    each weight straight into its tensor here, so no second copy of the weights exists."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or not shapes:
        return {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in shapes.items()}
    sizes = {name: -(-math.prod(shape) * dtype.itemsize // 64) * 64
             for name, (shape, dtype) in shapes.items()}
    total = sum(sizes.values())
    mapping = arena.new_mapping(total)
    space = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping while views live
    out, offset = {}, 0
    for name, (shape, dtype) in shapes.items():
        nbytes = math.prod(shape) * dtype.itemsize
        out[name] = space[offset:offset + nbytes].view(dtype).view(shape)
        offset += sizes[name]
    return out


def into_huge_pages(
    weights: dict[str, Tensor], names: list[str],
    release: Callable[[Tensor], None] | None = None,
) -> None:
    """Move the tensors named, one by one and in place in `weights`, into one huge-page
    mapping (huge_page_tensors). Each tensor replaced is freed as the next is copied (a view
    of a mapping goes to `release`, which gives its pages back), so resident memory peaks one
    tensor above the weights, not at a second copy."""
    if getattr(mmap, "MADV_HUGEPAGE", None) is None:
        return
    views = huge_page_tensors({n: (tuple(weights[n].shape), weights[n].dtype) for n in names})
    for name in names:
        old, weights[name] = weights[name], views[name].copy_(weights[name])
        if release is not None:
            release(old)


def linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, scale: Tensor | None = None
) -> Tensor:
    """linear() by the kernel on a blocked [N/4, K/16, 4, 16] weight (`block`) or a plain
    [N, K] one that `fits`: products and sums in float32, the result in x's dtype. `scale`:
    int8 weights' one scale per output row."""
    ops = torch.ops.neuronctl
    op = ops.linear_rows if weight.dim() == 2 else ops.linear_blocked
    out = op(x.float(), weight, scale).to(x.dtype)
    return out if bias is None else out + bias.to(x.dtype)


def attention(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor) -> Tensor:
    """One new token's grouped-query attention over the cache (attention.cpp).

    q [B, Hq, 1, D] (computed in float32); k, v [B, Hkv, S, D] float32 or bf16, the bucket's
    view of the cache; row b attends to its first lengths[b] positions. -> [B, 1, Hq*D] in
    q's dtype."""
    return torch.ops.neuronctl.attend(q.float(), k, v, lengths).to(q.dtype)


def attention_fits(head_dim: int, cache: torch.dtype) -> bool:
    """The shapes and cache dtypes attend takes (every Llama-family head dim is)."""
    return head_dim % CHUNK == 0 and cache in (torch.float32, torch.bfloat16)


@cache
def register_ops() -> None:
    """Register the ops' schemas and shape functions with torch.library, once per process
    (tracing and export need nothing more; `load` and `load_from` add the implementation)."""
    torch.library.define(
        "neuronctl::linear_blocked", "(Tensor x, Tensor w, Tensor? scale) -> Tensor"
    )
    torch.library.define(
        "neuronctl::linear_rows", "(Tensor x, Tensor w, Tensor? scale) -> Tensor"
    )
    torch.library.define(
        "neuronctl::attend", "(Tensor q, Tensor k, Tensor v, Tensor lengths) -> Tensor"
    )

    @torch.library.register_fake("neuronctl::linear_blocked")
    def _shape(x: Tensor, w: Tensor, scale: Tensor | None) -> Tensor:
        return x.new_empty((*x.shape[:-1], w.shape[0] * w.shape[2]))

    @torch.library.register_fake("neuronctl::linear_rows")
    def _rows_shape(x: Tensor, w: Tensor, scale: Tensor | None) -> Tensor:
        return x.new_empty((*x.shape[:-1], w.shape[0]))

    @torch.library.register_fake("neuronctl::attend")
    def _attend_shape(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor) -> Tensor:
        return q.new_empty((q.shape[0], 1, q.shape[1] * q.shape[3]))


def library_stem() -> str:
    """The library's name without .so: what cpp_extension builds, and the artifact's copy."""
    return f"neuronctl_kernel_{digest()}"


def artifact_library() -> str:
    """Where an artifact carries the library its graphs call (relative to the artifact)."""
    return f"{LIBRARY_DIR}/{library_stem()}.so"


_library: Path | None = None  # the library that implements the op in this process


def load() -> Path:
    """Register the op's CPU implementation, compiling it on first use; the library's path.

    Compile-time only: serving registers the copy the artifact carries (load_from)."""
    global _library
    if _library is None:
        register_ops()
        _library = _build()
    return _library


def registered() -> bool:
    """Whether this process has registered the op's implementation already."""
    return _library is not None


def load_from(library: Path) -> None:
    """Register the op from an artifact's copy of the library: no compiler on the serving
    path. A process registers one library; the digest in the name is the source's."""
    global _library
    if _library is None:
        register_ops()
        # dlopen by this very path: torch.ops.load_library would resolve a verified copy's
        # /proc/self/fd/N to the memfd's name first, which cannot be opened.
        ctypes.CDLL(str(library))
        _library = library


def _build() -> Path:
    """Build the library in a child process under the build directory's lock; load it here.

    The child's compiler processes die with it, and it dies with us; a build that runs past
    the timeout is killed with every process below it, and fails."""
    build_dir = kernel_cache_dir()
    library = build_dir / f"{library_stem()}.so"
    if not _built(library):  # else: no child, no compiler, no lock
        build_dir.mkdir(parents=True, exist_ok=True)
        timeout = build_timeout()
        with build_lock(build_dir, timeout):
            # torch's own lock, which a killed build leaves behind: we hold the directory's
            # flock, so no live neuronctl build holds it.
            internals.clear_cpp_extension_baton(build_dir)
            _run_build_child(build_dir, timeout)
            _stamp(library)
    torch.ops.load_library(str(library))
    return library


def _stamp_of(library: Path) -> Path:
    return library.with_suffix(".built")


def _stamp(library: Path) -> None:
    """Note the finished library's size and mtime: a later load skips the build child."""
    st = library.stat()
    _stamp_of(library).write_text(f"{st.st_size} {st.st_mtime_ns}\n")


def _built(library: Path) -> bool:
    """The library a completed build stamped, unchanged since (a build killed while linking
    leaves no stamp; one rebuilding it changes the mtime)."""
    try:
        st = library.stat()
        return _stamp_of(library).read_text().split() == [str(st.st_size), str(st.st_mtime_ns)]
    except OSError:
        return False


BUILD_LOCK = "neuronctl-build.lock"
BUILD_TIMEOUT_ENV = "NEURONCTL_KERNEL_BUILD_TIMEOUT"
DEFAULT_BUILD_TIMEOUT = 900.0  # seconds; ~15 s on an idle host, minutes on a loaded one


def build_timeout() -> float:
    return timeout_from_env(BUILD_TIMEOUT_ENV, DEFAULT_BUILD_TIMEOUT, example=1800)


# The longest timeout a variable may set: a week. Waits hand the value to the OS's timers,
# which overflow far below float's range (1e308 or 9e18 s was an OverflowError mid-build).
MAX_TIMEOUT = 7 * 24 * 3600.0


def timeout_from_env(name: str, default: float, example: int) -> float:
    """Seconds from the variable `name`, else `default`; anything but a number in
    (0, MAX_TIMEOUT] is a usage error (a typo must not turn a timeout off)."""
    text = os.environ.get(name, "")
    if not text:
        return default
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= MAX_TIMEOUT:
        raise UsageError(
            f"{name}={text!r} is not a number of seconds in (0, {MAX_TIMEOUT:.0f}] (a week)",
            f"e.g. {name}={example}",
        )
    return seconds


@contextmanager
def build_lock(build_dir: Path, timeout: float) -> Iterator[None]:
    """One kernel build per directory at a time. A flock: the kernel drops it when its holder
    dies, so a killed build never blocks the next one. Polled, so Ctrl-C and the timeout
    apply while waiting."""
    fd = os.open(build_dir / BUILD_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise BuildError(
                        f"another process has been building neuronctl's CPU kernels in "
                        f"{build_dir} for over {timeout:.0f} s",
                        f"wait for it, or raise {BUILD_TIMEOUT_ENV}",
                    ) from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)


def _run_build_child(build_dir: Path, timeout: float) -> None:
    """cpp_extension.load in a child process in a new session, waited for with a timeout; on
    a timeout or an interrupt the child and every process below it are killed."""
    code = "import sys; from neuronctl.backends.torch.kernel import build_here; build_here()"
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(build_dir), str(os.getpid())],
        env=_build_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_build(child)
        raise BuildError(
            f"building neuronctl's CPU kernels did not finish in {timeout:.0f} s; killed it",
            f"raise {BUILD_TIMEOUT_ENV} on a slow host, or compile with --compiler export",
        ) from None
    except BaseException:  # Ctrl-C: nothing of the build may outlive us
        _kill_build(child)
        raise
    if child.returncode != 0:
        last = (stderr or "").strip().splitlines()[-12:]
        raise BuildError(
            "building neuronctl's CPU kernels (matmul, attention) failed:\n" + "\n".join(last),
            "install a C++ compiler and ninja (what AOTInductor needs too), or compile with "
            "--compiler export",
        )


def _kill_build(child: subprocess.Popen[str]) -> None:
    """SIGTERM: the child kills every process below it (workers.kill_tree), then itself;
    SIGKILL to its group if it has not within a few seconds."""
    child.send_signal(signal.SIGTERM)
    try:
        child.wait(KILL_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.wait()


KILL_GRACE_SECONDS = 5


def build_here() -> None:
    """The build child: `python -c ... BUILD_DIR PARENT_PID`. It and every process below it
    die with the parent (workers.die_with_parent)."""
    from torch.utils import cpp_extension

    from neuronctl.workers import die_with_parent

    build_dir, parent = sys.argv[1], int(sys.argv[2])
    die_with_parent(parent, whole_tree=True)
    register_ops()
    cpp_extension.load(
        name=library_stem(),
        sources=[str(source) for source in KERNEL_SOURCES if source.suffix == ".cpp"],
        extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=build_dir,
        is_python_module=False,
        verbose=False,
    )


def _build_env() -> dict[str, str]:
    """The build child's environment: ours, with the ninja neuronctl depends on put on PATH
    when PATH does not reach one (cpp_extension runs `ninja` from PATH;
    toolchain.installed_ninja, which doctor reports from too). Our own PATH stays as it is."""
    env = dict(os.environ)
    path = env.get("PATH")  # None: which() searches os.defpath, as the child's exec would
    if not shutil.which("ninja", path=path) and (found := installed_ninja()):
        env["PATH"] = os.pathsep.join([str(Path(found).parent), path or os.defpath])
    return env


def kernel_cache_dir() -> Path:
    """Where the built library lives: the user's own cache, like inductor's."""
    return user_cache_store() / "kernels" / f"torch{torch.__version__}-{digest()}"
