"""Reuse validation on artifacts: intact, damaged, moved, and asked for another spec."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import neuronctl.validate as validate_mod
from neuronctl.checks import Check
from neuronctl.cli.main import app
from neuronctl.errors import BackendUnavailableError, NeuronctlError
from neuronctl.keys import FORMAT_VERSION
from neuronctl.spec import resolve_spec
from neuronctl.store.manifest import MANIFEST, read_manifest
from neuronctl.validate import Report, quick_validate, validate_artifact
from tests.helpers import cli

runner = CliRunner()

WEIGHT = "weights/graph_weights.safetensors"
GRAPH = "graphs/context_encoding_32.pt2"


class FakeBackend:
    """Only for the cases a real backend cannot produce here (a missing SDK, a Neuron host)."""

    name = "nxdi"

    def versions(self, spec: object = None) -> dict[str, str]:
        raise BackendUnavailableError("neuronx-distributed-inference is not installed")


@pytest.fixture
def artifact(compiled_artifact: Path, tmp_path: Path) -> Path:
    """A private copy of the real compiled artifact (conftest.TINY_SPEC): tests damage it. In
    a store of this user's, so that the trust check takes it for a local build."""
    store = tmp_path / "copy" / "neuron-compiled-artifacts"
    return Path(shutil.copytree(compiled_artifact, store / compiled_artifact.name))


def _cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """In-process (the fake backend applies); errors map to exit codes as main() maps them."""
    result = runner.invoke(app, ["validate", *args, "--json"], env=env)
    if isinstance(result.exception, NeuronctlError):
        return result.exception.exit_code, {"error": str(result.exception)}
    try:
        return result.exit_code, json.loads(result.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"not JSON (exit {result.exit_code}): {result.output}") from None


def _failed(report: Report | dict[str, Any]) -> dict[str, str]:
    checks = (report if isinstance(report, dict) else report.as_dict())["checks"]
    return {c["name"]: c["reason"] for c in checks if not c["ok"]}


def _edit_manifest(path: Path, reseal: bool = True, **changes: Any) -> None:
    """Change recorded values as if the artifact had been built that way (elsewhere, with
    other versions); `reseal=False` leaves record_sha256 as it was: a hand edit."""
    data = json.loads((path / MANIFEST).read_text())
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        target = data
        for p in parents:
            target = target[p]
        target[leaf] = value
    if reseal:
        from neuronctl.store.manifest import Manifest

        try:
            data["record_sha256"] = Manifest.model_validate(data).recorded_sha256()
        except ValueError:
            pass  # not a valid manifest: the test is about that
    (path / MANIFEST).write_text(json.dumps(data))


# --- intact, moved, copied ------------------------------------------------------------------


def test_intact_artifact_is_reusable_quick_and_deep(artifact: Path) -> None:
    assert quick_validate(artifact).reusable
    report = validate_artifact(artifact, deep=True)
    assert report.reusable, _failed(report)
    names = [c.name for c in report.checks]
    assert names[:2] == ["artifact", "files"] and "sha256" in names and "capacity" in names


def test_cli_exit_0_and_json_shape(artifact: Path) -> None:
    code, data = _cli(str(artifact))
    assert code == 0
    assert data["reusable"] is True and data["path"] == str(artifact)
    assert all({"name", "ok", "reason"} <= set(c) for c in data["checks"])


def test_moved_and_copied_artifact_is_reusable_and_generates(
    artifact: Path, compiled_artifact: Path, tmp_path: Path
) -> None:
    moved = tmp_path / "elsewhere" / "renamed"
    moved.parent.mkdir()
    artifact.rename(moved)
    copied = Path(shutil.copytree(moved, tmp_path / "second-copy"))
    prompt = [256, *b"Hello"]
    expected = _greedy(compiled_artifact, prompt)
    for path in (moved, copied):
        report = validate_artifact(path, deep=True)
        assert report.reusable, _failed(report)
        assert _greedy(path, prompt) == expected


def _greedy(path: Path, prompt: list[int], steps: int = 4) -> list[int]:
    """Load through the backend named in the manifest; prefill, then greedy decode."""
    from neuronctl.backends import get_backend

    manifest = read_manifest(path)
    runner = get_backend(manifest.backend).load(path, manifest)
    token = int(runner.prefill(0, prompt).argmax())
    out = [token]
    for i in range(steps - 1):
        ids = [token] + [0] * (runner.batch_size - 1)
        positions = [len(prompt) + i] + [-1] * (runner.batch_size - 1)
        token = int(runner.decode(ids, positions)[0].argmax())
        out.append(token)
    return out


def test_path_defaults_to_neuron_compiled_artifacts(artifact: Path) -> None:
    code, data = _cli(env={"NEURON_COMPILED_ARTIFACTS": str(artifact)})
    assert code == 0 and data["path"] == str(artifact)


def test_no_path_and_no_env_is_a_usage_error() -> None:
    result = cli("validate")  # the real entry point: one line, exit 2, no traceback
    assert result.returncode == 2
    assert "NEURON_COMPILED_ARTIFACTS" in result.stderr and "Traceback" not in result.stderr


def test_artifact_key_is_looked_up_in_the_store(compiled_artifact: Path) -> None:
    store_root = compiled_artifact.parent.parent
    code, data = _cli(compiled_artifact.name[:8], "--store", str(store_root))
    assert code == 0 and data["path"] == str(compiled_artifact)


# --- not an artifact ------------------------------------------------------------------------


def test_missing_path_fails_with_a_reason(tmp_path: Path) -> None:
    code, data = _cli(str(tmp_path / "nope"))
    assert code == 1
    assert "does not exist" in _failed(data)["artifact"]


def test_empty_directory_is_not_an_artifact(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    code, data = _cli(str(tmp_path / "empty"))
    assert code == 1
    assert "not an artifact: an empty directory" in _failed(data)["artifact"]


def test_corrupt_manifest_is_reported(artifact: Path) -> None:
    (artifact / MANIFEST).write_text("{not json")
    assert "unreadable" in _failed(quick_validate(artifact))["artifact"]


@pytest.mark.parametrize(
    ("version", "words"),
    [(FORMAT_VERSION + 1, "upgrade neuronctl"), (0, "recompile"),
     (2, "old artifact format 2 (this neuronctl reads 3): recompile with this neuronctl")],
)
def test_unknown_format_version(artifact: Path, version: int, words: str) -> None:
    """Format 2 is before every torch artifact recorded its op choice: no reader keeps it,
    validate names it and says what to do."""
    _edit_manifest(artifact, format_version=version)
    assert words in _failed(quick_validate(artifact))["artifact"]


def test_the_record_covers_ops_whatever_its_value(artifact: Path) -> None:
    """An artifact without an op choice (another backend's) records `ops: null` like any
    field: the digest is over every RECORDED field, none left out when it is empty."""
    import hashlib

    from neuronctl.keys import canonical_json
    from neuronctl.store.manifest import RECORDED

    manifest = read_manifest(artifact).model_copy(update={"ops": None})
    data = manifest.model_dump(mode="json", include=set(RECORDED))
    assert data["ops"] is None
    expected = hashlib.sha256(canonical_json(data).encode()).hexdigest()
    assert manifest.recorded_sha256() == expected


# --- damaged files --------------------------------------------------------------------------


def test_flipped_byte_passes_quick_and_fails_deep_naming_the_file(artifact: Path) -> None:
    shard = artifact / WEIGHT
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    assert quick_validate(artifact).reusable
    code, report = _cli(str(artifact), "--deep")
    assert code == 1
    assert _failed(report)["sha256"].startswith(WEIGHT)


def test_truncated_file_is_named(artifact: Path) -> None:
    with open(artifact / GRAPH, "r+b") as f:
        f.truncate(100)
    reason = _failed(quick_validate(artifact))["files"]
    assert "truncated" in reason and f"{GRAPH} (100 bytes" in reason


def test_missing_shard_is_named(artifact: Path) -> None:
    (artifact / WEIGHT).unlink()
    code, data = _cli(str(artifact))
    assert code == 1
    assert f"missing: {WEIGHT}" in _failed(data)["files"]


def test_stray_loader_file_fails_but_other_stray_files_do_not(artifact: Path) -> None:
    (artifact / "README.txt").write_text("notes")
    assert quick_validate(artifact).reusable
    (artifact / "weights" / "tp1_sharded_checkpoint.safetensors").write_bytes(b"x")
    reason = _failed(quick_validate(artifact))["extra files"]
    assert "weights/tp1_sharded_checkpoint.safetensors" in reason


# --- versions and host ----------------------------------------------------------------------


def test_older_torch_version_in_manifest_fails(artifact: Path) -> None:
    import torch

    _edit_manifest(artifact, backend_versions__torch="2.5.1")
    failed = _failed(quick_validate(artifact))
    assert f"torch compiled with 2.5.1, this host has {torch.__version__}" in failed["versions"]
    assert "torch==2.5.1" in failed["versions"]  # how to get the matching version back
    assert "torch version" not in failed  # said once, not again by the backend


def test_backend_sdk_missing_fails_with_its_message(
    artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(validate_mod, "_backend", lambda name: FakeBackend())
    assert "not installed" in _failed(quick_validate(artifact))["versions"]


def test_export_artifact_from_another_cpu_is_reusable(artifact: Path) -> None:
    # cpu_isa is a fact about the build host, judged by the backend, not by equality.
    _edit_manifest(artifact, backend_versions__cpu_isa="neon")
    assert quick_validate(artifact).reusable


def test_inductor_artifact_for_an_unsupported_isa_fails_the_host_check(artifact: Path) -> None:
    from neuronctl.backends.torch import TorchBackend

    # As an inductor artifact records them (the kernel digest where the graphs may call it).
    for name, value in TorchBackend().versions(
        read_manifest(artifact).spec.model_copy(update={"compiler": "inductor"})
    ).items():
        _edit_manifest(artifact, **{f"backend_versions__{name}": value})
    _edit_manifest(artifact, backend_versions__cpu_isa="neon", spec__compiler="inductor")
    failed = _failed(quick_validate(artifact))
    assert set(failed) == {"cpu isa"} and "compiled for neon" in failed["cpu isa"]


def test_neuron_cc_flags_must_match_for_neuron_backends(artifact: Path) -> None:
    manifest = read_manifest(artifact).model_copy(update={"backend": "nxdi"})
    env = {"NEURON_CC_FLAGS": "--model-type=transformer"}
    reason = validate_mod.check_cc_flags(manifest, env).reason
    assert not validate_mod.check_cc_flags(manifest, env).ok and "unset NEURON_CC_FLAGS" in reason
    recorded = manifest.model_copy(
        update={"spec": manifest.spec.model_copy(update={"cc_flags": "--model-type=transformer"})}
    )
    assert validate_mod.check_cc_flags(recorded, env).ok
    assert validate_mod.check_cc_flags(
        recorded, {"NEURON_CC_FLAGS": " --model-type=transformer "}
    ).ok


def test_neuron_cc_flags_do_not_block_torch_artifacts(
    artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NEURON_CC_FLAGS", "--model-type=transformer")
    assert quick_validate(artifact).reusable


def test_tp_degree_over_available_cores_fails(artifact: Path) -> None:
    _edit_manifest(artifact, spec__tp_degree=4096)
    failed = _failed(quick_validate(artifact))
    assert "4096" in failed["capacity"]
    assert "cores" not in {c.name for c in quick_validate(artifact).checks}  # not twice


def test_a_requested_tp_degree_is_compared_as_the_artifacts_backend_compiles_it(
    artifact: Path,
) -> None:
    """One process runs a torch artifact: any tp degree asks for the one it has (tp 1). A
    Neuron artifact's tp degree is its ranks: another one is a mismatch, also when the
    request names no backend (its default, torch, must not decide for the artifact)."""
    from neuronctl.validate import check_spec

    manifest = read_manifest(artifact)
    assert manifest.spec.tp_degree == 1
    for tp in (1, 2):
        requested, sources = resolve_spec({"tp_degree": tp})
        assert all(c.ok for c in check_spec(manifest, requested, sources)), tp
    nxdi = manifest.model_copy(update={"backend": "nxdi", "spec": manifest.spec.model_copy(
        update={"backend": "nxdi", "compiler": None, "tp_degree": 2})})
    same, sources = resolve_spec({"tp_degree": 2})
    assert all(c.ok for c in check_spec(nxdi, same, sources))
    other, sources = resolve_spec({"tp_degree": 4})
    failed = [c for c in check_spec(nxdi, other, sources) if not c.ok]
    assert [c.name for c in failed] == ["spec.tp_degree"]
    assert "requested 4" in failed[0].reason and "compiled 2" in failed[0].reason


def test_capacity_check_for_cpu_and_neuron_hosts(
    artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import neuronctl.doctor as doctor

    manifest = read_manifest(artifact)
    monkeypatch.setattr(validate_mod, "available_cpus", lambda: 1)
    assert validate_mod.check_capacity(manifest)[0].ok
    manifest.spec = manifest.spec.model_copy(update={"tp_degree": 2})
    assert "this host has 1" in validate_mod.check_capacity(manifest)[0].reason
    manifest.backend = "nxdi"
    monkeypatch.setattr(doctor, "neuron_cores", lambda: (0, "no /dev/neuron* devices"))
    assert "no NeuronCores" in validate_mod.check_capacity(manifest)[0].reason
    monkeypatch.setattr(doctor, "neuron_cores", lambda: (2, "neuron-ls: 1 devices"))
    assert validate_mod.check_capacity(manifest)[0].ok


# --- requested spec -------------------------------------------------------------------------

# One changed flag per compile-relevant field that has a flag: (flags, field that must fail).
CHANGED = [
    (["--seq-len", "256"], "seq_len"),
    (["--batch-size", "2"], "batch_size"),
    (["--backend", "nxdi", "--tp-degree", "2"], "tp_degree"),  # torch: tp is always 1
    (["--max-context-length", "32"], "max_context_length"),
    (["--dtype", "bfloat16"], "dtype"),
    (["--context-buckets", "64"], "context_buckets"),
    (["--token-gen-buckets", "128"], "token_gen_buckets"),
    (["--compiler", "inductor"], "compiler"),
    (["--override-neuron-config", '{"fused_qkv": true}'], "override_neuron_config"),
    (["--on-device-sampling", '{"top_k": 5}'], "on_device_sampling"),
    (["--backend", "nxdi"], "backend"),
    (["--backend", "nxdi", "--quantized"], "quantized"),
    (
        ["--backend", "nxdi", "--quantized", "--quantization-dtype", "f8e4m3fn"],
        "quantization_dtype",
    ),
    (
        ["--backend", "nxdi", "--quantized", "--quantization-type", "per_channel_symmetric"],
        "quantization_type",
    ),
    (["--backend", "nxdi", "--draft-model", "d", "--num-speculative-tokens", "4"], "draft_model"),
    (
        ["--backend", "nxdi", "--draft-model", "d", "--num-speculative-tokens", "4"],
        "num_speculative_tokens",
    ),
]


@pytest.mark.parametrize(("flags", "field"), CHANGED, ids=[c[1] for c in CHANGED])
def test_each_compile_relevant_field_changed_fails(
    artifact: Path, flags: list[str], field: str
) -> None:
    code, data = _cli(str(artifact), *flags)
    assert code == 1
    failed = _failed(data)
    reason = failed[f"spec.{field}"]
    assert "requested" in reason and "compiled" in reason and "recompile with" in reason


def test_every_graph_field_with_a_flag_is_covered() -> None:
    from neuronctl.cli._common import SPEC_OPTIONS
    from neuronctl.spec import GRAPH_FIELDS

    with_flag = set(GRAPH_FIELDS) & set(SPEC_OPTIONS)
    assert with_flag <= {field for _flags, field in CHANGED}


def test_reason_names_both_values_and_both_fixes(artifact: Path) -> None:
    _, data = _cli(str(artifact), "--seq-len", "256")
    reason = _failed(data)["spec.seq_len"]
    assert reason.startswith("requested 256 (flag), compiled 128")
    assert "recompile with --seq-len 256, or use --seq-len 128" in reason


def test_same_values_as_compiled_are_reusable(artifact: Path) -> None:
    code, data = _cli(
        str(artifact),
        "--seq-len",
        "128",
        "--batch-size",
        "4",
        "--compiler",
        "export",
        "--dtype",
        "auto",
        "--context-buckets",
        "32,64",
        "--max-context-length",
        "64",
    )
    assert code == 0, _failed(data)
    assert "seq_len" in {c["name"]: c["reason"] for c in data["checks"]}["spec"]


def test_defaults_the_user_did_not_set_are_not_compared(artifact: Path) -> None:
    # Compiled: batch 4, max context 64. The default batch size (1) is not a request.
    code, data = _cli(str(artifact), "--seq-len", "128", "--max-context-length", "64")
    assert code == 0, _failed(data)


def test_only_the_fields_given_are_compared(artifact: Path) -> None:
    # Compiled: seq len 128, max context 64. `--seq-len` asks about seq_len alone: the
    # max_context_length it would default to in a compile was not given, so it is not compared.
    code, data = _cli(str(artifact), "--seq-len", "128")
    assert code == 0, _failed(data)
    code, data = _cli(str(artifact), "--seq-len", "256")
    assert code == 1
    assert set(_failed(data)) == {"spec.seq_len"}


def test_spec_from_config_file_and_environment(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "neuronctl.toml"
    config.write_text("seq_len = 128\nbatch_size = 8\n")
    code, data = _cli(str(artifact), "-c", str(config))
    assert code == 1
    assert "from " + str(config) in _failed(data)["spec.batch_size"]
    monkeypatch.setenv("NEURON_TOKEN_GEN_BUCKETS", "32,64")
    code, data = _cli(str(artifact), "--batch-size", "4")
    assert "(environment)" in _failed(data)["spec.token_gen_buckets"]


def test_runtime_only_field_changed_is_still_reusable(artifact: Path, tmp_path: Path) -> None:
    config = tmp_path / "neuronctl.toml"
    config.write_text('model = "some-org/another-name"\nseq_len = 128\nmax_context_length = 64\n')
    code, data = _cli(str(artifact), "-c", str(config))
    assert code == 0
    notes = [c for c in data["checks"] if c["kind"] == "runtime-only"]
    assert [c["name"] for c in notes] == ["spec.model"]
    assert "runtime-only, may differ" in notes[0]["reason"]


def test_api_without_sources_compares_only_non_default_fields(artifact: Path) -> None:
    spec, _ = resolve_spec({"batch_size": 4}, env={})
    assert validate_artifact(artifact, spec).reusable
    spec, _ = resolve_spec({"batch_size": 3}, env={})
    assert set(_failed(validate_artifact(artifact, spec))) == {"spec.batch_size"}


def test_spec_that_does_not_fit_the_model_fails_the_spec_check(artifact: Path) -> None:
    code, data = _cli(str(artifact), "--tp-degree", "3")  # 4 heads
    assert code == 1 and "does not fit this model" in _failed(data)["spec"]


def test_invalid_spec_flag_is_a_usage_error(artifact: Path) -> None:
    code, data = _cli(str(artifact), "--context-buckets", "64,x")
    assert code == 2 and "64,x" in data["error"]


# --- checkpoint -----------------------------------------------------------------------------


def test_model_digest_must_match(artifact: Path, tiny_llama: Path, tmp_path: Path) -> None:
    from tests.helpers import make_checkpoint

    code, data = _cli(str(artifact), "--model", str(tiny_llama))
    assert code == 0, _failed(data)
    other = make_checkpoint(tmp_path / "other", "llama", seed=1)
    code, data = _cli(str(artifact), "--model", str(other))
    assert code == 1
    assert "the artifact was built from" in _failed(data)["checkpoint"]
    code, data = _cli(str(artifact), "--model", str(tmp_path / "missing"))
    assert "cannot read" in _failed(data)["checkpoint"]


def test_manifest_reader_agrees_with_the_artifact_check(artifact: Path) -> None:
    assert read_manifest(artifact).keys == quick_validate(artifact).manifest.keys


# --- one path rule, one verdict -----------------------------------------------------------


@pytest.mark.parametrize(
    "rel",
    ["../outside", "/etc/passwd", "graphs\\x.pt2", "manifest.json.tmp", "./config.json", "a//b"],
)
def test_a_manifest_naming_a_path_outside_the_rule_is_not_an_artifact(
    artifact: Path, rel: str
) -> None:
    data = json.loads((artifact / MANIFEST).read_text())
    data["files"][rel] = {"size": 1, "sha256": "0" * 64}
    (artifact / MANIFEST).write_text(json.dumps(data))
    failed = _failed(quick_validate(artifact))
    assert "not allowed" in failed["artifact"]
    from neuronctl.errors import NotFoundError
    from neuronctl.store.manifest import is_intact

    with pytest.raises(NotFoundError):
        read_manifest(artifact)
    assert not is_intact(artifact)


def test_a_listed_file_replaced_by_a_symlink_is_refused(artifact: Path, tmp_path: Path) -> None:
    from neuronctl.store.manifest import is_intact

    rel = "config.json"
    outside = tmp_path / "outside.json"
    shutil.copyfile(artifact / rel, outside)  # same size, same bytes: only the link differs
    (artifact / rel).unlink()
    (artifact / rel).symlink_to(outside)
    assert "a symlink" in _failed(validate_artifact(artifact, deep=True))["files"]
    assert not is_intact(artifact)


def test_a_symlinked_directory_on_the_way_is_refused(artifact: Path, tmp_path: Path) -> None:
    moved = tmp_path / "graphs-elsewhere"
    shutil.move(str(artifact / "graphs"), moved)
    (artifact / "graphs").symlink_to(moved, target_is_directory=True)
    assert "a symlink" in _failed(quick_validate(artifact))["files"]


def test_an_unlisted_symlink_is_a_risky_extra_file(artifact: Path) -> None:
    (artifact / "notes").symlink_to("/etc/hostname")
    assert "notes" in _failed(quick_validate(artifact))["extra files"]


def test_a_manifest_entry_naming_a_directory_fails_deep_validate_cleanly(artifact: Path) -> None:
    data = json.loads((artifact / MANIFEST).read_text())
    data["files"]["graphs"] = {"size": 4096, "sha256": "0" * 64}
    (artifact / MANIFEST).write_text(json.dumps(data))
    report = validate_artifact(artifact, deep=True)  # used to raise IsADirectoryError
    assert "a directory" in _failed(report)["files"]


@pytest.mark.parametrize("private", [".staging", ".failed", ".trash"])
def test_nothing_under_a_store_private_directory_validates(
    compiled_artifact: Path, tmp_path: Path, private: str
) -> None:
    """A killed build's staging dir or a failed pull's leftovers can hold a manifest that
    matches their files: still never an artifact."""
    from neuronctl.store.manifest import is_intact

    leftover = tmp_path / "neuron-compiled-artifacts" / private / f"{compiled_artifact.name}.1"
    shutil.copytree(compiled_artifact, leftover)
    for deep in (False, True):
        assert "not an artifact" in _failed(validate_artifact(leftover, deep=deep))["artifact"]
    assert not is_intact(leftover)


def test_json_keeps_the_documented_field_names() -> None:
    """docs/validate.md's validate --json: name, ok, reason, kind per check, nothing more."""
    checks = [Check("files", False, "missing: model.pt"), Check("cores", True, "2", kind="host")]
    assert Report(Path("art"), checks).as_dict() == {
        "reusable": False,
        "path": "art",
        "checks": [
            {"name": "files", "ok": False, "reason": "missing: model.pt", "kind": "check"},
            {"name": "cores", "ok": True, "reason": "2", "kind": "host"},
        ],
    }
