"""Process-wide state: set through neuronctl/process.py alone, and values passed, not the
environment, where the reader is neuronctl's own code."""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from neuronctl import process
from neuronctl.errors import NotFoundError
from tests.helpers import run_in_process

PACKAGE = Path(__file__).resolve().parents[1] / "neuronctl"
# Where each kind of process-wide state may be set (process.py's docstring names them).
ALLOWED = {
    "environment": {"process.py"},
    "torch threads": {"process.py"},
    "atexit": {"process.py"},
    "torch.library": {"backends/torch/kernel.py"},
}
ENVIRON_WRITES = {"pop", "update", "setdefault", "clear", "__setitem__", "__delitem__"}


def _name(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def global_writes(source: str) -> list[tuple[str, int]]:
    """(kind, line) of each process-wide change the module's code makes."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            for target in targets:
                if isinstance(target, ast.Subscript) and _name(target.value) == "os.environ":
                    found.append(("environment", node.lineno))
        if not isinstance(node, ast.Call):
            continue
        called = _name(node.func)
        if called in ("os.putenv", "os.unsetenv") or (
            called.startswith("os.environ.") and called.split(".")[-1] in ENVIRON_WRITES
        ):
            found.append(("environment", node.lineno))
        elif called in ("torch.set_num_threads", "torch.set_num_interop_threads"):
            found.append(("torch threads", node.lineno))
        elif called in ("atexit.register", "atexit.unregister"):
            found.append(("atexit", node.lineno))
        elif called.startswith("torch.library.") or called == "torch.ops.load_library":
            found.append(("torch.library", node.lineno))
    return found


def test_process_wide_state_is_set_in_its_one_place() -> None:
    misplaced = [
        f"{path.relative_to(PACKAGE)}:{line}: {kind}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for kind, line in global_writes(path.read_text())
        if str(path.relative_to(PACKAGE)) not in ALLOWED[kind]
    ]
    assert misplaced == [], "set it through neuronctl/process.py (see its docstring)"


def test_the_scan_sees_each_kind_of_write() -> None:
    source = "\n".join([
        "os.environ['A'] = '1'",
        "os.environ.pop('A', None)",
        "os.putenv('A', '1')",
        "torch.set_num_threads(1)",
        "atexit.register(f)",
        "torch.library.define('x::y', '() -> ()')",
        "env = {**os.environ}; os.environ.get('A'); dict(os.environ)",
    ])
    assert [line for _, line in global_writes(source)] == [1, 2, 3, 4, 5, 6]


def test_environment_sets_unsets_and_restores_also_on_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NEURONCTL_TEST_KEPT", "before")
    monkeypatch.delenv("NEURONCTL_TEST_NEW", raising=False)
    with pytest.raises(RuntimeError):
        with process.environment({"NEURONCTL_TEST_KEPT": None, "NEURONCTL_TEST_NEW": "1"}):
            assert "NEURONCTL_TEST_KEPT" not in os.environ
            assert os.environ["NEURONCTL_TEST_NEW"] == "1"
            raise RuntimeError
    assert os.environ["NEURONCTL_TEST_KEPT"] == "before"
    assert "NEURONCTL_TEST_NEW" not in os.environ


def test_torch_threads_are_given_back() -> None:
    before = torch.get_num_threads()
    with process.torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_debug_is_a_value_not_a_variable_left_for_the_next_command(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--debug wrote NEURONCTL_DEBUG=1 into the environment: every later command in the
    process (and every child) showed tracebacks too."""
    monkeypatch.delenv("NEURONCTL_DEBUG", raising=False)
    monkeypatch.setenv("NEURONCTL_STORE", str(tmp_path))
    args = ["generate", "nosuchkey", "--prompt", "hi"]
    with pytest.raises(NotFoundError):  # the traceback: main re-raises
        run_in_process(["--debug", *args], capsys, monkeypatch)
    assert "NEURONCTL_DEBUG" not in os.environ
    code, _, err = run_in_process(args, capsys, monkeypatch)
    assert code == 1 and err.startswith("error: no artifact 'nosuchkey'")
    assert "Traceback" not in err
