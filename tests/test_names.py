"""One name per idea: no module-level constant (UPPER_CASE) and no public function or class
name is defined in two modules of the package. A second definition is either the same value
kept twice (import it instead) or another idea under the same name (rename one)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "neuronctl"

# The same role in several modules, each module's own value, read by one protocol.
ALLOWED = {
    # cli/main.py discovers every cli/<name>.py and reads these from each.
    "ORDER": "cli command modules: their place in --help",
    "HELP": "cli command modules: the help text where the docstring cannot hold it",
    "register": "cli command modules: how cli/main.py adds the module's commands",
    "main": "the entry point of a module run as a program (python -m)",
    # The two Neuron backends: each fills the same slot with its own SDK's values.
    "PACKAGES": "each Neuron backend's SDK packages",
    "INSTALL": "each Neuron backend's install hint, from its PACKAGES",
    "unavailable": "each Neuron backend's error for a missing SDK package",
    "neuron_config_kwargs": "each Neuron backend's NeuronConfig arguments from a spec",
    # backends/torch/kernel.py calls neuronctl's C++ ops by the operation they implement,
    # beside attention.py's and linear.py's aten versions of the same operation.
    "attention": "one operation: attention.py's aten version, kernel.py's C++ op",
    "linear": "one operation: linear.py's aten version, kernel.py's C++ op",
}


DEFINITIONS = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def module_names(tree: ast.Module) -> set[str]:
    """Public functions and classes, and assignments named in UPPER_CASE (constants) or
    CamelCase (type aliases), at module level; not a module's variables (logger, app)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, DEFINITIONS):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name) and t.id[0].isupper())
    return {name for name in names if not name.startswith("_")}


def definitions(root: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        for name in module_names(ast.parse(path.read_text(), rel)):
            found[name].append(rel)
    return found


def test_no_name_is_defined_in_two_modules() -> None:
    twice = {
        name: modules
        for name, modules in definitions(PACKAGE).items()
        if len(modules) > 1 and name not in ALLOWED
    }
    assert twice == {}, "define it once and import it, or rename one of them"


def test_a_name_defined_twice_fails(tmp_path: Path) -> None:
    """The check itself: two modules with one constant, or one function, fail it."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text('DTYPES = ("bfloat16",)\ndef resolve(x):\n    return x\n')
    (package / "b.py").write_text('DTYPES = {"BF16": 1}\nclass resolve:\n    pass\n_private = 1\n')
    (package / "c.py").write_text("local_variable = 1\n_private = 2\n")
    found = {n: m for n, m in definitions(package).items() if len(m) > 1}
    assert found == {"DTYPES": ["pkg/a.py", "pkg/b.py"], "resolve": ["pkg/a.py", "pkg/b.py"]}


def test_every_allowed_name_is_still_defined_twice() -> None:
    """An entry nobody needs any more goes, so the list stays short."""
    found = definitions(PACKAGE)
    stale = [name for name in ALLOWED if len(found.get(name, [])) < 2]
    assert stale == []


# The names that scripts outside the package import (the real-source check of the vLLM and
# Neuron SDK launches drives neuronctl through them): a rename here breaks them silently.
PUBLIC_NAMES = {
    "neuronctl.backends.nxdi": ["GRAPH", "NEURON_CONFIG", "NxdiBackend", "expected_files",
                                "fused_spec_config", "sdk", "shard_name"],
    "neuronctl.backends.nxdi.config": ["neuron_config_kwargs"],
    "neuronctl.backends.tnx": ["make_neuron_config"],
    "neuronctl.backends.tnx.config": ["MODEL_TYPES", "from_pretrained_kwargs"],
    "neuronctl.checkpoints.registry": ["ARCHITECTURES"],
    "neuronctl.vllm": ["NXDI", "PLUGIN_ENTRY", "TNX", "Target", "generate_launch",
                       "plan_launch", "serve_launch", "vllm_dirname_exact"],
    "neuronctl.vllm.dirname": ["no_vllm_dirname"],
    "neuronctl.migrate": ["ROWS", "SUB_CONFIGS", "TABLE", "migrate_tnx"],
    "neuronctl.spec": ["BuildSpec", "OnDeviceSampling", "auto_buckets", "build_spec"],
    "neuronctl.vllm_generations": ["Generation", "version_tuple"],
}


def test_the_names_scripts_outside_import_are_there() -> None:
    import importlib

    missing = [f"{module}.{name}" for module, names in PUBLIC_NAMES.items()
               for name in names if not hasattr(importlib.import_module(module), name)]
    assert missing == []
    from neuronctl.checkpoints.registry import ARCHITECTURES
    from neuronctl.families import architectures

    assert ARCHITECTURES["nxdi"] == architectures("nxdi")
    from neuronctl.backends.nxdi import shard_name

    # NxD Inference's save_sharded_checkpoint layout, which the check compares against.
    assert shard_name(1) == "weights/tp1_sharded_checkpoint.safetensors"
