"""What `neuronctl generate` imports on its way to the first token.

A cold start is `import torch` plus whatever else the command imports and runs: these tests
pin the modules it must not import (bench/coldstart.py measures the time; speed stays out of
unit tests). Each runs the real command in a fresh interpreter and lists `sys.modules` at exit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Run the CLI's main() and write the names of every imported module to argv[1] at exit.
AUDIT = """
import atexit, json, sys
out = sys.argv[1]
atexit.register(lambda: json.dump(sorted(sys.modules), open(out, "w")))
sys.argv = ["neuronctl", *sys.argv[2:]]
from neuronctl.cli.main import main
main()
"""

# Never needed to generate from a local build: other commands' modules and what only they use
# (the build and its locks, remote stores and their fsspec, signature checks, garbage
# collection), and the Hugging Face libraries (the engine's tokenizer reads tokenizer.json
# with `tokenizers`).
NOT_FOR_GENERATE = (
    "neuronctl.build",
    "neuronctl.cli.artifacts",
    "neuronctl.cli.compile",
    "neuronctl.cli.remote",
    "neuronctl.cli.serve",
    "neuronctl.server",
    "neuronctl.store.gc",
    "neuronctl.store.remote",
    "cryptography",
    "filelock",
    "fsspec",
    "transformers",
    "huggingface_hub",
)
# torch's compiler stack: an AOTInductor graph loads through torch's package loader alone.
# (An export graph cannot avoid it: torch.export.load imports torch._dynamo itself.)
COMPILER_STACK = ("torch._dynamo", "torch._inductor", "sympy")


def audited_generate(audit: str, artifact: Path, out: Path, *args: str) -> Any:
    """Generate one token from `artifact` (or run `args` instead) in a fresh process under the
    `audit` program, which writes what it saw to `out`; what it wrote."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    args = args or ("generate", str(artifact), "--prompt", "Hello", "--max-tokens", "1")
    done = subprocess.run([sys.executable, "-c", audit, str(out), *args], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text())


def imported_by_generate(artifact: Path, tmp_path: Path) -> set[str]:
    return set(audited_generate(AUDIT, artifact, tmp_path / "modules.json"))


def present(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return [n for n in names if any(m == n or m.startswith(n + ".") for m in modules)]


def test_generate_imports_only_its_own_command(compiled_artifact: Path, tmp_path: Path) -> None:
    modules = imported_by_generate(compiled_artifact, tmp_path)
    assert "neuronctl.cli.generate" in modules and "torch" in modules  # it did run
    assert present(modules, NOT_FOR_GENERATE) == []


@pytest.mark.slow
def test_inductor_generate_skips_torchs_compiler_stack(
    tiny_llama: Path, tmp_path: Path
) -> None:
    from neuronctl.build import compile_model, resolve_build

    spec = {"compiler": "inductor", "dtype": "float32", "seq_len": 64,
            "max_context_length": 32, "context_buckets": "32", "token_gen_buckets": "64"}
    built = compile_model(resolve_build(str(tiny_llama), spec, store_dir=tmp_path / "store"),
                          jobs=1)
    modules = imported_by_generate(Path(built.path), tmp_path)
    assert present(modules, NOT_FOR_GENERATE + COMPILER_STACK) == []


# Run the CLI's main() and write to argv[1], at exit, whether torch was imported at each call
# of backends.prepare_load, and whether each arena.take handed the loader a mapping.
PREPARE_AUDIT = """
import atexit, json, sys
import neuronctl.backends as backends
from neuronctl.backends.torch import arena
out, seen, real, real_take = sys.argv[1], [], backends.prepare_load, arena.take
def prepare_load(path):
    seen.append(["prepare", "torch" in sys.modules])
    real(path)
def take(path):
    mapping = real_take(path)
    seen.append(["take", mapping is not None])
    return mapping
backends.prepare_load, arena.take = prepare_load, take
atexit.register(lambda: json.dump(seen, open(out, "w")))
sys.argv = ["neuronctl", *sys.argv[2:]]
from neuronctl.cli.main import main
main()
"""


def test_generate_maps_the_weights_before_it_imports_torch_and_loads_from_that_mapping(
    compiled_artifact: Path, tmp_path: Path
) -> None:
    """The weights file is mapped and faulted in on another core while `import torch` runs
    (arena.py): only if generate asks for it first; and the loader uses that mapping."""
    seen = audited_generate(PREPARE_AUDIT, compiled_artifact, tmp_path / "seen.json")
    assert seen == [["prepare", False], ["take", sys.platform == "linux"]]


def test_serve_maps_the_weights_before_it_imports_torch_too(
    compiled_artifact: Path, tmp_path: Path
) -> None:
    """`serve` loads the artifact as `generate` does (a dry run loads it and prints its plan
    without binding a port): the weights file is mapped before torch is imported, and the
    loader takes that mapping."""
    seen = audited_generate(PREPARE_AUDIT, compiled_artifact, tmp_path / "seen.json",
                            "serve", str(compiled_artifact), "--dry-run")
    assert seen == [["prepare", False], ["take", sys.platform == "linux"]]


def test_the_arena_module_imports_no_torch() -> None:
    """backends.prepare_load runs before torch is imported: what it imports must not import
    torch itself, or the reservation would wait for the import it is meant to overlap."""
    code = ("import sys, neuronctl.backends, neuronctl.backends.torch.arena; "
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.stdout.strip() == "False", done.stderr


def test_root_value_options_are_the_ones_app_for_skips() -> None:
    """app_for finds the command by skipping root options; one that takes a value and is not
    in ROOT_VALUE_OPTIONS would make its value look like the command's name."""
    import typer

    from neuronctl.cli.main import ROOT_VALUE_OPTIONS, full_app

    root = typer.main.get_command(full_app())
    takes_value = {name for p in root.params if not (p.is_flag or p.count)  # type: ignore[attr-defined]
                   for name in p.opts}
    assert takes_value == set(ROOT_VALUE_OPTIONS)


def test_app_for_registers_one_command_only_where_its_module_is_all_of_it() -> None:
    from neuronctl.cli.main import app_for, full_app

    def commands(app: object) -> list[str]:
        return [info.name for info in app.registered_commands]  # type: ignore[attr-defined]

    assert commands(app_for(["-v", "--log-level", "info", "generate", "ART"])) == ["generate"]
    assert commands(app_for(["--log-level=info", "serve", "--help"])) == ["serve"]
    # groups gather subcommands from several modules; no command, --help or a typo: all of them
    for args in (["config", "migrate"], ["artifacts", "push"], ["--help"], [], ["generat"],
                 ["--log-level", "generate"], ["--", "generate"]):
        assert app_for(args) is full_app(), args
