"""The private corners of torch, typer and the process pool that neuronctl relies on.

Each lives in one module (backends/torch/internals.py; the CLI's typer ones in
cli/_typer_internals.py). The first test fails when any other module reaches one; the rest
exercise each on the installed torch and typer, so a version that lacks or changed one fails
here, by name, and pyproject.toml allows only the versions these tests run on.
"""

from __future__ import annotations

import ast
import inspect
import re
import tomllib
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from neuronctl.backends.torch import internals

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "neuronctl"
SHIMS = {PACKAGE / "backends/torch/internals.py", PACKAGE / "cli/_typer_internals.py"}
GUARDED = ("torch", "typer")  # packages whose private names only the shims may use
PRIVATE_ATTRIBUTES = {"_processes"}  # the standard library's, read by getattr


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _dotted(node: ast.AST) -> list[str]:
    """["torch", "ops", "mkldnn", "_linear_pointwise"] for that attribute chain, else []."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return []


def private_uses(source: str) -> list[str]:
    """The private torch/typer names a module's code reaches (imports, attribute chains
    rooted at the package) and the private attributes it reads by getattr."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute):
            names = [".".join(_dotted(node))]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant)
              and node.args[1].value in PRIVATE_ATTRIBUTES):
            found.append(f"{line}: {node.func.id}(..., {node.args[1].value!r})")
            continue
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] in GUARDED and any(_private(part) for part in parts[1:]):
                found.append(f"{line}: {name}")
    return sorted(set(found), key=lambda use: int(use.split(":")[0]))


def test_only_the_shims_touch_private_torch_typer_or_pool_internals() -> None:
    offenders = {
        str(path.relative_to(ROOT)): uses
        for path in sorted(PACKAGE.rglob("*.py")) if path not in SHIMS
        if (uses := private_uses(path.read_text()))
    }
    assert offenders == {}, "use backends/torch/internals.py (or cli/_typer_internals.py)"


def test_the_guard_sees_each_way_of_reaching_a_private_name() -> None:
    source = "\n".join([
        "import torch._inductor.lowering",
        "from torch._inductor import ir",
        "from torch.utils import _pytree",
        "from typer._click.core import ParameterSource",
        "x = torch._C._aoti.AOTIModelPackageLoader",
        "y = torch.ops.mkldnn._linear_pointwise(a)",
        "typer.rich_utils._get_parameter_help = f",
        "getattr(pool, '_processes', None)",
        "ok = torch.__version__, torch.ops.neuronctl.attend, getattr(h, '_neuronctl', 0)",
    ])
    lines = {int(use.split(":")[0]) for use in private_uses(source)}
    assert lines == set(range(1, 9))


# --- the declared versions -----------------------------------------------------------------


def _requirement(name: str) -> Requirement:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return next(r for r in map(Requirement, project["dependencies"]) if r.name == name)


def test_pyproject_allows_exactly_the_torch_minor_these_tests_run_on() -> None:
    installed = Version(torch.__version__.split("+")[0])
    spec = _requirement("torch").specifier
    assert installed in spec
    assert f"{installed.major}.{installed.minor}" == internals.TESTED_TORCH
    major, minor = map(int, internals.TESTED_TORCH.split("."))
    assert Version(f"{major}.{minor + 1}") not in spec  # the next minor is untested
    assert Version(f"{major}.{minor - 1}") not in spec
    make = (ROOT / "Makefile").read_text()
    assert re.search(rf"torch=={re.escape(internals.TESTED_TORCH)}\.\d+", make)


def test_pyproject_allows_only_the_typer_minor_these_tests_run_on() -> None:
    import typer

    installed = Version(typer.__version__)
    spec = _requirement("typer").specifier
    assert installed in spec
    assert Version(f"{installed.major}.{installed.minor + 1}") not in spec


# --- each private use, exercised ------------------------------------------------------------


def test_the_aoti_package_loader_takes_its_five_arguments() -> None:
    # A changed signature is a TypeError; the right one reaches the file and fails there.
    with pytest.raises(RuntimeError, match="zip archive|file open"):
        internals.aoti_package_loader(Path("/nonexistent/graph.pt2"))


def test_aoti_compile_and_package_takes_a_package_path() -> None:
    import torch._inductor

    assert "package_path" in inspect.signature(torch._inductor.aoti_compile_and_package).parameters


def test_tree_unflatten_inverts_torchs_flatten() -> None:
    from torch.utils import _pytree

    value = ((torch.zeros(1), {"w": torch.ones(2)}), {})
    flat, spec = _pytree.tree_flatten(value)
    args, kwargs = internals.tree_unflatten(flat, spec)
    assert kwargs == {} and args[1]["w"] is flat[1]


def test_inductors_host_probes_answer() -> None:
    assert isinstance(internals.inductor_isa(), str)
    assert isinstance(internals.inductor_isas(), set)
    assert internals.cpp_compiler()


def test_onednn_packs_and_multiplies() -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    torch.manual_seed(0)
    x, weight, bias = torch.randn(3, 32), torch.randn(16, 32), torch.randn(16)
    packed = internals.onednn_pack(weight, 3)
    got = internals.onednn_linear(x, packed, bias)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias))
    assert isinstance(internals.onednn_bf16(), bool)


def test_the_int8_weight_matmul_scales_each_row() -> None:
    torch.manual_seed(0)
    rows = torch.randn(2, 64).bfloat16()
    weight = torch.randint(-127, 128, (8, 64), dtype=torch.int8)
    scale = torch.rand(8).bfloat16()
    got = internals.int8_weight_mm(rows, weight, scale)
    want = (rows.float() @ weight.float().T) * scale.float()
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=1e-1)


def test_inductors_lowering_table_is_its_own_again_after_a_packed_build() -> None:
    """The oneDNN linear lowering is replaced only inside the build, also when it fails."""
    from torch._inductor import lowering, mkldnn_lowerings  # noqa: F401

    ops = [torch.ops.mkldnn._linear_pointwise.default, torch.ops.mkldnn._linear_pointwise.binary]
    before = {op: lowering.lowerings.get(op) for op in ops}
    assert all(before.values()), "inductor no longer lowers oneDNN's linear"
    with pytest.raises(RuntimeError, match="the compile failed"):
        with internals.onednn_weights_as_inputs():
            assert all(lowering.lowerings[op] is not before[op] for op in ops)
            raise RuntimeError("the compile failed")
    assert {op: lowering.lowerings.get(op) for op in ops} == before


def test_cpp_extension_still_locks_its_build_with_that_file() -> None:
    from torch.utils import cpp_extension

    baton = f"FileBaton(os.path.join(build_directory, '{internals.CPP_EXTENSION_BATON}'))"
    assert baton in inspect.getsource(cpp_extension)


def _square(n: int) -> int:
    return n * n


def test_the_pool_shows_its_worker_processes() -> None:
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("fork")) as pool:
        assert pool.submit(_square, 3).result() == 9
        processes = internals.pool_processes(pool)
        assert len(processes) == 1 and processes[0].is_alive()


def test_the_pt2_archive_layout_is_the_one_safeload_judges(tmp_path: Path) -> None:
    """safeload.py refuses pickles by where torch puts payload configs and objects
    (torch/export/pt2_archive/constants.py, _package.py's payload config entries)."""
    from torch.export.pt2_archive import constants

    assert internals.PT2_PAYLOAD_DIRS == (constants.WEIGHTS_DIR.rstrip("/"),
                                          constants.CONSTANTS_DIR.rstrip("/"))
    assert internals.PT2_OBJECT_PREFIXES == (constants.CUSTOM_OBJ_FILENAME_PREFIX,
                                             constants.OPAQUE_OBJ_FILENAME_PREFIX)
    for fmt in (constants.WEIGHTS_CONFIG_FILENAME_FORMAT,
                constants.CONSTANTS_CONFIG_FILENAME_FORMAT):
        assert fmt.endswith(internals.PT2_PAYLOAD_CONFIG_SUFFIX)
    # A saved program with a weight: its config names the member and how it is stored.
    import json
    import zipfile

    program = torch.export.export(torch.nn.Linear(4, 2), (torch.zeros(1, 4),))
    torch.export.save(program, str(tmp_path / "p.pt2"))
    with zipfile.ZipFile(tmp_path / "p.pt2") as archive:
        configs = [n for n in archive.namelist()
                   if n.endswith(internals.PT2_PAYLOAD_CONFIG_SUFFIX)
                   and internals.PT2_PAYLOAD_DIRS[0] in n]
        assert configs, archive.namelist()
        entries = json.loads(archive.read(configs[0]))[internals.PT2_CONFIG_ENTRIES]
    assert entries and all({internals.PT2_PATH_NAME, internals.PT2_USE_PICKLE} <= set(e)
                           for e in entries.values())


def test_typers_private_parts_are_where_the_cli_takes_them() -> None:
    import typer.rich_utils

    from neuronctl.cli import _typer_internals
    from neuronctl.cli.main import _HelpTable

    assert issubclass(_typer_internals.ClickException, Exception)
    assert issubclass(_typer_internals.NoArgsIsHelpError, _typer_internals.ClickException)
    assert _typer_internals.ParameterSource.COMMANDLINE != _typer_internals.ParameterSource.DEFAULT
    assert typer.rich_utils.Table is _HelpTable  # fold_help took: --help draws with it
    assert typer.rich_utils._get_parameter_help.__name__ == "folded"
