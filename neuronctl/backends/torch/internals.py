"""Every private corner of torch (and of the standard library's process pool) that neuronctl
relies on, in one place, behind plain functions.

torch promises nothing about these: a new torch can rename, move or drop any of them. So no
other module touches one (tests/test_torch_internals.py fails on any `torch._...`,
`torch.ops.<ns>._...`, private import or private getattr elsewhere), each is exercised on the
installed torch by the same test file, and pyproject.toml declares the torch range those
tests run on (TESTED_TORCH). A torch outside it fails those tests loudly, by name, instead of
failing a compile or a load halfway.

Nothing here imports torch at module level: host.py and safeload.py, which must answer
without torch, import from here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing.process import BaseProcess

    from torch import Tensor

# The torch minor version pyproject.toml allows and the tests run on (`make install`).
TESTED_TORCH = "2.13"


# --- loading and compiling graphs -------------------------------------------------------------


def aoti_package_loader(file: Path) -> Callable[[list[Tensor]], list[Tensor]]:
    """An AOTInductor package's model, called with its flat input list: the loader
    `torch._inductor.aoti_load_package` wraps, without importing inductor and dynamo (about
    2 s of a cold start). Arguments: model name, run single-threaded, threads, device index."""
    import torch

    loader = torch._C._aoti.AOTIModelPackageLoader(str(file), "model", False, 1, -1)
    return loader.run  # type: ignore[no-any-return]


def aoti_compile_and_package(program: Any, path: Path) -> None:
    """AOTInductor: an exported program compiled into a `.pt2` package at `path`."""
    import torch._inductor

    torch._inductor.aoti_compile_and_package(program, package_path=str(path))


def tree_unflatten(flat: list[Any], spec: Any) -> Any:
    """An exported program's (args, kwargs) from its flat inputs and its call spec."""
    from torch.utils import _pytree

    return _pytree.tree_unflatten(flat, spec)


# --- the host, as inductor sees it ------------------------------------------------------------


def inductor_isa() -> str:
    """The vector ISA inductor picks on this host ("" when it has none)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return str(pick_vec_isa())


def inductor_isas() -> set[str]:
    """Every vector ISA inductor can compile for here (it probes with the C++ compiler)."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    return {str(isa) for isa in valid_vec_isa_list()}


def cpp_compiler() -> str:
    """The C++ compiler inductor runs (recorded in the build facts)."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    return str(get_cpp_compiler())


# --- oneDNN and aten's int8 kernel ------------------------------------------------------------


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x @ weight.T by oneDNN on a weight `onednn_pack` packed (traced into graphs)."""
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def onednn_pack(weight: Tensor, batch_size: int) -> Tensor:
    """A [N, K] weight in oneDNN's blocked layout for `batch_size` rows."""
    import torch

    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_size)


def onednn_bf16() -> bool:
    """oneDNN computes bf16 natively on this CPU."""
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def int8_weight_mm(rows: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    """aten's weight-only int8 matmul: bf16 rows [M, K] by int8 weight [N, K], per-row
    scale [N]; float32 accumulation (traced into graphs)."""
    import torch

    return torch.ops.aten._weight_int8pack_mm(rows, weight, scale)


@contextmanager
def onednn_weights_as_inputs() -> Iterator[None]:
    """Inside the block, inductor lowers mkldnn._linear_pointwise to oneDNN's kernel with
    the weight a graph input; its own lowering is back afterwards, also on failure.

    Inductor's lowering asserts the weight is a frozen constant (it only offers the op for
    weights it prepacked itself); neuronctl never freezes weights into a graph, the runner
    passes them prepacked. The single extern-kernel choice is what that lowering picks
    without max-autotune; this lowering skips only the assertion and autotuning, and keeps
    the residual-add fusion (`x + linear(o)`, the binary form) inductor applies.
    """
    import torch
    from torch._inductor import ir, lowering, mkldnn_ir, mkldnn_lowerings  # noqa: F401

    def shaped(out: Any, size: list[Any]) -> Any:
        if not isinstance(out, ir.TensorBox):
            out = ir.TensorBox.create(out)
        if len(size) > 2:
            out = lowering.view(out, [*size[:-1], out.get_size()[-1]])
        return out

    def lower(
        x: Any, w: Any, b: Any, attr: Any, scalars: Any, algorithm: Any, layout: Any = None
    ) -> Any:
        size = x.get_size()
        if len(size) > 2:
            x = lowering.view(x, [-1, size[-1]])
        return shaped(mkldnn_ir.LinearUnary.create(x, w, b, attr, scalars, algorithm), size)

    def lower_binary(x: Any, y: Any, w: Any, b: Any, attr: Any, layout: Any = None) -> Any:
        size = x.get_size()
        if len(size) > 2:
            x = lowering.view(x, [-1, size[-1]])
            y = lowering.view(y, [-1, y.get_size()[-1]])
        return shaped(mkldnn_ir.LinearBinary.create(x, y, w, b, attr), size)

    ops = torch.ops.mkldnn._linear_pointwise
    ours: dict[Any, Any] = {ops.default: lower, ops.binary: lower_binary}
    saved = {key: lowering.lowerings.get(key) for key in ours}
    lowering.lowerings.update(ours)
    try:
        yield
    finally:
        for key, fn in saved.items():
            if fn is None:
                del lowering.lowerings[key]
            else:
                lowering.lowerings[key] = fn


# --- cpp_extension's build lock ---------------------------------------------------------------

# cpp_extension.load holds a FileBaton, a file of this name in the build directory that
# exists while a build runs (torch/utils/cpp_extension.py, torch/utils/file_baton.py). A
# killed build leaves it behind, and every later build waits on it forever.
CPP_EXTENSION_BATON = "lock"


def clear_cpp_extension_baton(build_dir: Path) -> None:
    """Remove a baton a killed build left; only while holding our own lock on the directory
    (no live build of ours holds the baton then)."""
    (build_dir / CPP_EXTENSION_BATON).unlink(missing_ok=True)


# --- the standard library's process pool -------------------------------------------------------


def pool_processes(pool: ProcessPoolExecutor) -> list[BaseProcess]:
    """The worker processes of a pool (before Python 3.14's kill_workers(), the only way to
    stop a pool whose workers are running: shutdown() waits for them)."""
    processes: dict[int, BaseProcess] = getattr(pool, "_processes", None) or {}
    return list(processes.values())


# --- the `.pt2` archive torch.export.save writes ---------------------------------------------

# torch.export.pt2_archive.constants: where payload configs live and the prefixes of pickled
# script and opaque objects. safeload.py judges an archive by them, before torch reads it.
PT2_PAYLOAD_DIRS = ("data/weights", "data/constants")
PT2_OBJECT_PREFIXES = ("custom_obj_", "opaque_obj_")
PT2_PAYLOAD_CONFIG_SUFFIX = "_config.json"
# A payload config: {"config": {name: {"path_name": member, "use_pickle": bool, ...}}}.
PT2_CONFIG_ENTRIES, PT2_PATH_NAME, PT2_USE_PICKLE = "config", "path_name", "use_pickle"
