"""`neuronctl env`: exports that round-trip through the shell, per vLLM generation, from the
manifest only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from neuronctl.cli.main import app
from neuronctl.store.manifest import write_manifest
from tests import standins
from tests.test_vllm import PLUGIN_EP, fake_dist, make_manifest

neuron_standins = standins.neuron_standins  # the stand-in SDK fixture


def artifact(tmp_path: Path, backend: str = "nxdi", **fields: object) -> Path:
    # A space and a quote in the path: the exports must survive the shell.
    path = tmp_path / "it's an artifact"
    path.mkdir()
    write_manifest(path, make_manifest(backend, **fields))
    return path


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "neuronctl.cli.main", *args], capture_output=True, text=True
    )


def test_bash_exports_round_trip(tmp_path: Path) -> None:
    path = artifact(tmp_path)
    result = CliRunner().invoke(app, ["env", str(path), "--vllm-target", "plugin@0.4.1"])
    assert result.exit_code == 0, result.output
    script = result.output + 'printf "%s|%s|%s" "$NEURON_COMPILED_ARTIFACTS" '
    script += '"$NEURON_CC_FLAGS" "$NEURON_ON_DEVICE_SAMPLING_DISABLED"'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    # The default nxdi build samples on device: no variable (C never gets it anyway).
    assert out.stdout == f"{path.resolve()}|--model-type=transformer -O1|"


def test_env_takes_a_key_or_prefix_like_every_command(  # type: ignore[no-untyped-def]
    neuron_standins, tiny_llama, tmp_path
) -> None:
    from tests.test_nxdi import compile_nxdi

    store = tmp_path / "store"
    build, outcome = compile_nxdi(tiny_llama, store)
    key = outcome.path.name
    for ref in (key, key[:8], str(outcome.path)):
        result = CliRunner().invoke(
            app, ["env", ref, "--store", str(store), "--vllm-target", "plugin@0.4.1", "--json"]
        )
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["NEURON_COMPILED_ARTIFACTS"] == str(outcome.path)
    missing = CliRunner().invoke(app, ["env", "ffff0000", "--store", str(store)])
    assert missing.exit_code == 1


def test_json_shell_for_a_tnx_fork(tmp_path: Path) -> None:
    path = artifact(tmp_path, "tnx", quantized=True)
    args = ["env", str(path), "--vllm-target", "tnx-fork", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    env = json.loads(result.output)
    assert env["VLLM_NEURON_FRAMEWORK"] == "transformers-neuronx"
    assert env["NEURON_QUANT_DTYPE"] == "s8"
    assert env["NEURON_CONTEXT_LENGTH_BUCKETS"] == "96,512"
    assert json.loads(CliRunner().invoke(app, [*args[:4], "--json"]).output) == env


def test_each_generation_gets_its_own_variables(tmp_path: Path) -> None:
    path = artifact(tmp_path)
    envs = {}
    for target in ("v0@0.9.2", "plugin@0.4.1"):
        result = CliRunner().invoke(app, ["env", str(path), "--vllm-target", target, "--json"])
        assert result.exit_code == 0, result.output
        envs[target] = json.loads(result.output)
    assert envs["v0@0.9.2"]["VLLM_NEURON_FRAMEWORK"] == "neuronx-distributed-inference"
    assert "VLLM_NEURON_FRAMEWORK" not in envs["plugin@0.4.1"]  # the plugin has no such choice


def test_installed_plugin_is_detected(tmp_path: Path) -> None:
    """With no --vllm-target, the installed vLLM decides (real package metadata on PYTHONPATH)."""
    site = tmp_path / "site"
    fake_dist(site, "vllm", "0.13.0")
    fake_dist(site, "vllm-neuron", "0.4.1", PLUGIN_EP)
    fake_dist(site, "optimum-neuron", "0.3.0", "[vllm.platform_plugins]\noptimum = o:r\n")
    path = artifact(tmp_path)
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    out = subprocess.run(
        [sys.executable, "-m", "neuronctl.cli.main", "env", str(path), "--json"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["VLLM_PLUGINS"] == "neuron"


def test_fish_quoting(tmp_path: Path) -> None:
    path = artifact(tmp_path)
    result = CliRunner().invoke(app, ["env", str(path), "--vllm-target", "v0", "--shell", "fish"])
    assert result.exit_code == 0
    line = [x for x in result.output.splitlines() if "NEURON_COMPILED_ARTIFACTS" in x][0]
    assert (
        line
        == "set -gx NEURON_COMPILED_ARTIFACTS '" + str(path.resolve()).replace("'", "\\'") + "'"
    )


def test_exit_codes(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = cli("env", str(empty))
    assert missing.returncode == 1
    assert "not an artifact" in missing.stderr
    path = artifact(tmp_path)
    wrong = cli("env", str(path), "--framework", "tnx", "--vllm-target", "v0")
    assert wrong.returncode == 2
    assert "compiled for neuronx-distributed-inference" in wrong.stderr
    no_vllm = cli("env", str(path))
    assert no_vllm.returncode == 2 and "--vllm-target" in no_vllm.stderr
    refused = cli("env", str(path), "--vllm-target", "tnx-fork@0.5.0")
    assert refused.returncode == 1 and "only the Transformers NeuronX loader" in refused.stderr
    native = cli("env", str(path), "--vllm-target", "native")
    assert native.returncode == 2 and "generation C" in native.stderr
