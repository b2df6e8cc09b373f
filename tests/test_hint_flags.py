"""Every flag an error, a hint or a command's help names exists: in the commands the text
names (`neuronctl compile ... --jobs`; a command's help: that command too), else in some
command. Flags of the other programs neuronctl drives are listed with their program."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer.main

from neuronctl.cli.main import app

PACKAGE = Path(__file__).resolve().parents[1] / "neuronctl"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_]*(?:-[a-z0-9_]+)*")
# A command named in a text: `neuronctl compile`, `neuronctl artifacts push`, `compile ...`.
COMMAND = re.compile(r"(?:\bneuronctl |`(?!neuronctl))(?:(?:artifacts|config) )?([a-z]+)")
# Flags of other programs that neuronctl's errors and hints name on purpose.
OTHER_PROGRAMS = {
    "--cache_dir": "neuronx-cc's, in NEURON_CC_FLAGS",
    "--target": "neuronx-cc's, in NEURON_CC_FLAGS",
    "--block-size": "vLLM's engine argument",
    "--private_key": "model_signing's (OpenSSF model-signing CLI)",
    "--public_key": "model_signing's (OpenSSF model-signing CLI)",
    "--head": "Ray's (`ray start --head`)",
}


def command_flags() -> dict[str, set[str]]:
    """Command name -> its flags; "" -> the root's (they go before any command)."""
    root = typer.main.get_command(app)
    flags: dict[str, set[str]] = {"": _flags(root)}

    def walk(group: Any) -> None:
        for name, command in group.commands.items():
            flags.setdefault(name, set()).update(_flags(command))
            if hasattr(command, "commands"):
                walk(command)

    walk(root)
    return flags


def _flags(command: Any) -> set[str]:
    return {o for p in command.params for o in (*p.opts, *p.secondary_opts) if o[:2] == "--"}


def _text(node: ast.AST) -> Iterator[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, ast.JoinedStr):
        yield "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    elif isinstance(node, ast.BinOp):
        yield from _text(node.left)
        yield from _text(node.right)


def said_to_users(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """The texts of errors (calls of a *Error class: message and hint) and of every `hint`
    keyword or variable."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = getattr(func, "id", None) or getattr(func, "attr", "")
            values = [*node.args, *(k.value for k in node.keywords)] if name.endswith(
                "Error") else [k.value for k in node.keywords if k.arg == "hint"]
            for value in values:
                yield from ((node.lineno, text) for text in _text(value))
        elif isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "hint" for t in node.targets
        ):
            yield from ((node.lineno, text) for text in _text(node.value))


def allowed_flags(text: str, flags: dict[str, set[str]]) -> set[str]:
    """The root's flags and those of every command `text` names; every flag when it names
    none."""
    named = [flags[name] for name in COMMAND.findall(text) if name in flags]
    return flags[""].union(*named) if named else set().union(*flags.values())


def wrong(text: str, allowed: set[str]) -> list[str]:
    return [f for f in FLAG.findall(text) if f not in allowed and f not in OTHER_PROGRAMS]


def unknown_flags(root: Path, flags: dict[str, set[str]]) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for line, text in said_to_users(ast.parse(path.read_text())):
            found += [f"{path.relative_to(root.parent)}:{line}: {flag}"
                      for flag in wrong(text, allowed_flags(text, flags))]
    return sorted(found)


def unknown_help_flags(flags: dict[str, set[str]]) -> list[str]:
    """Per paragraph of each command's help and each option's: flags that are neither the
    command's own nor those of a command the paragraph names."""
    found = []

    def walk(group: Any, prefix: str) -> None:
        for name, command in group.commands.items():
            texts = [command.help or "", *(getattr(p, "help", None) or "" for p in command.params)]
            for paragraph in (p for text in texts for p in text.split("\n\n")):
                allowed = allowed_flags(paragraph, flags) | _flags(command)
                found.extend(f"{prefix}{name}: {flag}" for flag in wrong(paragraph, allowed))
            if hasattr(command, "commands"):
                walk(command, f"{prefix}{name} ")

    walk(typer.main.get_command(app), "")
    return found


def test_every_flag_an_error_or_hint_names_exists() -> None:
    assert unknown_flags(PACKAGE, command_flags()) == []


def test_every_flag_a_command_help_names_exists() -> None:
    assert unknown_help_flags(command_flags()) == []


def test_a_flag_that_does_not_exist_is_found(tmp_path: Path) -> None:
    """The check itself: a hint naming a flag no command has, or naming a command with a flag
    only another command has, fails; the same text with real flags passes."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text(
        "def f():\n"
        "    raise BuildError('graph timed out', 'use --workers 1')\n"
        "def g():\n"
        "    hint = 'run `neuronctl generate --jobs 2`'\n"
        "def h():\n"
        "    raise UsageError('x', hint=f'use --jobs {n} or neuronctl compile --jobs 1')\n"
    )
    found = unknown_flags(package, command_flags())
    assert found == ["pkg/m.py:2: --workers", "pkg/m.py:4: --jobs"]


def test_every_other_program_flag_is_still_named() -> None:
    """An entry no error names any more goes, so the list stays short."""
    texts = [text for path in PACKAGE.rglob("*.py")
             for _, text in said_to_users(ast.parse(path.read_text()))]

    def walk(group: Any) -> None:
        for command in group.commands.values():
            texts.extend([command.help or "", *(getattr(p, "help", None) or ""
                                                for p in command.params)])
            if hasattr(command, "commands"):
                walk(command)

    walk(typer.main.get_command(app))
    named = {flag for text in texts for flag in FLAG.findall(text)}
    assert set(OTHER_PROGRAMS) - named == set()


BENCH = PACKAGE.parent / "bench"
GROUPS = ("artifacts", "config")


def bench_command_lines(root: Path) -> Iterator[tuple[str, int, str, list[str]]]:
    """(file, line, command, flags) of each list literal in `root`'s scripts that runs a
    neuronctl command: its first string element naming a command (a group's: the next one
    too), and the flags after it (the root's go before the command, so they are not its)."""
    names = set(command_flags()) - {""}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.List):
                continue
            strings = [e.value for e in node.elts
                       if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            at = next((i for i, s in enumerate(strings) if s in names), None)
            if at is None:
                continue
            if strings[at] in GROUPS and at + 1 < len(strings) and strings[at + 1] in names:
                at += 1
            flags = [s.split("=")[0] for s in strings[at + 1:] if FLAG.fullmatch(s.split("=")[0])]
            yield path.name, node.lineno, strings[at], flags


def test_every_flag_a_bench_passes_to_neuronctl_exists() -> None:
    """The benches run neuronctl as users do and are not in the test run: a renamed flag
    (`serve --log-level`, now the root's) broke every served bench unseen until a bench ran."""
    flags = command_flags()
    found = [f"bench/{name}:{line}: {command} {flag}"
             for name, line, command, given in bench_command_lines(BENCH)
             for flag in given if flag not in flags[command] | {"--help"}]
    assert found == []


def test_a_bench_flag_that_does_not_exist_is_found(tmp_path: Path) -> None:
    (tmp_path / "b.py").write_text(
        "argv = [exe, 'serve', '--port', str(p), '--log-level', 'warning']\n"
        "other = ['curl', '--data', 'x']\n"
    )
    assert list(bench_command_lines(tmp_path)) == [("b.py", 1, "serve", ["--port", "--log-level"])]
