"""`neuronctl artifacts push | pull` as users run them, against a real S3 server.

One push runs in a real process (the entry point as installed); the rest run the same entry
point in this process (`cli_in_process`), as what they test is what a command prints and
decides, not the process."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from neuronctl.store.manifest import read_manifest
from tests.helpers import cli, cli_in_process
from tests.test_remote import (  # noqa: F401  (fixtures)
    _client,
    bucket,
    make_artifact,
    s3server,
    sample_files,
    tree_bytes,
    trusted_env,  # pushes sign with $NEURONCTL_SIGNING_KEY, pulls trust $NEURONCTL_TRUSTED_KEYS
)


def neuronctl(*args: str) -> subprocess.CompletedProcess[str]:
    return cli_in_process(*args)  # type: ignore[no-any-return]


def test_push_then_pull_by_key_prefix(tmp_path: Path, bucket: str) -> None:  # noqa: F811
    artifact = make_artifact(tmp_path / "a", sample_files(big=50_000))
    url = f"s3://{bucket}/fleet"

    pushed = cli(  # the real process
        "artifacts", "push", artifact.name[:8], url, "--store", str(tmp_path / "a"), "--json"
    )
    repushed = neuronctl("artifacts", "push", str(artifact), url, "--json")
    pulled = neuronctl(
        "artifacts", "pull", f"{url}/{artifact.name[:8]}", "--store", str(tmp_path / "b"), "--json"
    )
    again = neuronctl(
        "artifacts", "pull", f"{url}/{artifact.name}", "--store", str(tmp_path / "b"), "--json"
    )

    assert pushed.returncode == 0, pushed.stderr
    first = json.loads(pushed.stdout)
    assert first["key"] == artifact.name and not first["noop"]
    assert first["uploaded_bytes"] == read_manifest(artifact).total_size()
    assert json.loads(repushed.stdout)["noop"] is True
    assert pulled.returncode == 0, pulled.stderr
    data = json.loads(pulled.stdout)
    assert data["cache_hit"] is False and data["downloaded_bytes"] > 0
    assert tree_bytes(Path(data["path"])) == tree_bytes(artifact)
    assert json.loads(again.stdout)["cache_hit"] is True


def test_pull_of_a_corrupted_artifact_fails_naming_the_file(
    tmp_path: Path,
    bucket: str,  # noqa: F811
) -> None:
    artifact = make_artifact(tmp_path / "a", sample_files(big=50_000))
    url = f"s3://{bucket}"
    assert neuronctl("artifacts", "push", str(artifact), url).returncode == 0
    rel = "graphs/tkg_128.pt2"
    key = f"neuron-compiled-artifacts/{artifact.name}/{rel}"
    body = bytearray(_client().get_object(Bucket=bucket, Key=key)["Body"].read())
    body[0] ^= 1
    _client().put_object(Bucket=bucket, Key=key, Body=bytes(body))

    result = neuronctl(
        "artifacts", "pull", f"{url}/{artifact.name}", "--store", str(tmp_path / "b")
    )

    assert result.returncode == 1
    assert rel in result.stderr and "corrupted" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "b" / "neuron-compiled-artifacts" / artifact.name).exists()


def test_pull_errors_have_exit_codes(tmp_path: Path, bucket: str) -> None:  # noqa: F811
    missing = neuronctl(
        "artifacts", "pull", f"s3://{bucket}/{'0' * 20}", "--store", str(tmp_path), "--json"
    )
    assert missing.returncode == 1
    assert "no artifact" in json.loads(missing.stdout)["error"]
    bad = neuronctl("artifacts", "pull", "s3://bucket-only", "--store", str(tmp_path))
    assert bad.returncode == 2 and "does not name" in bad.stderr
    unknown = neuronctl("artifacts", "push", "nope", f"s3://{bucket}", "--store", str(tmp_path))
    assert unknown.returncode == 1 and "no artifact" in unknown.stderr


def test_unreachable_remote_is_one_line_exit_1_not_an_internal_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    artifact = make_artifact(tmp_path / "store", {"w.bin": b"w" * 10})
    refused = neuronctl("artifacts", "push", str(artifact), "ftp://127.0.0.1:1/x", "--json")
    assert refused.returncode == 1, refused.stderr
    assert "internal error" not in refused.stderr
    assert "ftp://127.0.0.1:1/x" in json.loads(refused.stdout)["error"]

    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    no_creds = neuronctl("artifacts", "pull", "s3://bucket/abc123", "--store", str(tmp_path))
    assert no_creds.returncode == 1, no_creds.stderr
    assert "internal error" not in no_creds.stderr
    assert "credentials" in no_creds.stderr and "hint:" in no_creds.stderr
