"""`neuronctl plan`: a builds file -> keys without compiling, and a CI matrix of what is missing."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from neuronctl.build import resolve_build
from neuronctl.errors import SpecError, UsageError
from neuronctl.plan import load_plan
from neuronctl.store.remote.client import open_remote
from tests.helpers import cli_in_process, make_checkpoint
from tests.test_remote import bucket, make_artifact, s3server  # noqa: F401  (fixtures)

BUILDS = """
[defaults]
seq_len = 128

[[build]]
model = "./models/llama"
matrix = { batch_size = [1, 2] }

[[build]]
model = "models/qwen"
name = "qwen"
tp_degree = 2
context_buckets = [64, 128]

[gitlab]
image = "python:3.11"
tags = ["inf2"]
"""


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("plan-models")
    make_checkpoint(root / "llama", "llama")
    make_checkpoint(root / "qwen", "qwen2")
    return root


@pytest.fixture()
def builds(tmp_path: Path, models: Path) -> Path:
    shutil.copytree(models, tmp_path / "models")
    path = tmp_path / "builds.toml"
    path.write_text(BUILDS)
    return path


def neuronctl(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The CLI in this process: plan's output and exit codes, not a process, are tested."""
    return cli_in_process(*args, cwd=cwd)  # type: ignore[no-any-return]


def test_load_plan_expands_matrices_and_merges_defaults(builds: Path) -> None:
    entries = load_plan(builds)

    assert [e.index for e in entries] == [0, 1, 2]
    assert [e.name for e in entries] == ["llama-bs1", "llama-bs2", "qwen"]
    assert entries[0].spec_flags == {"seq_len": 128, "batch_size": 1}
    assert entries[2].spec_flags == {"seq_len": 128, "tp_degree": 2, "context_buckets": [64, 128]}
    # Relative model paths are relative to the plan file, not the working directory.
    assert entries[0].model == str(builds.parent / "models" / "llama")
    assert entries[2].model == str(builds.parent / "models" / "qwen")


@pytest.mark.parametrize(
    ("text", "error", "match"),
    [
        ("[[build]]\nmodel = 'x'\ntp = 2\n", SpecError, "unknown key 'tp'"),
        ("[[build]]\ntp_degree = 2\n", SpecError, "needs `model`"),
        ("[defaults]\nseq_len = 1\n", UsageError, "no \\[\\[build\\]\\]"),
        ("[[build]]\nmodel = 'x'\nmatrix = { tp_degree = 2 }\n", SpecError, "non-empty list"),
        ("[jobs]\n", UsageError, "unknown table 'jobs'"),
        ("[[build]\n", UsageError, "not valid TOML"),
    ],
)
def test_invalid_plan_files_are_usage_errors(
    tmp_path: Path, text: str, error: type[Exception], match: str
) -> None:
    path = tmp_path / "builds.toml"
    path.write_text(text)
    with pytest.raises(error, match=match):
        load_plan(path)


def push_entry(builds: Path, index: int, remote_url: str, tmp_path: Path) -> str:
    """Make the remote hold the artifact of one entry (synthetic files, the entry's real key)."""
    entry = load_plan(builds)[index]
    keys = resolve_build(entry.model, entry.spec_flags).keys
    artifact = make_artifact(tmp_path / "built", {"model.pt": b"x" * 100}, seed="unused")
    # make_artifact keys from a seed; rename to the entry's key by republishing its manifest.
    manifest = json.loads((artifact / "manifest.json").read_text())
    manifest["keys"] = keys.as_dict()
    target = artifact.parent / keys.dirname
    artifact.rename(target)
    (target / "manifest.json").write_text(json.dumps(manifest))
    open_remote(remote_url).push(target)
    return keys.dirname


def test_json_format_lists_keys_and_remote_presence(builds: Path, tmp_path: Path) -> None:
    remote = f"file://{tmp_path / 'remote'}"
    present = push_entry(builds, 1, remote, tmp_path)

    result = neuronctl("plan", "builds.toml", "--remote", remote, "--json", cwd=builds.parent)

    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    builds_out = data["builds"]
    assert [b["remote"] for b in builds_out] == [False, True, False]
    assert builds_out[1]["key"] == present
    assert data["to_compile"] == [0, 2]
    # The keys are the ones compile would publish: the same resolution `neuronctl hash` uses.
    for entry, out in zip(load_plan(builds), builds_out, strict=True):
        assert out["artifact_key"] == resolve_build(entry.model, entry.spec_flags).keys.artifact
    assert len({b["artifact_key"] for b in builds_out}) == 3


def test_github_format_is_a_matrix_of_missing_builds(builds: Path, tmp_path: Path) -> None:
    remote = f"file://{tmp_path / 'remote'}"
    present = push_entry(builds, 0, remote, tmp_path)

    result = neuronctl(
        "plan", "builds.toml", "--remote", remote, "-f", "github", cwd=builds.parent
    )

    assert result.returncode == 0, result.stderr
    outputs = dict(line.split("=", 1) for line in result.stdout.strip().splitlines())
    matrix = json.loads(outputs["matrix"])
    assert [m["entry"] for m in matrix["include"]] == [1, 2]
    assert [m["name"] for m in matrix["include"]] == ["llama-bs2", "qwen"]
    assert outputs["count"] == "2"
    assert present in json.loads(outputs["keys"]) and len(json.loads(outputs["keys"])) == 3


def test_gitlab_format_is_a_child_pipeline(builds: Path, tmp_path: Path) -> None:
    remote = f"file://{tmp_path / 'remote'}"
    push_entry(builds, 2, remote, tmp_path)

    result = neuronctl(
        "plan", "builds.toml", "--remote", remote, "--format", "gitlab", cwd=builds.parent
    )

    assert result.returncode == 0, result.stderr
    pipeline = yaml.safe_load(result.stdout)
    jobs = {name: job for name, job in pipeline.items() if name != "stages"}
    assert pipeline["stages"] == ["compile"]
    assert sorted(jobs) == ["compile 0 llama-bs1", "compile 1 llama-bs2"]
    job = jobs["compile 1 llama-bs2"]
    assert job["image"] == "python:3.11" and job["tags"] == ["inf2"]
    assert job["script"] == [f"neuronctl compile --plan builds.toml --entry 1 --remote {remote}"]
    assert job["variables"]["NEURONCTL_PLAN_ENTRY"] == "1"
    assert "&id" not in result.stdout  # no YAML anchors: GitLab users read this file


def test_gitlab_format_with_everything_present_has_a_noop_job(builds: Path, tmp_path: Path) -> None:
    remote = f"file://{tmp_path / 'remote'}"
    for index in range(3):
        push_entry(builds, index, remote, tmp_path / str(index))

    result = neuronctl(
        "plan", "builds.toml", "--remote", remote, "-f", "gitlab", cwd=builds.parent
    )

    pipeline = yaml.safe_load(result.stdout)
    assert [name for name in pipeline if name != "stages"] == ["nothing to compile"]


def test_table_format_and_s3_remote(builds: Path, tmp_path: Path, bucket: str) -> None:  # noqa: F811
    remote = f"s3://{bucket}/ci"
    present = push_entry(builds, 2, remote, tmp_path)

    result = neuronctl("plan", str(builds), "--remote", remote, cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "llama" in line or "qwen" in line]
    assert len(lines) == 3
    assert present in lines[2] and "present" in lines[2]
    assert all("missing" in line for line in lines[:2])


def test_plan_errors_name_the_entry(builds: Path) -> None:
    shutil.rmtree(builds.parent / "models" / "qwen")
    result = neuronctl("plan", "builds.toml", cwd=builds.parent)
    assert result.returncode == 1
    assert "entry 2 (qwen)" in result.stderr
    bad = neuronctl("plan", "builds.toml", "-f", "yaml", cwd=builds.parent)
    assert bad.returncode == 2 and "unknown format" in bad.stderr


@pytest.mark.parametrize("kind", ["directory", "binary"])
def test_unreadable_plan_file_is_a_usage_error_not_a_crash(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "builds.toml"
    if kind == "directory":
        path.mkdir()
    else:
        path.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(UsageError, match="cannot read the build plan"):
        load_plan(path)
