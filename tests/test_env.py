"""`neuronctl env`: exports that round-trip through the shell, from the manifest only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from neuronctl.cli.main import app
from neuronctl.store.manifest import write_manifest
from tests.test_vllm import make_manifest


def artifact(tmp_path: Path, backend: str = "nxdi", **fields: object) -> Path:
    # A space and a quote in the path: the exports must survive the shell.
    path = tmp_path / "it's an artifact"
    path.mkdir()
    write_manifest(path, make_manifest(backend, **fields))
    return path


def test_bash_exports_round_trip(tmp_path: Path) -> None:
    path = artifact(tmp_path)
    result = CliRunner().invoke(app, ["env", str(path)])
    assert result.exit_code == 0, result.output
    script = result.output + 'printf "%s|%s|%s" "$NEURON_COMPILED_ARTIFACTS" '
    script += '"$NEURON_CC_FLAGS" "$NEURON_TOKEN_GEN_BUCKETS"'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout == f"{path.resolve()}|--model-type=transformer -O1|384,1024"


def test_json_shell(tmp_path: Path) -> None:
    path = artifact(tmp_path, "tnx", override_neuron_config={}, quantized=True)
    result = CliRunner().invoke(app, ["env", str(path), "--shell", "json"])
    assert result.exit_code == 0, result.output
    env = json.loads(result.output)
    assert env["VLLM_NEURON_FRAMEWORK"] == "transformers-neuronx"
    assert env["NEURON_QUANT_DTYPE"] == "s8"
    assert env["NEURON_CONTEXT_LENGTH_BUCKETS"] == "96,512"
    assert json.loads(CliRunner().invoke(app, ["env", str(path), "--json"]).output) == env


def test_fish_quoting(tmp_path: Path) -> None:
    path = artifact(tmp_path)
    result = CliRunner().invoke(app, ["env", str(path), "--shell", "fish"])
    assert result.exit_code == 0
    line = [x for x in result.output.splitlines() if "NEURON_COMPILED_ARTIFACTS" in x][0]
    assert (
        line
        == "set -gx NEURON_COMPILED_ARTIFACTS '" + str(path.resolve()).replace("'", "\\'") + "'"
    )


def test_exit_codes(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = subprocess.run(
        [sys.executable, "-m", "neuronctl.cli.main", "env", str(empty)],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 1
    assert "not an artifact" in missing.stderr
    path = artifact(tmp_path)
    wrong = subprocess.run(
        [sys.executable, "-m", "neuronctl.cli.main", "env", str(path), "--framework", "tnx"],
        capture_output=True,
        text=True,
    )
    assert wrong.returncode == 2
    assert "compiled for neuronx-distributed-inference" in wrong.stderr
