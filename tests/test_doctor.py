"""`doctor`: every branch, with package lookups, devices and neuron-ls monkeypatched."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import neuronctl.doctor as doctor
from neuronctl import toolchain
from neuronctl.checks import Check
from neuronctl.cli.main import app

runner = CliRunner()

CORE = {
    "torch": "2.13.0",
    "transformers": "5.23.0",
    "huggingface_hub": "2.4.0",
    "safetensors": "0.5.0",
}
NEURON = {
    "neuronx-cc": "2.16.372.0",
    "torch-neuronx": "2.5.1.2.4.0",
    "neuronx-distributed-inference": "0.1.1",
    "transformers-neuronx": "0.13.322",
}


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """A fake host: installed dists, importable modules, vLLM's directory, devices."""
    state: dict[str, Any] = {
        "dists": dict(CORE),
        "modules": {"torch", "transformers", "huggingface_hub", "safetensors"},
        "vllm_dir": None,
        "neuron_ls": None,
        "devices": [],
        "plugins": (),
        "instance": "",
    }
    monkeypatch.setattr(doctor, "dist_version", lambda name: state["dists"].get(name))
    monkeypatch.setattr(doctor, "module_found", lambda name: name in state["modules"])
    monkeypatch.setattr(doctor, "vllm_dir", lambda: state["vllm_dir"])
    monkeypatch.setattr(doctor, "neuron_ls", lambda: state["neuron_ls"])
    monkeypatch.setattr(doctor, "neuron_device_paths", lambda: state["devices"])
    monkeypatch.setattr(doctor, "platform_plugins", lambda: state["plugins"])
    monkeypatch.setattr(doctor, "instance_type", lambda: state["instance"])
    monkeypatch.delenv("VLLM_NEURON_FRAMEWORK", raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setenv("NEURONCTL_STORE", str(tmp_path / "store"))
    return state


def _install_neuron(state: dict[str, Any]) -> None:
    state["dists"].update(NEURON)
    state["modules"] |= {
        "neuronxcc",
        "torch_neuronx",
        "neuronx_distributed_inference",
        "transformers_neuronx",
    }


def _by_name(report: doctor.DoctorReport) -> dict[str, Check]:
    return {f.name: f for f in report.checks}


def test_cpu_host_is_ready_for_torch_and_says_how_to_install_neuron(host: dict) -> None:
    report = doctor.diagnose("torch")
    assert report.healthy
    found = _by_name(report)
    assert found["torch"].ok and found["torch"].reason == "2.13.0"
    cc = found["neuronx-cc"]
    assert not cc.ok and not cc.required and "not installed" in cc.reason
    assert "--extra-index-url https://pip.repos.neuron.amazonaws.com neuronx-cc" in cc.fix
    assert found["neuron devices"].ok  # the torch backend runs without devices


@pytest.mark.parametrize(
    ("backend", "missing"),
    [
        ("nxdi", {"neuronx-cc", "torch-neuronx", "neuronx-distributed-inference"}),
        ("tnx", {"neuronx-cc", "torch-neuronx", "transformers-neuronx"}),
    ],
)
def test_neuron_backends_require_their_packages(host: dict, backend: str, missing: set) -> None:
    report = doctor.diagnose(backend)
    assert not report.healthy
    assert {f.name for f in report.missing} == missing


def test_neuron_backend_ready_when_sdk_installed(host: dict) -> None:
    _install_neuron(host)
    host["neuron_ls"] = [{"neuron_device": 0, "nc_count": 2}, {"neuron_device": 1, "nc_count": 2}]
    report = doctor.diagnose("nxdi")
    assert report.healthy, report.missing
    devices = _by_name(report)["neuron devices"]
    assert devices.ok and devices.reason.startswith("4 NeuronCores (neuron-ls: 2 devices")


def test_missing_torch_fails_the_torch_backend(host: dict) -> None:
    del host["dists"]["torch"]
    report = doctor.diagnose("torch")
    assert [f.name for f in report.missing] == ["torch"]
    assert _by_name(report)["torch"].fix == "pip install torch"


def test_pypi_placeholder_is_detected(host: dict) -> None:
    host["dists"]["neuronx-cc"] = "0.0.0"  # installed, but no neuronxcc module to import
    cc = _by_name(doctor.diagnose("nxdi"))["neuronx-cc"]
    assert not cc.ok and "placeholder" in cc.reason
    assert cc.fix.startswith("pip uninstall -y neuronx-cc && pip install --extra-index-url")


def test_devices_without_neuron_ls_are_counted_from_dev(host: dict) -> None:
    host["devices"] = ["/dev/neuron0", "/dev/neuron1", "/dev/neuron2"]
    assert doctor.neuron_cores() == (6, "3 /dev/neuron* devices, no neuron-ls")


def test_no_devices_is_a_warning_for_neuron_backends(host: dict) -> None:
    _install_neuron(host)
    report = doctor.diagnose("tnx")
    devices = _by_name(report)["neuron devices"]
    assert not devices.ok and not devices.required and "compile works" in devices.reason
    assert report.healthy


def test_vllm_absent_is_fine(host: dict) -> None:
    vllm = _by_name(doctor.diagnose())["vllm"]
    assert vllm.ok and "not installed" in vllm.reason


def test_vllm_pypi_build_is_flagged(host: dict) -> None:
    host["dists"]["vllm"] = "0.6.3"
    vllm = _by_name(doctor.diagnose())["vllm"]
    assert not vllm.ok and "not a Neuron build" in vllm.reason
    assert "VLLM_TARGET_DEVICE=neuron" in vllm.fix


@pytest.mark.parametrize(
    ("dists", "how"),
    [
        ({"vllm": "0.6.dev0+neuron215"}, "Neuron build"),
        ({"vllm": "0.10.2", "vllm-neuron": "0.1.0"}, "vllm-neuron plugin 0.1.0"),
    ],
)
def test_vllm_neuron_builds_are_recognised(host: dict, dists: dict, how: str) -> None:
    host["dists"].update(dists)
    vllm = _by_name(doctor.diagnose())["vllm"]
    assert vllm.ok and how in vllm.reason


@pytest.mark.parametrize(
    ("vllm", "triton", "bad"),
    [
        ("0.6.dev0+neuron215", "2.1.0", True),
        ("0.5.3", "2.1.0", True),
        ("0.5.2", "2.1.0", False),
        ("0.6.2", "3.0.0", False),
    ],
)
def test_triton_2_1_0_with_vllm_0_5_3_or_newer(
    host: dict, vllm: str, triton: str, bad: bool
) -> None:
    host["dists"].update({"vllm": vllm, "triton": triton})
    found = _by_name(doctor.diagnose())
    assert ("triton" in found) is bad
    if bad:
        assert "default_dump_dir" in found["triton"].reason
        assert found["triton"].fix.startswith("pip install --upgrade triton==3.0.0")


def test_missing_vllm_neuron_models_module(host: dict, tmp_path: Path) -> None:
    root = tmp_path / "site-packages" / "vllm"
    (root / "model_executor" / "models").mkdir(parents=True)
    host["dists"]["vllm"] = "0.3.3+neuron"
    host["vllm_dir"] = root
    bad = _by_name(doctor.diagnose())["vllm.model_executor.models.neuron"]
    assert not bad.ok and "ModuleNotFoundError" in bad.reason
    assert "touch vllm/model_executor/models/neuron/__init__.py" in bad.fix
    (root / "model_executor" / "models" / "neuron").mkdir()
    assert "vllm.model_executor.models.neuron" not in _by_name(doctor.diagnose())


def test_disk_check_for_a_store_that_does_not_exist_yet(tmp_path: Path) -> None:
    found = doctor.disk_check(tmp_path / "not" / "yet")
    assert "GiB free at" in found.reason and str(tmp_path / "not" / "yet") in found.reason


def test_neuron_ls_output_is_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    out = json.dumps([{"neuron_device": 0, "nc_count": 8}])
    monkeypatch.setattr(doctor.shutil, "which", lambda name: "/opt/aws/neuron/bin/neuron-ls")
    monkeypatch.setattr(
        doctor.subprocess,
        "run",
        lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=out, stderr=""),
    )
    assert doctor.neuron_cores() == (8, "neuron-ls: 1 devices")


def test_neuron_ls_failure_falls_back_to_dev(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*a: Any, **k: Any) -> Any:
        raise subprocess.CalledProcessError(1, "neuron-ls")

    monkeypatch.setattr(doctor.shutil, "which", lambda name: "/usr/bin/neuron-ls")
    monkeypatch.setattr(doctor.subprocess, "run", broken)
    monkeypatch.setattr(doctor, "neuron_device_paths", lambda: [])
    assert doctor.neuron_cores() == (0, "no /dev/neuron* devices")


def test_real_lookups_on_this_host() -> None:
    # No monkeypatching: this host has torch and transformers, and no Neuron SDK.
    found = _by_name(doctor.diagnose("torch"))
    assert found["torch"].ok and found["transformers"].ok
    assert doctor.dist_version("surely-not-a-real-package-xyz") is None


def test_cli_json_and_exit_codes(host: dict) -> None:
    result = runner.invoke(app, ["doctor", "--json"])
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data["healthy"] is True and data["backend"] == "torch"
    assert {"name", "ok", "detail", "fix", "required"} <= set(data["checks"][0])
    result = runner.invoke(app, ["doctor", "--backend", "nxdi"])
    assert result.exit_code == 1
    assert "missing for the nxdi backend" in " ".join(result.stdout.split())


def test_json_keeps_the_documented_field_names() -> None:
    """docs/validate.md's doctor --json: a check's reason is "detail", its kind "section"."""
    check = Check("ninja", False, "not on PATH", fix="pip install ninja", required=True,
                  kind="host")
    assert doctor.DoctorReport("torch", [check]).as_dict() == {
        "healthy": False,
        "backend": "torch",
        "checks": [{"name": "ninja", "ok": False, "detail": "not on PATH",
                    "fix": "pip install ninja", "required": True, "section": "host"}],
    }


def test_cli_unknown_backend_is_a_usage_error() -> None:
    from tests.helpers import cli

    result = cli("doctor", "--backend", "cuda")
    assert result.returncode == 2 and "unknown backend" in result.stderr


@pytest.mark.parametrize(
    ("dists", "letter", "ok"),
    [
        ({"vllm": "0.6.dev0+neuron215"}, "A (tnx-fork)", True),
        ({"vllm": "0.9.2+neuron"}, "B (v0)", True),
        ({"vllm": "0.13.0", "vllm-neuron": "0.4.1"}, "C (plugin)", True),
        ({"vllm": "0.21.0", "vllm-neuron": "0.21.0"}, "D (native", False),
        ({"vllm": "0.11.0"}, "no Neuron support", False),
    ],
)
def test_doctor_names_the_vllm_generation(host: dict, dists: dict, letter: str, ok: bool) -> None:
    host["dists"].update(dists)
    found = _by_name(doctor.diagnose())["vllm generation"]
    assert letter in found.reason and found.ok is ok and not found.required


def test_tnx_on_sdk_2_26_is_known_bad(host: dict) -> None:
    """NxD Inference 0.N ships with SDK 2.(20+N): tags v0.5.9230 "Neuron 2.25.0 Release",
    v0.6.10598 "Neuron SDK Release 2.26.0 changes" (aws-neuron/neuronx-distributed-inference)."""
    host["dists"].update(
        {
            "vllm": "0.9.2+neuron",
            "transformers-neuronx": "0.13.322",
            "neuronx-distributed-inference": "0.6.10598",
        }
    )
    bad = _by_name(doctor.diagnose())["transformers-neuronx"]
    assert doctor.sdk_release() == (2, 26)
    host["dists"]["neuronx-distributed-inference"] = "0.5.9230"
    assert doctor.sdk_release() == (2, 25)
    report = doctor.diagnose()
    assert bad.kind == "known issues" and "SDK 2.26" in bad.reason
    assert not any(f.kind == "known issues" for f in report.checks)


def test_nxdi_on_inf2_from_sdk_2_29_is_known_bad(host: dict) -> None:
    host["dists"].update(
        {"vllm": "0.13.0", "vllm-neuron": "0.4.1", "neuronx-distributed-inference": "0.9.0"}
    )
    host["instance"] = "inf2.xlarge"
    bad = _by_name(doctor.diagnose())["neuronx-distributed-inference"]
    assert "Trn2+ only" in bad.reason and "0.4.1" in bad.fix
    host["instance"] = "trn2.48xlarge"
    assert "neuronx-distributed-inference" not in {
        f.name for f in doctor.diagnose().checks if f.kind == "known issues"
    }


def test_tnx_framework_variable_on_upstream_0_9_is_known_bad(host: dict, monkeypatch) -> None:
    """upstreaming-to-vllm dd417b3 vllm/platforms/neuron.py:117-121."""
    host["dists"]["vllm"] = "0.9.2+neuron"
    monkeypatch.setenv("VLLM_NEURON_FRAMEWORK", "transformers-neuronx")
    assert "AttributeError" in _by_name(doctor.diagnose())["VLLM_NEURON_FRAMEWORK"].reason
    host["dists"]["vllm"] = "0.7.2+neuron"  # the fork reads it safely
    assert "VLLM_NEURON_FRAMEWORK" not in _by_name(doctor.diagnose())


def test_two_platform_plugins_are_known_bad(host: dict, monkeypatch) -> None:
    host["dists"].update({"vllm": "0.13.0", "vllm-neuron": "0.4.1"})
    host["plugins"] = ("neuron", "optimum_neuron")
    bad = _by_name(doctor.diagnose())["vllm.platform_plugins"]
    assert "Only one platform plugin" in bad.reason and "VLLM_PLUGINS=neuron" in bad.fix
    monkeypatch.setenv("VLLM_PLUGINS", "neuron")
    assert "vllm.platform_plugins" not in _by_name(doctor.diagnose())


def test_doctor_says_whether_inductor_and_the_kernel_can_be_built(
    host: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = {"g++": "/usr/bin/g++", "ninja": "/usr/bin/ninja"}
    installed: list[str | None] = ["/env/lib/ninja/data/bin/ninja"]
    monkeypatch.setattr(doctor.shutil, "which", lambda name: found.get(name))
    monkeypatch.setattr(toolchain, "installed_ninja", lambda: installed[0])
    ok = doctor.toolchain_check("torch")
    assert ok.ok and "g++ and ninja" in ok.reason
    del found["ninja"]  # off PATH, but the ninja neuronctl installs is there: the build finds it
    assert doctor.toolchain_check("torch").ok
    installed[0] = None
    report = doctor.diagnose("torch")
    finding = next(f for f in report.checks if f.name == "c++ toolchain")
    assert not finding.ok and "no ninja" in finding.reason and "--compiler export" in finding.fix
    assert report.healthy  # export graphs need neither: a warning, not a failure
    found.clear()
    neuron = doctor.toolchain_check("nxdi")
    assert neuron.reason == "no C++ compiler or ninja on PATH (torch backend only)"
